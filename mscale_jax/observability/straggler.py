"""Straggler detection in the spirit of Minder (ByteDance, NSDI'25): per-rank metrics, each
normalised across ranks, each rank's distance from the others, and a flag only when a rank stays
abnormal for a continuity window.

Pure numpy; the driver feeds it what heartbeats carry (through observer.py):

* per loop iteration, each rank's seconds in its own-work phases (phases.py: data_wait,
  host_to_device, host, log, eval, checkpoint_stall). Wait phases (dispatch, sync) are left out:
  in synchronous training the fast ranks wait there for the slow one, so they mirror a
  straggler instead of pointing at it. A rank's distance on a metric is its excess over the
  median of the other ranks, as a fraction of the job's step time ("rank 1 spends 0.48 of a
  step more in `host` than the others"); `threshold` is that fraction (default 0.1: the paper's
  "~10% slower machines").
* per second, two of the workers' monitoring samples (resilience/worker/monitor.py), each with
  its own threshold (OS_THRESHOLDS): the run-queue wait share (of the time a rank's threads were
  runnable, the share they waited for a CPU: a rank whose CPU the OS gives to someone else
  waits on a run queue, while its peers, slowed alike in synchronous training, wait in the
  collective, off the run queue) and major page faults per second (memory pressure). Distance:
  the excess over the others' median in the metric's own units (`unit='excess'`).
* per heartbeat, host probes (a local matmul's time, resident memory; off by default, see
  observer.py): distance is
  the ratio to the others' median minus one (`threshold` 1.0: twice the others).

Each rank's metrics (and the step time) are first averaged over the last `smooth` updates: the
loop moves work between neighbouring iterations (a step's result is fetched one iteration late,
two at once after a logged step), and a single hiccup should not break a streak or start one.
With 5 or more ranks a rank must also be a robust outlier (more than `z` scaled median absolute
deviations above the others), so a wide but healthy spread flags nobody. A rank is flagged once
it was abnormal on `window` consecutive (smoothed) updates, so a slowdown shorter than
`window - smooth + 1` updates is never flagged; the flag names the metric it was most often
furthest out on and the first update of the streak ("since"). A flag clears after `window`
normal updates in a row.
"""
import collections
import dataclasses
import math
import time

import numpy as np

OWN_PHASES = ("data_wait", "host_to_device", "host", "log", "eval", "checkpoint_stall")
HOST_METRICS = ("probe_ms", "rss_mb")   # the host probes the detector compares
# Per-second monitoring samples the detector compares, each averaged over OS_SMOOTH seconds, and
# the excess over the other ranks' median that counts as abnormal. runq_wait_share: on this
# oversubscribed 2-core host every rank waits for a CPU most of the time, so the share crowds
# towards 1 and a busy process on one rank's core put it only 0.07-0.12 above its peer in three
# drills; healthy ranks' 10-s means stayed within 0.032-0.062 of each other and never 0.05 apart
# for 10 s in a row, so 10-s means and 0.05 (results/os_detector_replay-cpu-20261126T122000.json,
# docs/monitoring.md). majflt_per_s: healthy ranks have none once compiled; a rank
# whose memory is reclaimed takes thousands a second.
OS_THRESHOLDS = {"runq_wait_share": 0.05, "majflt_per_s": 100.0}
OS_SMOOTH = 10
OS_METRICS = tuple(OS_THRESHOLDS)


@dataclasses.dataclass
class Flag:
  """Rank `rank` stayed abnormal from update `since` to `at`, furthest out on `metric`."""
  rank: int
  metric: str
  since: int
  at: int
  score: float          # the distance (fraction of a step, or ratio - 1), mean over the streak
  value: float          # the rank's mean value of `metric` over the streak
  others: float         # the median of the other ranks' values over the streak
  unit: str = "step"

  def describe(self) -> str:
    if self.unit == "step":
      what = (f"{self.metric} {1e3 * self.value:.1f} ms/step vs {1e3 * self.others:.1f} ms on "
              f"the others (+{100 * self.score:.0f}% of a step)")
      when = f"since step {self.since} (flagged at step {self.at})"
    elif self.unit == "excess":
      what = f"{self.metric} {self.value:.3g} vs {self.others:.3g} on the others"
      when = (f"since {time.strftime('%H:%M:%S', time.gmtime(self.since))} UTC "
              f"(flagged {self.at - self.since} s later)")
    else:
      what = f"{self.metric} {self.value:.3g} vs {self.others:.3g} on the others"
      when = f"since heartbeat {self.since} (flagged at heartbeat {self.at})"
    return f"straggler: rank {self.rank}: {what}, {when}"

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), "message": self.describe()}


class StragglerDetector:
  """Consumes one update per step (or per heartbeat round), returns the new flags.

  Args:
    threshold: distance above which a rank is abnormal on a metric.
    window: consecutive abnormal updates before a flag (the continuity window).
    unit: 'step' (seconds per iteration, distance as a fraction of the step time), 'ratio'
      (distance = value / median of the others - 1) or 'excess' (value - median of the others,
      in the metric's units; updates indexed by epoch second).
    smooth: updates each rank's metrics are averaged over before scoring.
    z: with >= `min_ranks_for_z` ranks, also required: value - median of others > z x 1.4826
      x MAD of the others.
  """

  def __init__(self, *, threshold: float = 0.1, window: int = 10, unit: str = "step",
               smooth: int = 4, z: float = 3.0, min_ranks_for_z: int = 5):
    self.threshold, self.window, self.unit = threshold, window, unit
    self._recent = collections.deque(maxlen=smooth)   # (values, step time) of recent updates
    self.z, self.min_ranks_for_z = z, min_ranks_for_z
    self.flags: list[Flag] = []
    self.active: dict[int, Flag] = {}
    self._streak: dict[int, list] = collections.defaultdict(list)   # rank: [(index, metric,
    self._calm: dict[int, int] = collections.defaultdict(int)       #   score, value, others)]

  def distances(self, values: dict[int, dict[str, float]], step_time: float | None = None
                ) -> dict[int, tuple[str, float, float, float]]:
    """{rank: (metric, distance, value, others' median)} of each rank's furthest-out metric."""
    ranks = sorted(values)
    metrics = sorted({m for v in values.values() for m in v})
    if len(ranks) < 2 or not metrics:
      return {}
    table = np.array([[values[r].get(m, 0.0) for m in metrics] for r in ranks], dtype=float)
    out = {}
    for i, rank in enumerate(ranks):
      others = np.delete(table, i, axis=0)
      median = np.median(others, axis=0)
      excess = table[i] - median
      if self.unit == "step":
        score = excess / max(step_time or 0.0, 1e-9)
      elif self.unit == "excess":
        score = excess
      else:
        score = table[i] / np.maximum(median, 1e-12) - 1.0
      if len(ranks) >= self.min_ranks_for_z:
        mad = 1.4826 * np.median(np.abs(others - median), axis=0)
        score = np.where(excess > self.z * mad, score, 0.0)
      j = int(np.argmax(score))
      out[rank] = (metrics[j], float(score[j]), float(table[i, j]), float(median[j]))
    return out

  def update(self, index: int, values: dict[int, dict[str, float]],
             step_time: float | None = None) -> list[Flag]:
    """One update (step or heartbeat round `index`): {rank: {metric: value}}; new flags."""
    self._recent.append((values, step_time))
    smoothed = {r: {m: float(np.mean([v.get(r, {}).get(m, 0.0) for v, _ in self._recent]))
                    for m in values[r]} for r in values}
    times = [t for _, t in self._recent if t is not None]
    step_time = float(np.mean(times)) if times else None
    new = []
    for rank, (metric, score, value, others) in self.distances(smoothed, step_time).items():
      if score > self.threshold:
        self._calm[rank] = 0
        streak = self._streak[rank]
        streak.append((index, metric, score, value, others))
        if len(streak) >= self.window and rank not in self.active:
          flag = self._flag(rank, streak, index)
          self.active[rank] = flag
          self.flags.append(flag)
          new.append(flag)
      else:
        self._streak[rank] = []
        self._calm[rank] += 1
        if self._calm[rank] >= self.window:
          self.active.pop(rank, None)
    return new

  def _flag(self, rank: int, streak: list, index: int) -> Flag:
    metric = collections.Counter(m for _, m, *_ in streak).most_common(1)[0][0]
    mine = [s for s in streak if s[1] == metric]
    return Flag(rank=rank, metric=metric, since=streak[0][0], at=index,
                score=float(np.mean([s[2] for s in mine])),
                value=float(np.mean([s[3] for s in mine])),
                others=float(np.mean([s[4] for s in mine])), unit=self.unit)


class StepTable:
  """Collects per-rank iteration records from heartbeats until every rank reported a step.

  `add(rank, step, phases)` with each heartbeat's [[step, {phase: s}], ...]; `ready(ranks)`
  yields (step, {rank: {own phase: s}}, {rank: iteration seconds}, step time) for steps all
  `ranks` have reported, in order. The step time is the median of the ranks' iteration times.
  """

  def __init__(self):
    self._rows: dict[int, dict[int, dict]] = collections.defaultdict(dict)

  def add(self, rank: int, step: int, phases: dict[str, float]) -> None:
    self._rows[step][rank] = phases

  def ready(self, ranks):
    ranks = set(ranks)
    if not ranks:
      return
    complete = [s for s in sorted(self._rows) if ranks <= set(self._rows[s])]
    if not complete:
      return
    for step in sorted(s for s in self._rows if s <= complete[-1]):
      row = self._rows.pop(step)
      if not ranks <= set(row):
        continue   # a rank's heartbeat with this step was lost: skip the step
      totals = {r: float(sum(row[r].values())) for r in ranks}
      own = {r: {p: row[r].get(p, 0.0) for p in OWN_PHASES} for r in ranks}
      yield step, own, totals, float(np.median(list(totals.values())))


class SecondTable:
  """Lines up the workers' per-second monitoring samples (Heartbeat.monitor) on whole seconds.

  `add(rank, samples)` with each heartbeat's samples; `ready(ranks)` yields (second, {rank:
  {metric: value}}) for the seconds every rank in `ranks` has a sample for, in order; a value
  that is missing or not a finite number is left out. Anything not shaped like a sample
  (heartbeats come from the network) is skipped.
  """

  def __init__(self, metrics=OS_METRICS):
    self.metrics = tuple(metrics)
    self._rows: dict[int, dict[int, dict]] = collections.defaultdict(dict)

  def add(self, rank: int, samples) -> None:
    for s in samples or ():
      if not isinstance(s, dict) or not _finite(s.get("t")):
        continue
      values = {m: float(s[m]) for m in self.metrics if _finite(s.get(m))}
      if values:
        self._rows[int(s["t"])][rank] = values

  def ready(self, ranks):
    ranks = set(ranks)
    complete = [s for s in sorted(self._rows) if ranks and ranks <= set(self._rows[s])]
    if not complete:
      return
    for sec in sorted(s for s in self._rows if s <= complete[-1]):
      row = self._rows.pop(sec)
      if ranks <= set(row):
        yield sec, {r: row[r] for r in ranks}


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
