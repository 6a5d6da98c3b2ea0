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


def test_one_set_of_defaults_and_they_are_the_official_ones():
  """config.SDP4BitConfig is the one place: the performance model and the quantizer take their
  defaults from it, and it holds the official repository's flag defaults (jindajia/SDP4Bit
  ReadME.md: --weight-quantization-bits 4, --wq-group-size 2048, --gradient-quantization-bits-
  intra 8 / -inter 4, --gq-group-size-inter 128; --hadamard-transform for TLq-HS)."""
  from mscale_jax.config import SDP4BitConfig
  from mscale_jax.sdp4bit.quant import Quantizer
  cfg, comp = SDP4BitConfig(), DPCompression()
  assert (cfg.weight_bits, cfg.weight_group, cfg.grad_bits_intra, cfg.grad_bits_inter,
          cfg.grad_group, cfg.hadamard) == (4, 2048, 8, 4, 128, True)
  for field in dataclasses.fields(DPCompression):
    assert getattr(comp, field.name) == getattr(cfg, field.name), field.name
  assert (Quantizer().bits, Quantizer().group) == (cfg.grad_bits_inter, cfg.grad_group)
  assert DPCompression.from_config(cfg) == comp


def test_from_config_sends_exact_what_the_config_leaves_exact():
  from mscale_jax.config import SDP4BitConfig
  cfg = SDP4BitConfig(weights="none", gradients=False, weight_bits=6, grad_group=64)
  assert DPCompression.from_config(cfg) == dataclasses.replace(
      DPCompression.uncompressed(), grad_group=64)
  qwd_only = DPCompression.from_config(SDP4BitConfig(gradients=False, weight_bits=6))
  assert qwd_only.weight_bits == 6 and qwd_only.grad_bits_inter == 32 and not qwd_only.hadamard
  assert DPCompression.from_config(SDP4BitConfig(weights="weights")).weight_bits == 4
