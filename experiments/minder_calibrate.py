"""Per-step noise of our own training runs, for the Minder fleet traces' healthy model.

  python -m experiments.minder_calibrate --timeline=WORKDIR/timeline [--first_step=20]

Reads the per-rank timelines (observability/timeline.py: WORKDIR/timeline/rank{R}.jsonl) of a
clean stretch of a run, sums each phase per step and rank, and records per phase the mean, the
median, the fraction of the iteration, and two coefficients of variation: plain (std / mean) and
robust (1.4826 x median absolute deviation / median, which ignores the bursts another process on
a shared host causes). experiments/minder_fleet.py's CALIBRATION cites the record.
"""
import collections
import glob
import json
import os

from absl import app, flags
import numpy as np

from experiments.results import write_record

_TIMELINE = flags.DEFINE_string("timeline", None, "A run's timeline folder.", required=True)
_FIRST = flags.DEFINE_integer("first_step", 20, "First step used (skip warm-up).")
_LAST = flags.DEFINE_integer("last_step", 195, "Last step used (before any injected fault).")


def phase_table(path: str, first: int, last: int) -> dict:
  """{step: {phase: seconds}} of one rank's timeline, steps first..last."""
  per = collections.defaultdict(lambda: collections.defaultdict(float))
  with open(path) as f:
    for line in f:
      span = json.loads(line)
      step = span.get("step")
      if "name" in span and step is not None and first <= step <= last:
        per[step][span["name"]] += span["end"] - span["start"]
  return per


def stats(x: np.ndarray, total: np.ndarray) -> dict:
  """Mean, median, share of the iteration `total` and spread (CV, MAD-based CV) of phase `x`."""
  med = float(np.median(x))
  return {"mean_s": float(x.mean()), "median_s": med,
          "fraction_of_iteration": float(x.mean() / total.mean()),
          "cv": float(x.std() / max(x.mean(), 1e-12)),
          "robust_cv": float(1.4826 * np.median(np.abs(x - med)) / max(med, 1e-12))}


def main(argv):
  del argv
  ranks = {}
  for path in sorted(glob.glob(os.path.join(_TIMELINE.value, "rank*.jsonl"))):
    per = phase_table(path, _FIRST.value, _LAST.value)
    names = sorted({n for v in per.values() for n in v})
    total = np.array([sum(v.values()) for v in per.values()])
    ranks[os.path.basename(path)[:-6]] = {
        "steps": len(per), "iteration": stats(total, total),
        **{n: stats(np.array([v.get(n, 0.0) for v in per.values()]), total) for n in names}}
  if not ranks:
    raise app.UsageError(f"no rank*.jsonl under {_TIMELINE.value}")
  path = write_record("minder_calibration", {"ranks": ranks},
                      extra={"timeline": _TIMELINE.value})
  print(path)
  for rank, table in ranks.items():
    for name, s in table.items():
      if isinstance(s, dict):
        print(f"{rank} {name:16s} mean {s['mean_s']:.5f} s  cv {s['cv']:.3f}  robust cv "
              f"{s['robust_cv']:.3f}")


if __name__ == "__main__":
  app.run(main)
