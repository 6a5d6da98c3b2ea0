"""Minder on a real multi-process job of this machine, with faults injected from outside.

  python -m experiments.minder_real --episodes=20

One long job (3 processes x 1 CPU device, a tiny GPT, `--straggler_detector=minder`); Minder
trains on its first `--fit_s` seconds. Then, alternately, a clean stretch and a fault on a
random rank, each `--episode_s` long. Faults come from outside the training process and are
not built from what Minder watches:
  hog       a busy process pinned, with the victim, to one CPU core (sched_setaffinity): the OS
            gives the victim about half a core;
  throttle  the victim is SIGSTOPped for 0.5 s of every second (the OS taking its CPU away in
            whatever phase it is; the issue's unflagged case).
The driver's flags (WORKDIR/resilience/stragglers.jsonl) are matched to the episodes as in
minder_eval: a flag naming the victim during its fault (or `grace_s` after) is a detection,
every other flag a false positive; clean stretches with no flag count as clean.
"""
import json
import os
import random
import signal
import threading
import time

from absl import app, flags

from experiments import job
from experiments.results import write_record

_EPISODES = flags.DEFINE_integer("episodes", 20, "Fault episodes (as many clean stretches).")
_EPISODE_S = flags.DEFINE_integer("episode_s", 45, "Seconds per fault and per clean stretch.")
_FIT_S = flags.DEFINE_integer("fit_s", 90, "Seconds Minder trains on before detecting.")
_PROCESSES = flags.DEFINE_integer("num_processes", 3, "Worker processes (>= 3).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/minder_real", "Run folder.")
GRACE_S = 30


def worker_pids(workdir: str) -> dict[int, int]:
  """{rank: pid} from the driver's status screen."""
  out = {}
  try:
    with open(os.path.join(workdir, "resilience", "status.txt")) as f:
      for line in f:
        parts = line.split()
        if len(parts) > 3 and parts[0].isdigit() and parts[3].isdigit():
          out[int(parts[0])] = int(parts[3])   # rank slot host pid phase ...
  except OSError:
    pass
  return out


def hog(victim: int, seconds: float) -> None:
  """Pins `victim` and a busy child process to one core for `seconds`, then restores its affinity."""
  core = sorted(os.sched_getaffinity(victim))[0]
  before = os.sched_getaffinity(victim)
  pid = os.fork()
  if pid == 0:                                    # the busy child
    os.sched_setaffinity(0, {core})
    end = time.time() + seconds
    while time.time() < end:
      pass
    os._exit(0)
  try:
    os.sched_setaffinity(victim, {core})
    os.waitpid(pid, 0)
  finally:
    try:
      os.sched_setaffinity(victim, before)
    except OSError:
      pass


def throttle(victim: int, seconds: float) -> None:
  """SIGSTOPs `victim` half of every second for `seconds` (always leaving it continued)."""
  end = time.time() + seconds
  try:
    while time.time() < end:
      os.kill(victim, signal.SIGSTOP)
      time.sleep(0.5)
      os.kill(victim, signal.SIGCONT)
      time.sleep(0.5)
  finally:
    os.kill(victim, signal.SIGCONT)


def main(argv):
  del argv
  workdir, n = _WORKDIR.value, _PROCESSES.value
  plan_s = _FIT_S.value + 240 + 2 * _EPISODES.value * _EPISODE_S.value
  launcher = ["--num_processes", str(n), "--devices_per_process=1", "--heartbeat_s=1",
              "--straggler_detector=minder", f"--minder_fit_s={_FIT_S.value}",
              "--hang_timeout_s=600", "--max_restarts=0", "--status_every_s=5",
              f"--xla_flags={job.FAST_XLA}"]
  train = [*job.TINY_GPT, "--config.mesh.data=-1", "--config.mesh.tensor=1",
           f"--config.train.global_batch={2 * _PROCESSES.value}",
           "--config.train.steps=1000000", "--config.train.log_every=50",
           "--config.train.eval_every=1000000", "--config.train.checkpoint_every=1000000"]
  result = {}
  runner = threading.Thread(target=lambda: result.update(
      r=job.run(workdir, launcher, train, timeout_s=plan_s + 300, echo=False)), daemon=True)
  runner.start()
  log_path = os.path.join(workdir, "launcher.log")
  deadline = time.time() + plan_s
  while time.time() < deadline:
    time.sleep(2)
    text = open(log_path).read() if os.path.exists(log_path) else ""
    if "[minder] trained" in text:
      break
    if "r" in result:
      raise SystemExit("the job ended before Minder trained:\n" + text[-3000:])
  else:
    raise SystemExit("Minder never finished training; see " + log_path)
  pids = worker_pids(workdir)
  print(f"[real] Minder trained; workers {pids}", flush=True)
  rng = random.Random(0)
  episodes = []
  for i in range(_EPISODES.value):
    start = time.time()
    time.sleep(_EPISODE_S.value)
    episodes.append({"kind": "clean", "start": start, "end": time.time(), "rank": None})
    rank, kind = rng.randrange(n), rng.choice(["hog", "throttle"])
    start = time.time()
    (hog if kind == "hog" else throttle)(pids[rank], _EPISODE_S.value)
    episodes.append({"kind": kind, "start": start, "end": time.time(), "rank": rank})
    print(f"[real] episode {i + 1}: {kind} on rank {rank}", flush=True)
  time.sleep(GRACE_S)
  flags_ = []
  path = os.path.join(workdir, "resilience", "stragglers.jsonl")
  if os.path.exists(path):
    flags_ = [json.loads(line) for line in open(path)]
  faults = [e for e in episodes if e["rank"] is not None]
  detected, false = {}, 0
  for f in flags_:
    hit = next((i for i, e in enumerate(faults) if e["rank"] == f["rank"]
                and e["start"] <= f["time"] <= e["end"] + GRACE_S), None)
    if hit is None:
      false += 1
    elif hit not in detected:
      detected[hit] = f["time"] - faults[hit]["start"]
  clean = [e for e in episodes if e["rank"] is None]
  clean_flagged = sum(any(e["start"] <= f["time"] <= e["end"] for f in flags_) for e in clean)
  tp = len(detected)
  precision = tp / max(tp + false, 1)
  recall = tp / max(len(faults), 1)
  figures = {"episodes": episodes, "flags": flags_, "faults": len(faults),
             "detected": tp, "false_flags": false, "clean_stretches": len(clean),
             "clean_stretches_with_a_flag": clean_flagged, "precision": precision,
             "recall": recall, "f1": 2 * precision * recall / max(precision + recall, 1e-12),
             "latency_s": sorted(detected.values()),
             "per_kind": {k: {"faults": sum(e["kind"] == k for e in faults),
                              "detected": sum(faults[i]["kind"] == k for i in detected)}
                          for k in ("hog", "throttle")}}
  record = write_record("minder_real", figures, device={"platform": "cpu", "processes": n,
                                                         "host_cpu_count": os.cpu_count()})
  print(f"[real] P {precision:.2f} R {recall:.2f}; {false} false flags; record {record}")


if __name__ == "__main__":
  app.run(main)
