r"""The run-queue straggler detector replayed on what drills recorded: how far apart healthy ranks
are, how far a busy neighbour puts its victim, and what each setting would have flagged.

  python -m experiments.os_detector_replay --run=runs/fault_drill/faults-X \
      --run=runs/fault_drill/reference-X

Every run's WORKDIR/resilience/monitor.jsonl holds each rank's per-second samples (what the
driver's detector saw). Per run: the per-second spread of `runq_wait_share` between two ranks
and its percentiles over 5-s and 10-s means (seconds of a `contend` fault and the 60 s after
left out), the victim's excess over its peer while a `contend` fault ran, and, per setting
(smoothing, threshold), the flags the detector (observability/straggler.py, window 10) raises
on the recorded samples: whether it flags the victim and how many flags it raises anywhere else.
Writes a results/ record (no JAX needed).
"""
import collections
import glob
import json
import os

import numpy as np
from absl import app, flags

from experiments.results import write_record
from mscale_jax.observability import straggler

FLAGS = flags.FLAGS
METRIC = "runq_wait_share"
WINDOW = 10


def samples(run_dir: str) -> dict[tuple[int, int], dict[int, float]]:
  """{(attempt, epoch second): {rank: runq_wait_share}} of a run."""
  out = collections.defaultdict(dict)
  with open(os.path.join(run_dir, "resilience", "monitor.jsonl")) as f:
    for line in f:
      beat = json.loads(line)
      for s in beat.get("samples") or []:
        if s.get(METRIC) is not None:
          out[(beat["attempt"], int(s["t"]))][beat["rank"]] = s[METRIC]
  return out


def contend_windows(run_dir: str) -> list[dict]:
  """The run's fired `contend` faults: {'rank', 'start', 'end'} (epoch seconds)."""
  from mscale_jax.resilience.faults import parse_fault
  out = []
  for path in sorted(glob.glob(os.path.join(run_dir, "resilience", "faults", "*contend*"))):
    with open(path) as f:
      marker = json.load(f)
    fault = parse_fault(marker["fault"])
    out.append({"rank": fault.rank, "start": marker["time"],
                "end": marker["time"] + fault.seconds})
  return out


def replay(by_second, smooth: int, threshold: float) -> list[dict]:
  """The flags the detector raises on the recorded samples (one detector per attempt)."""
  detectors, flags_ = {}, []
  for attempt, second in sorted(by_second):
    values = by_second[(attempt, second)]
    if len(values) < 2:
      continue
    detector = detectors.setdefault(attempt, straggler.StragglerDetector(
        threshold=threshold, window=WINDOW, unit="excess", smooth=smooth))
    flags_ += [{"rank": f.rank, "since": f.since, "at": f.at, "value": f.value,
                "others": f.others}
               for f in detector.update(second, {r: {METRIC: v} for r, v in values.items()})]
  return flags_


def spread(by_second, skip, smooth: int) -> dict:
  """Percentiles of |rank 1 - rank 0| over `smooth`-second means, seconds in `skip` left out."""
  keys = [k for k in sorted(by_second) if len(by_second[k]) == 2 and k[1] not in skip]
  diff = np.array([by_second[k][1] - by_second[k][0] for k in keys])
  if len(diff) < smooth:
    return {}
  means = np.abs(np.convolve(diff, np.ones(smooth) / smooth, "valid"))
  p50, p95, p99, top = np.percentile(means, [50, 95, 99, 100])
  return {"seconds": len(diff), "p50": p50, "p95": p95, "p99": p99, "max": top}


def one_run(run_dir: str, settings) -> dict:
  by_second, windows = samples(run_dir), contend_windows(run_dir)
  skip = {s for w in windows for s in range(int(w["start"]), int(w["end"]) + 61)}
  victim = []
  for w in windows:
    inside = [v for (_, s), v in by_second.items() if w["start"] <= s <= w["end"] and len(v) == 2]
    victim.append({**w, "excess_median": float(np.median(
        [v[w["rank"]] - v[1 - w["rank"]] for v in inside])) if inside else None})
  out = {"run": run_dir, "contend": victim,
         "healthy_spread": {f"{k}s_means": spread(by_second, skip, k) for k in (1, 5, 10)},
         "settings": {}}
  for smooth, threshold in settings:
    raised = replay(by_second, smooth, threshold)
    hit = [f for f in raised for w in windows
           if f["rank"] == w["rank"] and w["start"] <= f["at"] <= w["end"] + 60]
    out["settings"][f"smooth {smooth} s, threshold {threshold}"] = {
        "victim_flagged_after_s": hit[0]["at"] - windows[0]["start"] if hit else None,
        "other_flags": len(raised) - len(hit)}
  return out


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_multi_string("run", [], "Run folders (their resilience/monitor.jsonl).")
  flags.DEFINE_multi_string("setting", ["5:0.1", "10:0.05", "5:0.05", "10:0.07"],
                            "SMOOTH:THRESHOLD pairs to replay.")


def main(argv):
  del argv
  settings = [(int(a), float(b)) for a, b in (s.split(":") for s in FLAGS.setting)]
  figures = {"metric": METRIC, "window": WINDOW, "runs": [one_run(r, settings) for r in FLAGS.run],
             "current_setting": {"smooth": straggler.OS_SMOOTH,
                                 "threshold": straggler.OS_THRESHOLDS[METRIC]}}
  path = write_record("os_detector_replay", figures, device={"platform": "cpu"})
  print(json.dumps(figures, indent=1, default=float))
  print(f"[replay] wrote {path}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
