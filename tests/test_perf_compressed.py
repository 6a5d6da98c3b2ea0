"""perf/compressed.py: two-level DP collectives, uncompressed and with SDP4Bit's bit widths."""
import dataclasses

import pytest

from mscale_jax.perf import DEFAULT, H800_DGX, Layout, ModelSpec, Techniques, predict
from mscale_jax.perf.compressed import DPCompression, dp_times_two_level
from mscale_jax.perf.iteration import dp_times

MODEL = ModelSpec("1.3B", num_layers=24, hidden=2048, num_heads=16, seq_len=2048, vocab=50304)


def test_one_rank_per_node_is_the_plain_ring():
  """With tensor parallelism filling the node (one data-parallel rank per node) the two-level
  schedule is the ring the model already had, to the last bit."""
  layout = Layout(tp=8, pp=1, vpp=1, dp=16, micro_batch=1, global_batch=256)
  model = dataclasses.replace(MODEL, num_heads=16)
  assert dp_times(model, layout, H800_DGX, DEFAULT, DPCompression.uncompressed()) == \
      dp_times(model, layout, H800_DGX, DEFAULT)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_compression_ratio_tends_to_the_bit_ratio_on_slow_networks(tp):
  slow = dataclasses.replace(H800_DGX, nic_bw=1e6, nics_per_node=1)   # 1 MB/s: wire-bound
  n, dp = 1e9, 128 // tp
  rs0, ag0 = dp_times_two_level(n, dp, tp, DPCompression.uncompressed(), slow, DEFAULT)
  rs1, ag1 = dp_times_two_level(n, dp, tp, DPCompression(), slow, DEFAULT)
  assert rs0 / rs1 == pytest.approx(32 / (4 + 32 / 128), rel=1e-3)
  assert ag0 / ag1 == pytest.approx(16 / (4 + 32 / 2048), rel=1e-3)


def test_coding_costs_time_when_the_network_is_free():
  fast = dataclasses.replace(H800_DGX, nic_bw=1e18, intra_node_bw=1e18)
  rs0, ag0 = dp_times_two_level(1e9, 16, 1, DPCompression.uncompressed(), fast, DEFAULT)
  rs1, ag1 = dp_times_two_level(1e9, 16, 1, DPCompression(), fast, DEFAULT)
  assert rs1 > rs0 and ag1 > ag0


def test_predicted_speedup_grows_as_the_network_slows():
  layout = Layout(tp=1, pp=1, vpp=1, dp=128, micro_batch=1, global_batch=256)
  speedups = []
  for gbps in (3200, 400, 50):
    hw = dataclasses.replace(H800_DGX, nic_bw=gbps * 1e9 / 8, nics_per_node=1)
    base, quick = (predict(MODEL, layout, Techniques(dp_compression=comp), hw,
                           recompute="full").iteration_s
                   for comp in (DPCompression.uncompressed(), DPCompression()))
    speedups.append(base / quick)
  assert 1.0 < speedups[0] < speedups[1] < speedups[2]


def test_planner_with_sdp4bit_on_a_slow_network_predicts_higher_mfu(capsys):
  from experiments import plan
  none, = plan.plan("175B", 1024, "a100_megascale", 768, 1, 1, DEFAULT, "none", 100)
  quick, = plan.plan("175B", 1024, "a100_megascale", 768, 1, 1, DEFAULT, "sdp4bit", 100)
  assert quick.techniques.dp_compression is not None and none.techniques.dp_compression is None
  assert quick.mfu > none.mfu
  assert "dp_comm=sdp4bit, 100 Gb/s per node" in capsys.readouterr().out
