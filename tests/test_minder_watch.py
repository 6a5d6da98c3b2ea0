"""Minder in the driver: per-second samples of several ranks in, a flag naming the rank out."""
import subprocess
import sys
import time

import numpy as np
import pytest

from mscale_jax.observability.minder.detector import MinderConfig
from mscale_jax.observability.minder.vae import VAEConfig
from mscale_jax.observability.minder.watch import MinderWatch
from mscale_jax.observability.observer import Observer


def samples(rng, t0, seconds, *, cpu=1.0, rss=900.0):
  return [{"t": t0 + s + 0.3, "step": s, "step_time_s": 0.3 + 0.01 * rng.standard_normal(),
           "data_wait_s": 0.001 * (1 + 0.1 * rng.standard_normal()),
           "cpu_frac": cpu + 0.05 * rng.standard_normal(), "rss_mb": rss + rng.standard_normal(),
           "hb_rtt_ms": 0.5 + 0.05 * rng.standard_normal(), "io_write_mb_s": 0.0,
           "device_mem_mb": None} for s in range(seconds)]


@pytest.mark.slow   # trains six small VAEs (~25 s)
def test_watch_trains_on_the_first_seconds_then_flags_the_rank_that_stands_out():
  rng = np.random.default_rng(0)
  config = MinderConfig(window=20, stride=5, continuity=4, ratio=1.8, floor=0.02,
                        vae=VAEConfig(hidden=8, latent=3, steps=80, batch=64))
  said = []
  watch = MinderWatch(fit_s=60, config=config, say=said.append)
  ranks = [0, 1, 2, 3, 4]
  t0 = 1_000_000
  for r in ranks:
    watch.add(r, samples(rng, t0, 80))
  assert watch.update(ranks) == []
  deadline = time.time() + 120
  while watch.minder is None and time.time() < deadline:
    time.sleep(0.2)
  assert watch.minder is not None and any("trained" in s for s in said)
  flags = []
  for chunk in range(8):                 # 80 s more; rank 3 loses its CPU from the start
    start = t0 + 80 + 10 * chunk
    for r in ranks:
      watch.add(r, samples(rng, start, 10, cpu=0.35 if r == 3 else 1.0))
    flags += watch.update(ranks)
  assert [(f.rank, f.metric) for f in flags] == [(3, "cpu_frac")]
  assert "rank 3: cpu_frac" in flags[0].describe()


def test_watch_needs_three_ranks():
  watch = MinderWatch(fit_s=60)
  rng = np.random.default_rng(1)
  for r in (0, 1):
    watch.add(r, samples(rng, 0, 100))
  assert watch.update([0, 1]) == [] and watch._grid == []


def test_observer_rejects_an_unknown_detector(tmp_path):
  with pytest.raises(ValueError, match="minder"):
    Observer(str(tmp_path), print, detector="magic")


def test_launch_refuses_minder_with_two_processes(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.launch", f"--workdir={tmp_path}", "--num_processes=2",
       "--straggler_detector=minder", "--", "--config=experiments/configs/gpt_tiny.py"],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and "--straggler_detector" in lines[0] and ">= 3" in lines[0]


def test_watch_skips_samples_not_shaped_like_samples():
  watch = MinderWatch(fit_s=60)
  watch.add(0, ["x", None, {"t": "soon"}, {"t": float("nan")}, {"t": 5.2, "cpu_frac": "hi",
                                                               "rss_mb": 10}])
  assert list(watch._samples[0]) == [5]
  assert watch._samples[0][5]["cpu_frac"] is None and watch._samples[0][5]["rss_mb"] == 10.0
