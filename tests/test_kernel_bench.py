"""experiments/timing.py (batched per-call timing) and the kernel benchmarks at tiny sizes."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import timing


class FakeClock:
  """perf_counter stand-in that advances only when the fake kernel runs."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _fake_kernel(clock, seconds_per_call):
  calls = []

  def fn(x):
    calls.append(1)
    clock.now += seconds_per_call
    return x + len(calls)
  return fn, calls


@pytest.mark.parametrize("one_call_s, expected", [
    (0.25, 1), (0.02, 1), (0.019, 2), (0.005, 4), (0.0014, 15), (1e-4, 200), (0.0, 200),
    (float("nan"), 200)])
def test_calls_per_sample_reaches_min_sample_and_caps(one_call_s, expected):
  assert timing.calls_per_sample(one_call_s, min_sample_s=0.02, max_calls=200) == expected


def test_calls_per_sample_rejects_no_calls():
  with pytest.raises(ValueError, match="max_calls"):
    timing.calls_per_sample(0.01, max_calls=0)


@pytest.mark.parametrize("seconds_per_call, calls", [(1e-3, 20), (0.05, 1), (1e-6, 200)])
def test_time_fn_reports_per_call_time_of_batched_samples(monkeypatch, seconds_per_call, calls):
  clock = FakeClock()
  syncs = []
  real_block = jax.block_until_ready
  monkeypatch.setattr(timing, "_now", clock)
  monkeypatch.setattr(timing.jax, "block_until_ready",
                      lambda out: syncs.append(out) or real_block(out))
  fn, made = _fake_kernel(clock, seconds_per_call)
  stats = timing.time_fn(fn, jnp.zeros(3), warmup=2, repeats=4, min_sample_s=0.02,
                         max_calls=200)
  assert stats["calls"] == calls
  refine = calls if calls > 1 else 0             # the batched calibration
  assert len(made) == 2 + 1 + refine + 4 * calls  # warm-up, calibration, samples
  assert stats["median_s"] == pytest.approx(seconds_per_call)
  assert stats["min_s"] == pytest.approx(seconds_per_call)
  assert stats["repeats"] == 4
  # One sync per warm-up call, calibration and sample (not per timed call); each sample
  # waits on its LAST call's output.
  assert len(syncs) == 2 + 1 + (refine > 0) + 4
  for i, out in enumerate(syncs[-4:]):
    np.testing.assert_array_equal(out, np.full(3, 3 + refine + (i + 1) * calls))


def test_time_fn_amortises_sync_overhead_over_the_batch(monkeypatch):
  """A kernel of 0.1 ms behind a 1 ms sync: one synced call says 1.1 ms (K = 19); the batch of
  19 says 0.153 ms a call, so K = 132 and the reported time is 0.1 + 1/132 ms, not 1.1 ms."""
  clock = FakeClock()
  monkeypatch.setattr(timing, "_now", clock)
  real_block = jax.block_until_ready

  def block(out):
    clock.now += 1e-3
    return real_block(out)
  monkeypatch.setattr(timing.jax, "block_until_ready", block)
  fn, _ = _fake_kernel(clock, 1e-4)
  stats = timing.time_fn(fn, jnp.zeros(3), warmup=1, repeats=3, min_sample_s=0.02,
                         max_calls=200)
  assert stats["calls"] == 132
  assert stats["median_s"] == pytest.approx(1e-4 + 1e-3 / 132)


def test_time_fn_max_calls_one_is_a_sync_per_call(monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(timing, "_now", clock)
  fn, made = _fake_kernel(clock, 1e-5)
  stats = timing.time_fn(fn, jnp.zeros(2), warmup=1, repeats=3, max_calls=1)
  assert stats["calls"] == 1 and len(made) == 1 + 1 + 3
  assert stats["median_s"] == pytest.approx(1e-5)


def test_relative_error_on_device_matches_the_float64_host_figure():
  keys = jax.random.split(jax.random.key(3), 3)
  ref = {"a": jax.random.normal(keys[0], (64, 32)), "b": jax.random.normal(keys[1], (100,))}
  out = {"a": ref["a"] + 1e-3 * jax.random.normal(keys[2], (64, 32)), "b": ref["b"] * 1.01}
  host = timing.relative_error(out, ref)
  assert host == pytest.approx(0.01, rel=1e-5)           # leaf b: exactly 1% off
  assert timing.relative_error(out, ref, on_device=True) == pytest.approx(host, rel=1e-4)
  nan = {"a": out["a"].at[0, 0].set(jnp.nan), "b": out["b"]}
  assert np.isnan(timing.relative_error(nan, ref, on_device=True))
  with pytest.raises(ValueError, match="shapes differ"):
    timing.relative_error(ref["a"], ref["a"][:2], on_device=True)


ERROR_COLUMNS = ("rel_err", "rel_err_vs_optax")
_SLOW = ("collective_matmul", "flash_attention", "lamb")   # 7-60 s each on CPU


@pytest.mark.parametrize("kernel", [
    pytest.param(k, marks=pytest.mark.slow) if k in _SLOW else k
    for k in ("collective_matmul", "flash_attention", "layer_norm", "lamb", "gemm", "quantize")])
def test_every_tiny_bench_row_has_a_time_its_call_count_and_a_small_error(kernel):
  module = importlib.import_module(f"experiments.benchmarks.{kernel}")
  out = module.run(size="tiny", warmup=1, repeats=1)
  assert out["rows"]
  for row in out["rows"]:
    errors = [row[c] for c in ERROR_COLUMNS if c in row]
    assert len(errors) == 1, row
    assert 0 <= errors[0] < 1e-2, row
    assert row.get("codes_differing", 0) <= 1e-3, row
    assert isinstance(row["calls"], int) and row["calls"] >= 1
    assert (row.get("median_ms") or row.get("median_s")) > 0
