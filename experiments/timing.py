"""Device-synchronised timing for benchmarks: warm-up, then the median of repeated runs."""
import statistics
import time

import jax


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
