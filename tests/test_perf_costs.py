"""Each cost term of mscale_jax.perf against a hand calculation."""
import dataclasses

import pytest

from mscale_jax.perf import comm, compute, iteration, layer, memory, scale
from mscale_jax.perf.constants import DEFAULT, Constants
from mscale_jax.perf.hardware import A100_MEGASCALE as A100
from mscale_jax.perf.workload import GPT_175B, Layout, Techniques

C = Constants(gemm_eff_max=0.8, gemm_edge=0.0, hbm_eff=1.0, kernel_gap_s=0.0, nvlink_eff=1.0,
              net_eff=1.0, flash_attn_eff=0.5)
PEAK = 312e12
LAYOUT = Layout(tp=8, pp=8, vpp=6, dp=4, micro_batch=1, global_batch=256)


def test_gemm_time_is_flops_over_efficient_peak():
  # 2*m*k*n FLOPs at 80% of 312 TFLOP/s.
  assert compute.gemm_time(2048, 12288, 4608, PEAK, C) == pytest.approx(
      2 * 2048 * 12288 * 4608 / (0.8 * PEAK))


def test_gemm_efficiency_curve():
  c = dataclasses.replace(C, gemm_edge=32.0)
  assert compute.gemm_efficiency(1024, 1024, 1024, c) == pytest.approx(0.8 / (1 + 32 * 3 / 1024))
  assert compute.gemm_efficiency(256, 12288, 4608, c) < compute.gemm_efficiency(2048, 12288,
                                                                                4608, c)


def test_attention_pairs():
  assert compute.attention_pairs(4, None, causal_skip=True) == 10        # 4+3+2+1
  assert compute.attention_pairs(4, 2, causal_skip=True) == 7            # 1+2+2+2
  assert compute.attention_pairs(4, None, causal_skip=False) == 16
  assert compute.attention_pairs(4, 2, causal_skip=False) == 8


def test_flash_attention_time():
  fwd, bwd = compute.flash_attention_time(2048, 2048, 16, 96, None, PEAK, C)
  pairs = 2048 * 2049 / 2 * 16
  assert fwd == pytest.approx(4 * pairs * 96 / (0.5 * PEAK))
  assert bwd == pytest.approx(2.5 * fwd)


def test_memory_time_and_elementwise():
  assert compute.memory_time(2039e9, A100.hbm_bw, C) == pytest.approx(1.0)
  fwd, bwd = compute.elementwise_time(1e9, (2, 3), 1e12, C)
  assert (fwd, bwd) == pytest.approx((2e-3, 3e-3))


def test_group_link_picks_tier():
  assert comm.group_link(A100, 8, 1, C).tier == "node"
  assert comm.group_link(A100, 8, 1, C).bw == pytest.approx(300e9)
  assert comm.group_link(A100, 4, 8, C).tier == "tor"          # 4 nodes
  assert comm.group_link(A100, 4, 8, C).bw == pytest.approx(25e9)   # one 200 Gb/s NIC each
  assert comm.group_link(A100, 64, 8, C).tier == "tor"          # spans 505 GPUs <= 512
  assert comm.group_link(A100, 65, 8, C).tier == "aggregation"  # spans 513
  assert comm.group_link(A100, 1000, 8, C).tier == "spine"


def test_ring_with_several_ranks_per_node_is_bound_by_its_busiest_link():
  """NCCL's ring enters and leaves each node once per channel: per step a node's NICs carry one
  chunk, a device's NVLink (g-1)/g of one. By hand, with C's full efficiencies on A100 nodes
  (NVLink 300 GB/s, 8 x 25 GB/s NICs) and the ToR's 15 us per step."""
  # TP=2, DP=16: g = 4 ranks per node in 4 nodes. NICs: 4 x 25 = 100 GB/s; NVLink would allow
  # 300 x 4/3 = 400. NIC-bound: 15 steps of 15 us + 15/16 of 1.6 GB at 100 GB/s.
  link = comm.ring_link(A100, 16, 2, C)
  assert (link.tier, link.bw) == ("tor", pytest.approx(100e9))
  assert comm.reduce_scatter_time(1.6e9, 16, link) == pytest.approx(15 * 15e-6 + 0.015)
  # NVLink cut to 100 GB/s, TP=1, DP=32: g = 8 in 4 nodes. NICs: 8 x 25 = 200 GB/s; NVLink:
  # each step a device sends 7/8 of a 3.2 GB / 32 chunk at 100 GB/s. NVLink-bound:
  # 31 steps of 15 us + 31 x (7/8 x 0.1 GB) / 100 GB/s = 465 us + 27.125 ms.
  slow_nvlink = dataclasses.replace(A100, intra_node_bw=100e9)
  link = comm.ring_link(slow_nvlink, 32, 1, C)
  assert link.bw == pytest.approx(100e9 * 8 / 7)
  assert comm.all_gather_time(3.2e9, 32, link) == pytest.approx(465e-6 + 27.125e-3)
  # A flat ring charging every hop to one NIC share (25 GB/s) would take 31/32 x 3.2 GB / 25 GB/s
  # = 124 ms: 4.5x the ring NCCL runs.
  assert comm.group_link(slow_nvlink, 32, 1, C).bw == pytest.approx(25e9)


def test_dp_rings_at_one_rank_per_node_are_unchanged():
  """With tensor parallelism filling the node (every MegaScale row) the ring's link is the
  group's network link itself, so every prediction made before the two-level ring stands to the
  last bit; a group inside one node rings over NVLink as before."""
  for dp, tp in ((2, 8), (4, 8), (64, 8), (65, 8), (1000, 8), (6, 16), (8, 1), (2, 4)):
    assert comm.ring_link(A100, dp, tp, DEFAULT) == comm.group_link(A100, dp, tp, DEFAULT)
  n = memory.params_per_device(GPT_175B, LAYOUT)
  flat = comm.group_link(A100, LAYOUT.dp, LAYOUT.tp, DEFAULT)
  assert iteration.dp_times(GPT_175B, LAYOUT, A100, DEFAULT) == (
      comm.reduce_scatter_time(n * DEFAULT.grad_reduce_bytes, LAYOUT.dp, flat),
      comm.all_gather_time(n * DEFAULT.param_bytes, LAYOUT.dp, flat))


def test_ring_collectives():
  link = comm.Link(bw=100e9, latency_s=1e-5, tier="x")
  # (n-1) steps of latency, (n-1)/n of the buffer over the link.
  assert comm.all_gather_time(8e9, 8, link) == pytest.approx(7e-5 + 7 / 8 * 0.08)
  assert comm.reduce_scatter_time(8e9, 8, link) == comm.all_gather_time(8e9, 8, link)
  assert comm.all_reduce_time(8e9, 8, link) == pytest.approx(14e-5 + 2 * 7 / 8 * 0.08)
  assert comm.all_gather_time(8e9, 1, link) == 0.0


def test_all_reduce_picks_tree_for_small_messages():
  link = comm.Link(bw=100e9, latency_s=1e-5, tier="x")
  tree = 2 * 10 * 1e-5 + 2 * 1e3 / 100e9        # log2(1024) = 10
  assert comm.all_reduce_time(1e3, 1024, link) == pytest.approx(tree)


def test_send_recv():
  link = comm.Link(bw=20e9, latency_s=5e-5, tier="x")
  assert comm.send_recv_time(20e6, link) == pytest.approx(5e-5 + 1e-3)


def test_tp_collective_and_exposure():
  # [2048 tokens x 12288] bf16 = 50.3 MB all-gathered over 8 GPUs on NVLink.
  size = 2048 * 12288 * 2
  expect = 7 * A100.intra_node_latency_s + 7 / 8 * size / 300e9
  assert layer.tp_collective_time(GPT_175B, LAYOUT, A100, C) == pytest.approx(expect)
  assert layer.tp_exposure(8.0, 100.0, 8, False, 0.1) == 8.0
  assert layer.tp_exposure(8.0, 100.0, 8, True, 0.1) == pytest.approx(1.0 + 0.1 * 7.0)
  assert layer.tp_exposure(8.0, 3.0, 8, True, 0.1) == pytest.approx(1.0 + 4.0 + 0.1 * 3.0)
  assert comm.sm_share(A100, dataclasses.replace(C, comm_sms=27)) == pytest.approx(0.25)


def test_dp_exposure():
  assert iteration.dp_exposure(3.0, 1.0, 4, False, 9.0, 9.0, 0.0, 0.1) == 4.0
  # Windows long enough: the last chunk's reduce-scatter and the first chunk's all-gather are
  # exposed; the other 3 chunks' 3 s of traffic hide and slow compute by its 10% SM share.
  assert iteration.dp_exposure(3.0, 1.0, 4, True, 9.0, 9.0, 0.0, 0.1) == pytest.approx(
      0.75 + 0.25 + 0.3)
  assert iteration.dp_exposure(3.0, 1.0, 4, True, 9.0, 9.0, 1.0, 0.1) == pytest.approx(0.75 + 0.3)


def test_dp_overlap_waits_for_the_last_micro_batch():
  """Gradients accumulate over micro-batches: a chunk's reduce-scatter hides only behind the
  next chunk down's backward ticks, its all-gather only behind the chunk before's forwards;
  what overflows a window is exposed once per chunk, and only that traffic stops costing SMs."""
  rs, ag, chunks, share = 3.0, 1.0, 4, 0.1
  long = iteration.dp_exposure(rs, ag, chunks, True, 9.0, 9.0, 0.0, share)
  short = iteration.dp_exposure(rs, ag, chunks, True, 0.1, 0.5, 0.0, share)
  late = 3 * ((0.75 - 0.5) + (0.25 - 0.1))
  assert short == pytest.approx(long + late - share * late) and short > long
  # In a prediction: a small micro-batch on a slow network leaves short windows.
  slow = dataclasses.replace(A100, nic_bw=A100.nic_bw / 16)
  tech = Techniques(dp_overlap=True, efficient_ops=True, pp_overlap=True)
  lay = Layout(tp=8, pp=8, vpp=6, dp=4, micro_batch=1, global_batch=256)
  pred = iteration.predict(GPT_175B, lay, tech, slow, DEFAULT)
  rs_s, ag_s = iteration.dp_times(GPT_175B, lay, slow, DEFAULT)
  stage = (pred.breakdown["compute"] + pred.breakdown["memory_bound"]
           + pred.breakdown["tp_exposed"]) / lay.num_micro_batches
  ag_window, rs_window = 8 * stage / 6 / 3, 8 * 2 * stage / 6 / 3
  assert ag_s / 6 > ag_window or rs_s / 6 > rs_window          # the windows are too short here
  whole_step = iteration.dp_exposure(rs_s, ag_s, 6, True, 1e9, 1e9, 0.0,
                                     comm.sm_share(slow, DEFAULT))
  assert pred.breakdown["dp_exposed"] > whole_step + 0.01


def test_p2p_time_sends_sequence_shard():
  num_bytes = 2048 * 12288 * 2 / 8
  expect = DEFAULT.p2p_latency_s + num_bytes / (25e9 * DEFAULT.p2p_eff)
  assert iteration.p2p_time(GPT_175B, LAYOUT, A100, DEFAULT) == pytest.approx(expect)


def test_p2p_time_derated_by_ecmp_above_the_tor():
  """Stages 8 * 96 ranks apart cross the aggregation tier: the send keeps the ECMP share of the
  bandwidth, as the DP rings do; with ECMP collisions off it does not; under the ToR, no change."""
  far = Layout(tp=8, pp=8, vpp=6, dp=96, micro_batch=1, global_batch=96 * 48)
  assert comm.group_link(A100, 2, 8 * 96, DEFAULT).tier == "aggregation"
  num_bytes = 2048 * 12288 * 2 / 8
  off = dataclasses.replace(DEFAULT, ecmp_collisions=False)
  bw = 25e9 * DEFAULT.p2p_eff
  assert iteration.p2p_time(GPT_175B, far, A100, off) == pytest.approx(
      DEFAULT.p2p_latency_s + num_bytes / bw)
  share = scale.ecmp_share(DEFAULT)
  assert share < 1.0
  assert iteration.p2p_time(GPT_175B, far, A100, DEFAULT) == pytest.approx(
      DEFAULT.p2p_latency_s + num_bytes / (bw * share))
  assert iteration.p2p_time(GPT_175B, LAYOUT, A100, off) == iteration.p2p_time(
      GPT_175B, LAYOUT, A100, DEFAULT)
  # Megatron-LM's blocking sends are on the critical path: their exposed time grows by 1/share.
  on_pp, off_pp = (iteration.predict(GPT_175B, far, Techniques(), A100, c).breakdown["pp_exposed"]
                   for c in (DEFAULT, off))
  assert on_pp > off_pp


def test_bubble_is_interleaved_1f1b():
  tech = Techniques(pp_overlap=False)
  pred = iteration.predict(GPT_175B, LAYOUT, tech, A100, DEFAULT)
  m = LAYOUT.num_micro_batches
  per_mb = (pred.breakdown["compute"] + pred.breakdown["memory_bound"]
            + pred.breakdown["tp_exposed"] + pred.breakdown["pp_exposed"]) / m
  assert pred.breakdown["bubble"] == pytest.approx((8 - 1) / 6 * per_mb)


def test_memory_terms():
  n = (12 * GPT_175B.params_per_layer + 64000 * 12288) / 8
  assert memory.params_per_device(GPT_175B, LAYOUT) == pytest.approx(n)
  mem = memory.memory_per_device(GPT_175B, LAYOUT, Techniques(efficient_ops=True), "none",
                                 A100.hbm_bytes, DEFAULT)
  assert mem.params == pytest.approx(2 * n)
  assert mem.grads == pytest.approx(4 * n)
  assert mem.optimizer == pytest.approx(12 * n / 4)
  sbh = 2048 * 12288
  assert mem.activations == pytest.approx(96 * (1 + 7 / 48) * 34 * sbh / 8)


def test_async_checkpoint_adds_one_device_copy_of_the_train_state():
  """checkpoint.py copies the state (params and optimizer state, as sharded) into fresh device
  buffers before an asynchronous save's write: one more state, counted in the total, which can
  turn a fitting layout into one that does not."""
  for layout in (LAYOUT, dataclasses.replace(LAYOUT, dp=8, tp=4),
                 dataclasses.replace(LAYOUT, pp=4, vpp=1)):
    tech = Techniques(efficient_ops=True)
    sync = memory.memory_per_device(GPT_175B, layout, tech, "none", A100.hbm_bytes, DEFAULT)
    async_ = memory.memory_per_device(GPT_175B, layout,
                                      dataclasses.replace(tech, async_checkpoint=True), "none",
                                      A100.hbm_bytes, DEFAULT)
    n = memory.params_per_device(GPT_175B, layout)
    assert sync.checkpoint_copy == 0.0
    assert async_.checkpoint_copy == pytest.approx(2 * n + 12 * n / layout.dp)
    assert async_.total - sync.total == pytest.approx(async_.checkpoint_copy)
    assert (async_.params, async_.optimizer, async_.activations) == \
        (sync.params, sync.optimizer, sync.activations)
  # A capacity between the two totals: fits without the copy, not with it.
  between = (sync.total + async_.total) / 2
  assert memory.Memory(**{**dataclasses.asdict(sync), "capacity": between}).fits
  assert not memory.Memory(**{**dataclasses.asdict(async_), "capacity": between}).fits


def test_breakdown_sums_and_mfu_uses_megatron_formula():
  pred = iteration.predict(GPT_175B, LAYOUT, Techniques(), A100, DEFAULT)
  assert sum(pred.breakdown.values()) == pytest.approx(pred.iteration_s)
  tokens_per_s = 256 * 2048 / pred.iteration_s
  assert pred.mfu == pytest.approx(tokens_per_s * 1.0762e12 / (256 * 312e12), rel=1e-4)


def test_unfused_attention_time():
  # One sequence, 16 local heads: QK^T and PV are batched (2048 x 96) @ (96 x 2048) GEMMs; the
  # softmax makes 2 passes forward and 3 backward over the bf16 score tensor.
  one = compute.gemm_time(2048, 96, 2048, PEAK, C, count=16)
  scores = 2048 * 2048 * 16 * 2.0
  fwd, bwd = compute.unfused_attention_time(2048, 2048, 16, 96, None, PEAK, 1e12, C,
                                            recompute=False)
  assert fwd == pytest.approx(2 * one + 2 * scores / 1e12)
  assert bwd == pytest.approx(4 * one + 3 * scores / 1e12)
  _, bwd_rc = compute.unfused_attention_time(2048, 2048, 16, 96, None, PEAK, 1e12, C,
                                             recompute=True)
  assert bwd_rc == pytest.approx(bwd + fwd)


def test_layer_gemms_are_three_times_the_forward_flops():
  # With a flat efficiency, forward + backward GEMM time is 3 x 24 s h^2 / tp FLOPs at 80%.
  tech = Techniques(efficient_ops=True)
  for block in (False, True):
    cost = layer.layer_cost(GPT_175B, LAYOUT, dataclasses.replace(tech, parallel_block=block),
                            "none", A100, C)
    assert cost.gemm == pytest.approx(3 * 24 * 2048 * 12288 ** 2 / 8 / (0.8 * PEAK))


def test_head_cost_gemm():
  cost = layer.head_cost(GPT_175B, LAYOUT, Techniques(), A100, C)
  assert cost.gemm == pytest.approx(3 * 2 * 2048 * 12288 * 8000 / (0.8 * PEAK))
