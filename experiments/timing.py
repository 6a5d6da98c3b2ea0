"""Device-synchronised timing for benchmarks (warm-up, then the median of repeated runs), and
the accuracy figure each benchmark row carries next to its time."""
import statistics
import time

import jax
import numpy as np


def time_fn(fn, *args, warmup: int = 2, repeats: int = 5) -> dict:
  """Times `fn(*args)`; returns {'median_s', 'min_s', 'max_s', 'repeats'}.

  The first `warmup` calls compile and warm caches and are not counted; each timed call waits
  for every output (`jax.block_until_ready`), so asynchronous dispatch cannot hide work.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
          "repeats": repeats}


def relative_error(out, ref) -> float:
  """max over the leaves of ||out - ref|| / ||ref|| (L2, in float64 on the host).

  `out` and `ref` are pytrees of the same structure; a NaN anywhere gives NaN, so it never
  passes a threshold. Benchmarks report it per row: a fast kernel that computes something else
  shows here, not in its time.
  """
  worst = 0.0
  for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
    o = np.asarray(jax.device_get(o), np.float64)
    r = np.asarray(jax.device_get(r), np.float64)
    if o.shape != r.shape:
      raise ValueError(f"shapes differ: {o.shape} vs {r.shape}")
    norm = np.linalg.norm(r)
    error = np.linalg.norm(o - r) / (norm if norm > 0 else 1.0)
    worst = error if np.isnan(error) else max(worst, error)
    if np.isnan(worst):
      return float("nan")
  return float(worst)
