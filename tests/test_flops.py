"""FLOPs per token and MFU reproduce the paper's Megatron-LM numbers."""
import pytest

from mscale_jax import flops


def test_175b_flops_per_token_matches_megascale():
  f = flops.megatron_flops_per_token(num_layers=96, hidden=12288, seq_len=2048, vocab=64000)
  assert f == pytest.approx(1.0762e12, rel=1e-3)


@pytest.mark.parametrize("gpus,tokens_per_s,paper_mfu", [
    (256, 39.3e3, 0.530), (512, 74.1e3, 0.499), (768, 103.8e3, 0.467), (1024, 132.7e3, 0.447)])
def test_megatron_rows_of_table2(gpus, tokens_per_s, paper_mfu):
  """The paper's tokens/s are rounded to 4 digits, so rows agree to within 0.1 MFU points;
  the 256-GPU row (39.3k tokens/s -> 53.0%) to within rounding of the last digit."""
  f = flops.megatron_flops_per_token(96, 12288, 2048, 64000)
  peak = flops.known_peak("NVIDIA A100-SXM4-80GB", "bfloat16")
  assert peak == 312e12
  tolerance = 0.0006 if gpus == 256 else 0.001
  assert flops.mfu(tokens_per_s, f, gpus, peak) == pytest.approx(paper_mfu, abs=tolerance)


def test_known_peaks_match_device_kinds():
  assert flops.known_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
  assert flops.known_peak("TPU v5 lite", "bfloat16") == 197e12
  assert flops.known_peak("cpu", "float32") is None


def test_cpu_peak_is_measured_once_and_cached(tmp_path):
  cache = tmp_path / "peak.json"
  first = flops.measure_cpu_peak("float32", size=128, repeats=2, cache_path=str(cache))
  assert first > 1e6 and cache.exists()
  assert flops.measure_cpu_peak("float32", size=128, repeats=2, cache_path=str(cache)) == first


def test_model_flops_equal_megatron_for_the_standard_shape_and_grow_with_swiglu():
  from mscale_jax.config import ModelConfig
  standard = ModelConfig(num_layers=96, hidden=12288, num_heads=96, mlp_dim=4 * 12288,
                         seq_len=2048, vocab_size=64000)
  assert flops.model_flops_per_token(standard) == pytest.approx(
      flops.megatron_flops_per_token(96, 12288, 2048, 64000), rel=1e-12)
  swiglu = ModelConfig(**{**standard.__dict__, "mlp_activation": "swiglu"})
  # One more h x F projection per layer: 6 h F FLOPs per token per layer more.
  assert flops.model_flops_per_token(swiglu) - flops.model_flops_per_token(standard) == \
      pytest.approx(96 * 6 * 12288 * 4 * 12288, rel=1e-12)


def test_h100_pcie_is_not_taken_for_sxm():
  assert flops.known_peak("NVIDIA H100 PCIe", "bfloat16") == 756e12
