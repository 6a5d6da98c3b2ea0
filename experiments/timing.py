"""Device-synchronised timing for benchmarks (warm-up, then the median of repeated samples),
and the accuracy figure each benchmark row carries next to its time."""
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

MIN_SAMPLE_S = 0.02     # a timed sample lasts at least this long (dispatch + sync amortised)
MAX_CALLS = 200         # ... but holds at most this many back-to-back calls
_now = time.perf_counter   # the clock samples are read from (tests put a fake one here)


def calls_per_sample(one_call_s: float, min_sample_s: float = MIN_SAMPLE_S,
                     max_calls: int = MAX_CALLS) -> int:
  """How many back-to-back calls make a sample of >= `min_sample_s` (1 to `max_calls`).

  `one_call_s` is one synchronised call's time, dispatch and sync included, so the count errs
  low for sub-millisecond kernels: the batched sample still lasts about `min_sample_s`.
  """
  if max_calls < 1:
    raise ValueError(f"max_calls must be >= 1, got {max_calls}")
  if not one_call_s > 0:         # a clock too coarse to see one call (or NaN): batch fully
    return max_calls
  return max(1, min(max_calls, math.ceil(min_sample_s / one_call_s)))


def time_fn(fn, *args, warmup: int = 2, repeats: int = 5, min_sample_s: float = MIN_SAMPLE_S,
            max_calls: int = MAX_CALLS) -> dict:
  """Times `fn(*args)` per call; returns {'median_s', 'min_s', 'max_s', 'repeats', 'calls'}.

  The first `warmup` calls compile and warm caches and are not counted. One more synchronised
  call sets `calls` (see `calls_per_sample`); where that is > 1, a batch of that many refines
  it (one call's time includes a sync). Each of the `repeats` samples then dispatches `calls`
  calls back to back and waits for the last one's outputs (`jax.block_until_ready`; one device
  runs its work in order), so neither asynchronous dispatch hides work nor does one host round
  trip per call inflate a sub-millisecond kernel's time. Times are per call
  (sample / calls). `max_calls=1` gives one synchronised call per sample. A stateful `fn`
  (one that carries donated buffers, say) works as long as calling it repeatedly is valid.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  calls = calls_per_sample(_per_call(fn, args, 1), min_sample_s, max_calls)
  if calls > 1:          # one call's sync overhead made `calls` low: measure again, batched
    calls = calls_per_sample(_per_call(fn, args, calls), min_sample_s, max_calls)
  times = [_per_call(fn, args, calls) for _ in range(repeats)]
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
          "repeats": repeats, "calls": calls}


def _per_call(fn, args, calls: int) -> float:
  """Seconds per call of `calls` back-to-back calls of fn(*args), waiting for the last."""
  start = _now()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (_now() - start) / calls


def relative_error(out, ref, *, on_device: bool = False) -> float:
  """max over the leaves of ||out - ref|| / ||ref|| (L2).

  `out` and `ref` are pytrees of the same structure; a NaN anywhere gives NaN, so it never
  passes a threshold. Benchmarks report it per row: a fast kernel that computes something else
  shows here, not in its time. By default in float64 on the host; `on_device=True` reduces in
  float32 on the device and copies two scalars a leaf, for leaves of hundreds of millions of
  values whose copy to the host would take longer than the benchmark.
  """
  worst = 0.0
  for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
    if o.shape != r.shape:
      raise ValueError(f"shapes differ: {o.shape} vs {r.shape}")
    if on_device:
      diff, norm = (float(v) for v in _l2_norms(o, r))
    else:
      o = np.asarray(jax.device_get(o), np.float64)
      r = np.asarray(jax.device_get(r), np.float64)
      diff, norm = np.linalg.norm(o - r), np.linalg.norm(r)
    error = diff / (norm if norm > 0 else 1.0)
    worst = error if np.isnan(error) else max(worst, error)
    if np.isnan(worst):
      return float("nan")
  return float(worst)


@jax.jit
def _l2_norms(o, r):
  """(||o - r||, ||r||) of two same-shape arrays, in float32."""
  o, r = jnp.ravel(o).astype(jnp.float32), jnp.ravel(r).astype(jnp.float32)
  return jnp.sqrt(jnp.sum(jnp.square(o - r))), jnp.sqrt(jnp.sum(jnp.square(r)))
