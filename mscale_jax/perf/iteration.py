"""One iteration of 3D-parallel training: interleaved 1F1B (or ZB-H1) pipeline, ZeRO-2 data
parallelism.

The pipeline runs in lock-step at the pace of its slowest stage (the last one, which also holds
the LM head): `m` micro-batches of steady state plus the interleaved bubble of (pp-1)/vpp
micro-batch times (ZB-H1: (pp-1)(T_F+T_B-T_W), see `bubble_time`). Around it: the exposed
part of the data-parallel collectives, the optimizer update and host work (data loading) on the
critical path. Then what grows with the number of ranks (`scale.py`): the lock-step pipeline
waits for its slowest rank, and the exposed DP collectives for the last rank to launch them.
"""
import dataclasses

from mscale_jax.errors import ConfigError
from mscale_jax.flops import megatron_flops_per_token, mfu
from mscale_jax.parallel import schedule
from mscale_jax.perf import comm, compressed, compute, layer, scale
from mscale_jax.perf.constants import DEFAULT, Constants
from mscale_jax.perf.hardware import Hardware
from mscale_jax.perf.memory import RECOMPUTES, Memory, memory_per_device, params_per_device
from mscale_jax.perf.workload import Layout, ModelSpec, Techniques, validate

BREAKDOWN_KEYS = ("compute", "memory_bound", "tp_exposed", "pp_exposed", "bubble",
                  "dp_exposed", "optimizer", "data", "stragglers", "launch_skew")


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted iteration: time and where it goes, throughput, MFU and memory."""
  model: ModelSpec
  layout: Layout
  techniques: Techniques
  recompute: str
  iteration_s: float
  breakdown: dict          # BREAKDOWN_KEYS -> seconds; sums to iteration_s
  tokens_per_s: float
  mfu: float               # fraction of peak, Megatron FLOPs formula (see mscale_jax.flops)
  memory: Memory

  @property
  def fits(self) -> bool:
    """Whether the layout fits in device memory."""
    return self.memory.fits


def p2p_time(model: ModelSpec, layout: Layout, hw: Hardware, c: Constants) -> float:
  """One stage-to-stage transfer: each TP rank sends its sequence shard of the activations.

  Stages are `tp * dp` ranks apart. Across nodes a transfer reaches `p2p_eff` of the NIC rate,
  derated for ECMP collisions on every switch tier above the innermost one it crosses, as the
  DP rings are (`scale.tier_bandwidth_share`).
  """
  if layout.pp == 1:
    return 0.0
  num_bytes = layout.micro_batch * model.seq_len * model.hidden * 2.0 / layout.tp
  link = comm.group_link(hw, 2, layout.tp * layout.dp, c)
  if link.tier == "node":
    return comm.send_recv_time(num_bytes, link)
  bw = hw.net_bw_per_device * c.p2p_eff * scale.tier_bandwidth_share(hw, link.tier, c)
  return comm.send_recv_time(num_bytes, comm.Link(bw, c.p2p_latency_s, link.tier))


def bubble_time(layout: Layout, stage_s: float, hop_s: float, pp_overlap: bool,
                passes: tuple | None = None) -> float:
  """Seconds the slowest stage idles in the pipeline's fill and drain: the one place the bubble
  is costed.

  `stage_s` is one micro-batch through all of the stage's chunks (forward and backward); a
  tick, one chunk's forward or backward, is half of `stage_s / vpp` (parallel/schedule.py).
  The idle ticks are those of Megatron-LM's schedule table for (pp, vpp, m): (pp-1)(T_F+T_B)
  per chunk in time, whatever the ratio of T_B to T_F. With `passes`, the (F, B, W) seconds of
  one micro-batch through the stage, the schedule is ZB-H1 instead and its table
  (schedule 'zb_h1') is timed with them: (pp-1)(T_F+T_B-T_W) (Qi et al., ICLR 2024; tested in
  tests/test_schedule_timing.py). With decoupled, asynchronous sends (`pp_overlap`) the
  steady state hides the transfers, but the fill and drain still wait `2 (pp - 1)` hops of
  `hop_s` (an overlapped table costs exactly that over the plain one, tested there too).
  """
  p, v, m = layout.pp, layout.vpp, layout.num_micro_batches
  if passes is not None:
    table = schedule.build("zb_h1", p, 1, schedule.steady_microbatches("zb_h1", p, 1, m))
    f, b, w = passes
    bubble = table.timeline({"F": f, "B": b, "W": w}).bubble
  else:
    idle_ticks = schedule.megatron_summary(p, v, m)[0]
    bubble = idle_ticks * stage_s / (2 * v)
  if pp_overlap:
    bubble += 2 * (p - 1) * hop_s
  return bubble


def dp_times(model: ModelSpec, layout: Layout, hw: Hardware, c: Constants,
             compression=None) -> tuple:
  """(reduce-scatter of gradients, all-gather of parameters) seconds for one device's stage:
  NCCL's rings over the data-parallel group (`comm.ring_link`), or SDP4Bit's two-level
  quantized collectives with `compression` (`compressed.py`)."""
  n = params_per_device(model, layout)
  if compression is not None:
    return compressed.dp_times_two_level(n, layout.dp, layout.tp, compression, hw, c)
  link = comm.ring_link(hw, layout.dp, layout.tp, c)
  return (comm.reduce_scatter_time(n * c.grad_reduce_bytes, layout.dp, link),
          comm.all_gather_time(n * c.param_bytes, layout.dp, link))


def embedding_sync_time(model: ModelSpec, layout: Layout, hw: Hardware, c: Constants) -> float:
  """All-reduce of the tied embedding's gradients between the first and last stage.

  Both stages hold the (vocab x hidden / tp) matrix; after the pipeline drains they sum their
  fp32 gradients, on the critical path in Megatron-LM and MegaScale alike.
  """
  if layout.pp == 1:
    return 0.0
  num_bytes = model.vocab * model.hidden / layout.tp * c.grad_bytes
  stride = (layout.pp - 1) * layout.tp * layout.dp
  return comm.all_reduce_time(num_bytes, 2, comm.group_link(hw, 2, stride, c))


def dp_exposure(rs: float, ag: float, chunks: int, overlap: bool, ag_window: float,
                rs_window: float, prefetch_window: float, share: float) -> float:
  """Exposed data-parallel seconds.

  Without overlap the reduce-scatter and all-gather run after the pipeline drains. With it
  (MegaScale's ZeRO-2), each of the `chunks` model chunks has its own collectives, issued one
  after another on the communication stream. Gradients accumulate over the micro-batches, so a
  chunk's reduce-scatter can start only after its last micro-batch's backward and has the
  backward ticks of the next chunk down (`rs_window`) to hide behind; the last chunk's is
  exposed. A chunk's all-gather of updated parameters must arrive before its first forward and
  has the forward ticks of the chunk before it (`ag_window`); the first chunk's hides only
  behind host work at the start of the step (`prefetch_window`). What does not fit in its
  window is exposed, once per chunk; hidden traffic slows compute by the `share` of SMs it takes.
  """
  if not overlap or rs + ag == 0.0:
    return rs + ag
  rs_c, ag_c = rs / chunks, ag / chunks
  late = (chunks - 1) * (max(0.0, rs_c - rs_window) + max(0.0, ag_c - ag_window))
  exposed = rs_c + max(0.0, ag_c - prefetch_window) + late
  hidden = (rs + ag) * (1.0 - 1.0 / chunks) - late
  return exposed + share * hidden


def _predict_with(model, layout, tech, recompute, hw, c, dtype, memory):
  m, p, v = layout.num_micro_batches, layout.pp, layout.vpp
  per_layer = layer.layer_cost(model, layout, tech, recompute, hw, c, dtype)
  stage = per_layer.scale(model.num_layers / p)
  last = stage + layer.head_cost(model, layout, tech, hw, c, dtype)
  slowest = last if last.total >= stage.total else stage

  hop = p2p_time(model, layout, hw, c)
  # Blocking send/recv: each of the 2*vpp transfers per micro-batch (a forward send after each
  # model chunk, a backward send after each chunk's gradient) stalls its stage. Decoupled,
  # asynchronous transfers hide behind the next chunk; only the pipeline fill and drain wait.
  pp_per_mb = 0.0 if (tech.pp_overlap or p == 1) else 2 * v * hop
  stage_s = slowest.total + pp_per_mb
  passes = None
  if tech.zb_h1:       # W sends nothing; a blocking send follows each F and each B
    f, b, w = slowest.passes
    passes = (f + pp_per_mb / 2, b + pp_per_mb / 2, w)
  bubble = bubble_time(layout, stage_s, hop, tech.pp_overlap, passes)
  steady = m * stage_s

  host_iter = 0.0 if tech.async_data else c.host_per_iteration_s
  data = host_iter + (0.0 if tech.async_data else m * c.host_per_micro_batch_s)

  rs, ag = dp_times(model, layout, hw, c, tech.dp_compression)
  # Collectives go by model chunk (by layer without interleaving). A chunk's window is the
  # ticks of its neighbour chunk for one micro-batch group: pp micro-batches when
  # interleaved (Megatron-LM's groups), one without; a forward is a third of a tick pair.
  chunks = v if v > 1 else max(1, model.num_layers // p)
  group = p if v > 1 else 1
  tick_pair = stage_s / chunks
  dp = dp_exposure(rs, ag, chunks, tech.dp_overlap, group * tick_pair / 3,
                   group * 2 * tick_pair / 3, host_iter,
                   comm.sm_share(hw, c)) + embedding_sync_time(model, layout, hw, c)

  n_shard = params_per_device(model, layout) / layout.dp
  update = c.adam_update_bytes + (c.lamb_extra_bytes if tech.lamb else 0) + c.grad_bytes
  optimizer = compute.memory_time(n_shard * update, hw.hbm_bw, c, kernels=4)

  # Every rank of the synchronous step runs the pipeline; it ends with the slowest.
  stragglers = (steady + bubble) * scale.straggler_stretch(layout.devices, hw, c)
  skew = scale.launch_skew_s(layout.devices, layout.dp, c)

  breakdown = {
      "compute": m * (slowest.gemm + slowest.attention),
      "memory_bound": m * slowest.memory_bound,
      "tp_exposed": m * slowest.tp_exposed,
      "pp_exposed": m * pp_per_mb,
      "bubble": bubble,
      "dp_exposed": dp,
      "optimizer": optimizer,
      "data": data,
      "stragglers": stragglers,
      "launch_skew": skew,
  }
  iteration = sum(breakdown.values())
  tokens_per_s = layout.global_batch * model.seq_len / iteration
  flops = megatron_flops_per_token(model.num_layers, model.hidden, model.seq_len, model.vocab)
  return Prediction(model=model, layout=layout, techniques=tech, recompute=recompute,
                    iteration_s=iteration, breakdown=breakdown, tokens_per_s=tokens_per_s,
                    mfu=mfu(tokens_per_s, flops, layout.devices, hw.peak(dtype)), memory=memory)


def predict(model: ModelSpec, layout: Layout, tech: Techniques, hw: Hardware,
            c: Constants = DEFAULT, recompute: str = "auto",
            dtype: str = "bfloat16") -> Prediction:
  """Predicts one training iteration of `model` laid out as `layout` on `hw`.

  recompute='auto' takes the cheapest activation recomputation that fits in memory ('none',
  then 'selective' (attention core), then 'full'); if none fits the prediction says so
  (`fits` is False) and uses 'full'.
  """
  validate(model, layout)
  if tech.zb_h1 and layout.vpp != 1:
    raise ConfigError("vpp", layout.vpp, "1 with the zb_h1 schedule (one chunk per stage)")
  if recompute != "auto" and recompute not in RECOMPUTES:
    raise ConfigError("recompute", recompute, f"'auto' or one of {RECOMPUTES}")
  options = RECOMPUTES if recompute == "auto" else (recompute,)
  for option in options:
    memory = memory_per_device(model, layout, tech, option, hw.hbm_bytes, c)
    if memory.fits:
      break
  return _predict_with(model, layout, tech, option, hw, c, dtype, memory)
