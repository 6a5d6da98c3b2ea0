"""Minder and the threshold detector on a real multi-process job of this machine, with faults
injected from outside the training processes (experiments/os_faults.py: hog, throttle, mem).

  python -m experiments.minder_real --episodes=20

One long job (3 processes x 1 CPU device, a tiny GPT) under the driver's default detector
('threshold': step phases and, per second, the run-queue wait share). Its workers' per-second
monitoring samples land in WORKDIR/resilience/monitor.jsonl. After `--fit_s` seconds of clean
training, alternately a clean stretch and a fault on a random rank, each `--episode_s` long.

Both detectors are scored on the same episodes:
  threshold  the driver's live flags (WORKDIR/resilience/stragglers.jsonl);
  minder     the driver's Minder watch (minder/watch.py, MinderConfig's one setting) replayed
             on the recorded samples in their arrival order, trained on the job's first fit_s
             seconds as it is in the driver (replaying rather than running both live keeps one
             job, one set of episodes, and the CPU of a second watch out of the measurement).
A flag naming the victim during its fault (or minder_scoring.GRACE_S after; the fault under way
if the victim's next one has begun) is a detection, any other flag a false positive; latency is
from the fault's start to the flag. The record also has, per fault kind and metric, the
victim's median against its peers' (what separated it, and what did not).
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from experiments import job, os_faults
from experiments.minder_scoring import GRACE_S, score_episodes
from experiments.results import write_record
from mscale_jax.resilience.driver import claim

_EPISODES = flags.DEFINE_integer("episodes", 20, "Fault episodes (as many clean stretches).")
_EPISODE_S = flags.DEFINE_integer("episode_s", 40, "Seconds per fault and per clean stretch.")
_FIT_S = flags.DEFINE_integer("fit_s", 90, "Clean seconds Minder trains on before episodes.")
_PROCESSES = flags.DEFINE_integer("num_processes", 3, "Worker processes (Minder needs >= 3).")
_KINDS = flags.DEFINE_list("kinds", ["hog", "throttle", "mem"], "Fault kinds (os_faults.py).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/minder_real", "Run folder.")
SETTLE_S = 5          # seconds after a fault's start not used for the per-metric medians


def worker_pids(workdir: str) -> dict[int, int]:
  """{rank: pid} of the running group's live workers, from the driver's claim on the workdir
  (resilience/driver.json: the workers in rank order, each with its start time)."""
  record = claim.read(os.path.join(workdir, "resilience"))    # written whole (a rename)
  workers = record["workers"] if record else []
  return {rank: w["pid"] for rank, w in enumerate(workers) if claim.same_process(w)}


def read_monitor(workdir: str) -> list[tuple[int, list[dict]]]:
  """The heartbeats' samples as the driver received them: [(rank, samples)]."""
  with open(os.path.join(workdir, "resilience", "monitor.jsonl")) as f:
    return [(b["rank"], b["samples"]) for b in map(json.loads, f)]


def replay_minder(beats, ranks: list[int], fit_s: int, say=print) -> tuple[list[dict], float]:
  """The driver's Minder watch on recorded heartbeats; returns (flags, mean seconds per
  update once trained)."""
  from mscale_jax.observability.minder.watch import MinderWatch
  watch = MinderWatch(fit_s=fit_s, say=say)
  found, checks, spent = [], 0, 0.0
  for rank, samples in beats:
    watch.add(rank, samples)
    start = time.perf_counter()
    new = watch.update(ranks)
    if watch.minder is None:
      watch.wait_trained()                         # the driver trains while the job goes on
    elif watch.detector is not None:
      spent += time.perf_counter() - start
      checks += 1
    found += [{**f.to_json(), "time": f.at} for f in new]
  return found, spent / max(checks, 1)


def separation(beats, episodes, metrics) -> dict:
  """Per fault kind and metric: the median over episodes of (victim's median - the median of
  its peers' medians) during the fault, and the same over clean stretches for a random rank."""
  series: dict[int, list[dict]] = {}
  for rank, samples in beats:
    series.setdefault(rank, []).extend(s for s in samples if isinstance(s, dict))
  out: dict[str, dict] = {}
  for kind in sorted({e["kind"] for e in episodes}):
    per_metric = {m: [] for m in metrics}
    for e in (e for e in episodes if e["kind"] == kind):
      rank = e["rank"] if e["rank"] is not None else 0
      med = {r: {m: np.median([s[m] for s in ss if s.get(m) is not None
                               and e["start"] + SETTLE_S <= s["t"] <= e["end"]] or [np.nan])
                 for m in metrics} for r, ss in series.items()}
      for m in metrics:
        others = [med[r][m] for r in med if r != rank]
        per_metric[m].append(float(med[rank][m] - np.median(others)))
    out[kind] = {m: {"victim_minus_peers_median": float(np.nanmedian(v)) if v else None,
                     "episodes": len(v)} for m, v in per_metric.items()}
  return out


def main(argv):
  del argv
  workdir, n, fit_s = os.path.abspath(_WORKDIR.value), _PROCESSES.value, _FIT_S.value
  launcher = ["--num_processes", str(n), "--devices_per_process=1", "--heartbeat_s=1",
              "--straggler_detector=threshold", "--hang_timeout_s=600", "--max_restarts=0",
              "--status_every_s=5", f"--xla_flags={job.FAST_XLA}"]
  train = [*job.TINY_GPT, "--config.mesh.data=-1", "--config.mesh.tensor=1",
           f"--config.train.global_batch={2 * n}", "--config.train.steps=100000000",
           "--config.train.log_every=100", "--config.train.eval_every=100000000",
           "--config.train.checkpoint_every=100000000"]
  os.makedirs(workdir, exist_ok=True)
  for name in ("monitor.jsonl", "stragglers.jsonl"):
    path = os.path.join(workdir, "resilience", name)
    if os.path.exists(path):
      os.remove(path)
  # SIGTERM ends the run through the `finally` below (the job, the busy processes, the swap).
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  faults_ = os_faults.FAULTS
  swapped = "mem" in _KINDS.value and os_faults.swap_on()
  log = open(os.path.join(workdir, "launcher.log"), "w")
  proc = subprocess.Popen(job.command(workdir, launcher, train), cwd=job.REPO,
                          env=dict(os.environ, PYTHONPATH=job.REPO), stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
  episodes = []
  try:
    monitor = os.path.join(workdir, "resilience", "monitor.jsonl")
    while not os.path.exists(monitor) or len(worker_pids(workdir)) < n:
      if proc.poll() is not None:
        raise SystemExit("the job ended early; see " + log.name)
      time.sleep(1)
    print(f"[real] training; {fit_s} s of clean samples for Minder to train on", flush=True)
    time.sleep(fit_s + 10)
    pids = worker_pids(workdir)
    rng = random.Random(0)
    for i in range(_EPISODES.value):
      start = time.time()
      time.sleep(_EPISODE_S.value)
      episodes.append({"kind": "clean", "start": start, "end": time.time(), "rank": None})
      if proc.poll() is not None:   # before acting on a worker that is gone
        raise SystemExit("the job ended during the episodes; see " + log.name)
      rank, kind = rng.randrange(n), _KINDS.value[i % len(_KINDS.value)]
      start = time.time()
      detail = faults_[kind](pids[rank], _EPISODE_S.value)
      episodes.append({"kind": kind, "start": start, "end": time.time(), "rank": rank,
                       "pid": pids[rank], **detail})
      print(f"[real] episode {i + 1}/{_EPISODES.value}: {kind} on rank {rank} {detail}",
            flush=True)
    start = time.time()
    time.sleep(GRACE_S)
    episodes.append({"kind": "clean", "start": start, "end": time.time(), "rank": None})
  finally:
    try:
      os.killpg(proc.pid, signal.SIGTERM)
      proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
      os.killpg(proc.pid, signal.SIGKILL)
    if swapped:
      os_faults.swap_off()
  faults = [e for e in episodes if e["rank"] is not None]
  cleans = [e for e in episodes if e["rank"] is None]
  path = os.path.join(workdir, "resilience", "stragglers.jsonl")
  live = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
  beats = read_monitor(workdir)
  print(f"[real] replaying Minder on {len(beats)} heartbeats", flush=True)
  m_flags, check_s = replay_minder(beats, list(range(n)), fit_s)
  from mscale_jax.observability.minder.watch import WATCH_METRICS
  figures = {
      "episodes": episodes, "faults": len(faults), "clean_stretches": len(cleans),
      "threshold": score_episodes(live, faults, cleans),
      "minder": score_episodes(m_flags, faults, cleans),
      "flags": {"threshold": live, "minder": m_flags},
      "minder_check_s": check_s,
      "separation": separation(beats, episodes, WATCH_METRICS),
  }
  record = write_record("minder_real", figures, device={
      "platform": "cpu", "processes": n, "host_cpu_count": os.cpu_count(),
      "loadavg_at_end": open("/proc/loadavg").read().split()[:3]})
  for d in ("threshold", "minder"):
    s = figures[d]
    print(f"[real] {d}: P {s['precision']:.2f} R {s['recall']:.2f} F1 {s['f1']:.2f}, "
          f"{s['false_flags']} false flags, median latency {s['median_latency_s']} s; "
          f"per kind {({k: (v['detected'], v['faults']) for k, v in s['per_kind'].items()})}")
  print(f"[real] record {record}")


if __name__ == "__main__":
  app.run(main)
