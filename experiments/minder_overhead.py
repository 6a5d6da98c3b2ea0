"""What Minder's monitoring and detection cost: per sample, per step and per rank.

  python -m experiments.minder_overhead [--step_s=0.3]

Collection: the worker's `MetricSampler.sample()` (resilience/worker/monitor.py) timed over many
calls in this process (with JAX loaded, so the device-memory read is included); it runs once a
second on its own thread, so its cost per training step is (sample time) x (step seconds / 1 s).
The run-queue read (one schedstat file per thread) is also timed on its own, with the process
holding `--threads` threads as a training worker does (ours: about 40).
Detection: one Minder check (all metrics: normalise, embed with the LSTM-VAE, distances) on
[ranks, window] windows, for several fleet sizes; its cost per rank is that time / ranks. The
models are trained for a few steps only: the time of a check does not depend on the weights.
"""
import threading
import time

from absl import app, flags
import numpy as np

from experiments.results import write_record
from mscale_jax.observability.minder.detector import Minder, MinderConfig
from mscale_jax.observability.minder.vae import VAEConfig
from mscale_jax.observability.minder.watch import WATCH_METRICS
from mscale_jax.resilience.worker import monitor
from mscale_jax.resilience.worker.monitor import MetricSampler

_STEP_S = flags.DEFINE_float("step_s", 0.3, "Step time the per-step cost is quoted for (our CPU "
                             "job's step is ~0.3 s).")
_THREADS = flags.DEFINE_integer("threads", 40, "Threads the process holds while sampling.")
_SIZES = flags.DEFINE_list("sizes", ["4", "16", "64", "256", "1024"], "Ranks per check.")


def main(argv):
  del argv
  import jax
  jax.devices()                                   # the device-memory read goes through JAX
  stop = threading.Event()
  idle = [threading.Thread(target=stop.wait, daemon=True)
          for _ in range(max(_THREADS.value - threading.active_count(), 0))]
  for t in idle:
    t.start()
  threads = len(monitor.schedstat_ns())
  sampler = MetricSampler(lambda: (1, 0.3, 0.001))
  sampler.sample()
  n = 2000
  start = time.perf_counter()
  for _ in range(n):
    sampler.sample()
  sample_s = (time.perf_counter() - start) / n
  start = time.perf_counter()
  for _ in range(n):
    monitor.schedstat_ns()
  runq_s = (time.perf_counter() - start) / n
  stop.set()
  print(f"one sample {1e6 * sample_s:.1f} us, of which the run-queue read of {threads} threads "
        f"{1e6 * runq_s:.1f} us")
  rng = np.random.default_rng(0)
  config = MinderConfig(vae=VAEConfig(steps=5))
  metrics = [m for m in WATCH_METRICS if m != "device_mem_mb"]
  minder = Minder.fit({m: [rng.standard_normal((8, 200))] for m in metrics}, config)
  checks = {}
  for size in [int(s) for s in _SIZES.value]:
    windows = {m: rng.standard_normal((size, config.window)) for m in metrics}
    minder.most_distinct(windows)                 # compile for this shape
    reps = max(3, int(200 / size))
    start = time.perf_counter()
    for _ in range(reps):
      minder.most_distinct(windows)
    per = (time.perf_counter() - start) / reps
    checks[size] = {"check_s": per, "per_rank_s": per / size,
                    "per_rank_per_step_s": per / size * _STEP_S.value / config.stride}
    print(f"{size:5d} ranks: one check of {len(metrics)} metrics {1e3 * per:.2f} ms, "
          f"{1e6 * per / size:.1f} us per rank")
  figures = {"sample_s": sample_s, "runq_read_s": runq_s, "threads": threads,
             "samples_per_s": 1.0, "step_s": _STEP_S.value,
             "sample_cost_per_step_s": sample_s * _STEP_S.value,
             "sample_cost_fraction_of_step": sample_s / 1.0,
             "metrics_checked": metrics, "check_every_s": config.stride, "checks": checks}
  path = write_record("minder_overhead", figures)
  print(f"one sample {1e6 * sample_s:.1f} us (once a second: {100 * sample_s:.4f} % of a core); "
        f"record {path}")


if __name__ == "__main__":
  app.run(main)
