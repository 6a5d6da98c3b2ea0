"""The driver's eyes (MegaScale §5): straggler detection, hang localisation, a one-screen status,
per-rank TensorBoard scalars, clock offsets and the merged timeline of the run.

The driver (resilience/driver/supervisor.py) owns one `Observer` and calls it at a few points:
every heartbeat as it arrives (`receive`, from the HTTP thread), each poll (`observe`: may return
a straggler `Failure` under policy 'evict'), when a group starts and after a hang was declared
(`localize_hang`, before the group is killed), and at the end (`finish`). Everything it finds
goes to WORKDIR/resilience/: stragglers.jsonl, monitor.jsonl (the workers' per-second samples),
hang-attempt{A}.json, status.txt, and into the driver's report under 'observability'.
"""
import collections
import json
import os
import threading
import time

import numpy as np

from mscale_jax.observability import hang, straggler, trace
from mscale_jax.observability import timeline as timeline_lib
from mscale_jax.resilience import events

POLICIES = ("warn", "evict")
DETECTORS = ("threshold", "minder")


class Observer:
  """Watches one job's heartbeats on behalf of the driver.

  Args:
    workdir: the run folder. say: the driver's print.
    policy: 'warn' (print and record a straggler) or 'evict' (also restart without its slot).
    threshold, window: the step-phase detector's (straggler.StragglerDetector).
    status_every_s: period of the status screen (0: never).
    tokens_per_step: global batch x sequence length (for tokens/s on the status screen).
    host_probes: also flag ranks by their host probes (matmul time, memory). The probe runs on
      the worker's heartbeat thread, beside its training threads; where workers share cores
      (this 2-core machine) it measures that contention, not the host, and flagged a healthy
      rank in a drill, so it is off unless asked for.
    os_detector: the threshold detector also compares, every second, the ranks' run-queue wait
      share and major page faults (straggler.OS_THRESHOLDS) and flags a rank that exceeds the
      others' median by the metric's threshold for `os_window` seconds in a row (False: off).
    detector: 'threshold' (straggler.py on each step's phase seconds) or 'minder' (Minder on the
      workers' per-second monitoring samples, minder/watch.py; needs 3 or more ranks, and
      trains on the job's first `minder_fit_s` seconds before it flags anything).
  """

  def __init__(self, workdir: str, say, *, policy: str = "warn", threshold: float = 0.1,
               window: int = 10, status_every_s: float = 30.0, tokens_per_step: int = 0,
               host_probes: bool = False, detector: str = "threshold",
               minder_fit_s: int = 120, os_detector: bool = True, os_window: int = 10):
    self.workdir, self.say, self.policy = workdir, say, policy
    self.host_probes = host_probes
    if detector not in DETECTORS:
      raise ValueError(f"detector {detector!r}: expected one of {DETECTORS}")
    self.detector = detector
    self._watch = None
    if detector == "minder":
      from mscale_jax.observability.minder.watch import MinderWatch
      self._watch = MinderWatch(fit_s=minder_fit_s, say=say)
    self.threshold, self.window = threshold, window
    self.os_detector, self.os_window = os_detector, os_window
    self.status_every_s, self.tokens_per_step = status_every_s, tokens_per_step
    self.state_dir = os.path.join(workdir, "resilience")
    self.timeline_dir = os.path.join(workdir, "timeline")
    self.flags: list[dict] = []
    self.hangs: list[dict] = []
    self.clock_offsets: dict[int, float] = {}
    self._inbox = collections.deque()
    self._lock = threading.Lock()
    self._group = None
    self._writers = {}
    self._last_status = 0.0

  # -- the group -------------------------------------------------------------------------

  def start_group(self, group, restore_step: int = 0) -> None:
    """A (re)started group: fresh detectors; TensorBoard forgets steps after `restore_step`."""
    self._group = group
    self._table = straggler.StepTable()
    self._steps = straggler.StragglerDetector(threshold=self.threshold, window=self.window)
    self._hosts = straggler.StragglerDetector(threshold=1.0, window=self.window, unit="ratio",
                                              smooth=1)
    self._host_round = 0
    self._seconds = straggler.SecondTable()
    self._os = {m: straggler.StragglerDetector(threshold=t, window=self.os_window,
                                               unit="excess", smooth=straggler.OS_SMOOTH)
                for m, t in straggler.OS_THRESHOLDS.items()}
    self._probes = collections.defaultdict(lambda: collections.deque(maxlen=6))
    self._latest: dict[int, events.Heartbeat] = {}
    self._step_time = collections.deque(maxlen=20)
    self._inbox.clear()
    self._close_writers()
    self._purge_step = restore_step + 1 if restore_step else None
    if self._watch is not None:
      self._watch.reset()

  def receive(self, beat: events.Heartbeat, received: float) -> None:
    """Every heartbeat as it arrives (the server's thread): queued for `observe`."""
    self._inbox.append((beat, received))

  def observe(self, now: float) -> events.Failure | None:
    """Digests the new heartbeats; prints flags and the status. Under policy 'evict', a
    flagged rank comes back as a Failure (kind 'straggler') for the driver to act on."""
    group = self._group
    if group is None:
      return None
    new_flags = []
    while self._inbox:
      beat, received = self._inbox.popleft()
      if beat.attempt != group.attempt:
        continue
      self._latest[beat.rank] = beat
      offset = received - beat.time
      self.clock_offsets[beat.rank] = min(self.clock_offsets.get(beat.rank, offset), offset)
      for step, phases in beat.step_phases or ():
        self._table.add(beat.rank, step, phases)
      if self.host_probes and beat.host_metrics and beat.phase == events.TRAINING:
        self._probes[beat.rank].append(beat.host_metrics)
        new_flags += self._host_update()
      if beat.monitor and beat.phase == events.TRAINING:
        self._record_monitor(beat)
        self._seconds.add(beat.rank, beat.monitor)
        if self._watch is not None:
          self._watch.add(beat.rank, beat.monitor)
    # Ranks still running (in the driver's watch mode, with no processes of its own: those
    # that reported).
    live = [r for r, p in enumerate(group.procs) if p.poll() is None] if group.procs \
        else sorted(self._latest)
    for step, own, totals, step_time in self._table.ready(live):
      self._step_time.append(step_time)
      self._tensorboard(step, own, totals)
      flags_ = self._steps.update(step, own, step_time)
      if self._watch is None:
        new_flags += flags_
    for sec, values in self._seconds.ready(live):
      for metric, detector in self._os.items():
        if not all(metric in v for v in values.values()):
          continue
        flags_ = detector.update(sec, {r: {metric: v[metric]} for r, v in values.items()})
        if self._watch is None and self.os_detector:
          new_flags += flags_
    if self._watch is not None:
      new_flags += self._watch.update(live)
    for flag in new_flags:
      self._report_flag(flag)
    if self.status_every_s and now - self._last_status >= self.status_every_s:
      self._last_status = now
      self.status(now)
    if self.policy == "evict" and new_flags:
      flag = new_flags[0]
      latest = self._latest.get(flag.rank)
      by_step = self._watch is None and getattr(flag, "unit", None) == "step"
      step = flag.at if by_step else (latest.step if latest else None)
      return events.Failure(events.STRAGGLER, flag.rank, flag.describe(), step=step)
    return None

  def _record_monitor(self, beat: events.Heartbeat) -> None:
    """Appends a heartbeat's per-second samples to WORKDIR/resilience/monitor.jsonl (one line
    per heartbeat), so an evaluation can replay what the detectors saw."""
    os.makedirs(self.state_dir, exist_ok=True)
    with open(os.path.join(self.state_dir, "monitor.jsonl"), "a") as f:
      f.write(json.dumps({"attempt": beat.attempt, "rank": beat.rank,
                          "samples": beat.monitor}) + "\n")

  def _host_update(self) -> list:
    """One round of the host-probe detector once every rank sent a new probe while training;
    each rank's value is the median of its last 5 (a single probe is at the OS's mercy)."""
    fresh = {r for r, probes in self._probes.items() if probes and probes[-1] is not None}
    if len(fresh) < len(self._group.procs):
      return []
    self._host_round += 1
    values = {r: {k: float(np.median([p[k] for p in probes if p is not None]))
                  for k in straggler.HOST_METRICS} for r, probes in self._probes.items()}
    for probes in self._probes.values():
      probes.append(None)   # marks the round as used
    return self._hosts.update(self._host_round, values)

  def _report_flag(self, flag: straggler.Flag) -> None:
    record = {**flag.to_json(), "attempt": self._group.attempt,
              "slot": self._group.slots[flag.rank], "policy": self.policy, "time": time.time()}
    self.flags.append(record)
    os.makedirs(self.state_dir, exist_ok=True)
    with open(os.path.join(self.state_dir, "stragglers.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")
    self._driver_event("straggler", {"rank": flag.rank, "metric": flag.metric,
                                     "since": flag.since})
    self.say(f"{flag.describe()} [slot {record['slot']}; policy {self.policy}]")

  # -- live metrics ----------------------------------------------------------------------

  def _tensorboard(self, step: int, own: dict, totals: dict) -> None:
    """Per-rank step time, data wait and own time: WORKDIR/tensorboard/rank{R} (one line per
    rank on the same charts)."""
    for rank, total in totals.items():
      writer = self._writers.get(rank)
      if writer is None:
        from tensorboardX import SummaryWriter
        writer = self._writers[rank] = SummaryWriter(
            os.path.join(self.workdir, "tensorboard", f"rank{rank}"),
            purge_step=self._purge_step)
      writer.add_scalar("per_rank/step_time_s", total, step)
      writer.add_scalar("per_rank/data_wait_s", own[rank].get("data_wait", 0.0), step)
      writer.add_scalar("per_rank/own_time_s", sum(own[rank].values()), step)

  def _close_writers(self) -> None:
    for writer in self._writers.values():
      writer.close()
    self._writers = {}

  def status(self, now: float) -> str:
    """The one-screen status (printed and written to WORKDIR/resilience/status.txt)."""
    group = self._group
    step_time = sorted(self._step_time)[len(self._step_time) // 2] if self._step_time else None
    steps = [b.step for b in self._latest.values()]
    head = f"status: attempt {group.attempt}, {now - group.started:.0f} s, step " \
           f"{min(steps, default=0)}"
    if step_time:
      head += f", {1e3 * step_time:.0f} ms/step"
      if self.tokens_per_step:
        head += f", {self.tokens_per_step / step_time:,.0f} tokens/s"
    flagged = {f["rank"]: f["metric"] for f in self.flags if f["attempt"] == group.attempt}
    lines = [head, f"  {'rank':>4} {'slot':>4} {'host':<12} {'pid':>7} {'phase':<13} "
             f"{'step':>6} {'ms/step':>8} {'wait ms':>8} {'beat age':>8}  where / flags"]
    for rank, slot in enumerate(group.slots):
      beat = self._latest.get(rank)
      if beat is None:
        lines.append(f"  {rank:>4} {slot:>4} (no heartbeat yet)")
        continue
      where = _where(beat.where)
      flag = f"  STRAGGLER({flagged[rank]})" if rank in flagged else ""
      lines.append(
          f"  {rank:>4} {slot:>4} {beat.host[:12]:<12} {beat.pid:>7} {beat.phase:<13} "
          f"{beat.step:>6} {_ms(beat.step_time_s):>8} {_ms(beat.data_wait_s):>8} "
          f"{now - beat.time:>7.1f}s  {where}{flag}")
    text = "\n".join(lines)
    self.say(text)
    os.makedirs(self.state_dir, exist_ok=True)
    with open(os.path.join(self.state_dir, "status.txt"), "w") as f:
      f.write(text + "\n")
    return text

  # -- hangs -----------------------------------------------------------------------------

  def localize_hang(self, failure: events.Failure, wait_s: float = 5.0) -> dict | None:
    """After a declared hang, before the group is killed: every live worker dumps its stacks
    (SIGUSR1 -> faulthandler); the dumps, each rank's last loop phase and step and its mesh
    coordinates name the rank(s) not where the others are."""
    group = self._group
    if group is None:
      return None
    stacks = os.path.join(self.state_dir, "stacks")
    paths, sizes = {}, {}
    for rank, proc in enumerate(group.procs):
      if proc.poll() is None:
        paths[rank] = os.path.join(stacks, f"attempt{group.attempt}-rank{rank}.txt")
        sizes[rank] = os.path.getsize(paths[rank]) if os.path.exists(paths[rank]) else 0
        try:
          os.kill(proc.pid, hang.DUMP_SIGNAL)
        except ProcessLookupError:
          pass
    dumps = {}
    deadline = time.time() + wait_s
    while paths.keys() - dumps.keys() and time.time() < deadline:
      for rank in paths.keys() - dumps.keys():
        frames = _new_dump(paths[rank], sizes[rank])
        if frames and frames[-1][2] in hang.ENTRY_POINTS:
          dumps[rank] = frames
      time.sleep(0.05)
    self.observe(time.time())   # the newest heartbeats: where each loop is
    coords = _coordinates(self.timeline_dir, group.attempt)
    reports = []
    for rank in paths:
      beat = self._latest.get(rank)
      where = beat.where if beat and beat.where else [beat and beat.phase, None, None]
      step = where[1] if where[1] is not None else (beat.step if beat else None)
      code = hang.where_in_code(dumps.get(rank, [])) if rank in dumps else hang.NO_DUMP
      reports.append(hang.RankReport(rank, where[0], step, code, coords.get(rank, {})))
    result = hang.localize(reports)
    record = {"attempt": group.attempt, "failure": failure.to_json(), **result,
              "ranks": [{"rank": r.rank, "phase": r.phase, "step": r.step, "code": r.code,
                         "coords": r.coords, "stack_file": paths.get(r.rank)} for r in reports]}
    self.hangs.append(record)
    os.makedirs(self.state_dir, exist_ok=True)
    with open(os.path.join(self.state_dir, f"hang-attempt{group.attempt}.json"), "w") as f:
      json.dump(record, f, indent=2)
    by_rank = {r.rank: r for r in reports}
    for g in result["groups"]:
      self.say(f"hang localisation: ranks {g['ranks']} at {g['phase']} (step(s) {g['steps']}) "
               f"in {g['code']}")
    if result["odd_ranks"]:
      named = "; ".join(f"rank {r} ({hang.format_coords(by_rank[r].coords)})"
                        for r in result["odd_ranks"])
      self.say(f"hang localisation: not where the others are: {named} ({result['reason']})")
    else:
      self.say(f"hang localisation: no odd rank ({result['reason']})")
    self._driver_event("hang", {"odd_ranks": result["odd_ranks"]})
    return record

  # -- the end ---------------------------------------------------------------------------

  def summary(self) -> dict:
    """What goes into the driver's report."""
    return {"straggler_policy": self.policy, "straggler_flags": self.flags,
            "hang_localisations": self.hangs, "clock_offsets_s": self.clock_offsets}

  def finish(self, report: dict) -> dict | None:
    """Writes the driver's events and the clock offsets, merges the ranks' timelines into
    trace.json / summary.json / heatmap.png, closes TensorBoard."""
    self._close_writers()
    os.makedirs(self.timeline_dir, exist_ok=True)
    with open(os.path.join(self.timeline_dir, "clock_offsets.json"), "w") as f:
      json.dump(self.clock_offsets, f)
    for a in report.get("attempts", []):
      self._driver_event(f"attempt {a['attempt']}", {"slots": a["slots"],
                                                    "failure": a["failure"]},
                         start=a["started"], end=a["ended"])
    for f in report.get("failures", []):
      if f.get("restart_s") is not None:
        self._driver_event("restart", {"after": f["kind"], "rank": f["rank"]},
                           start=f["detected_at"], end=f["detected_at"] + f["restart_s"])
    try:
      merged = trace.merge(self.workdir)
    except (FileNotFoundError, ValueError) as e:
      self.say(f"timeline: nothing merged ({e})")
      return None
    self.say(f"timeline: {merged['trace']} (Perfetto / chrome://tracing), heat-map "
             f"{merged['heatmap']}")
    return merged

  def _driver_event(self, name: str, args: dict, start: float | None = None,
                    end: float | None = None) -> None:
    os.makedirs(self.timeline_dir, exist_ok=True)
    start = time.time() if start is None else start
    with open(os.path.join(self.timeline_dir, "driver.jsonl"), "a") as f:
      f.write(json.dumps({"name": name, "step": None, "start": start,
                          "end": start if end is None else end, "track": "driver",
                          "args": args}) + "\n")


def _where(where) -> str:
  if not where or not where[0]:
    return ""
  return where[0] if where[1] is None else f"{where[0]} step {where[1]}"


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _new_dump(path: str, offset: int) -> list:
  try:
    with open(path) as f:
      f.seek(offset)
      return hang.main_thread_frames(f.read())
  except OSError:
    return []


def _coordinates(timeline_dir: str, attempt: int) -> dict[int, dict]:
  """{rank: mesh coordinates} from the ranks' timeline meta lines of `attempt`."""
  out = {}
  if not os.path.isdir(timeline_dir):
    return out
  for name in os.listdir(timeline_dir):
    if name.startswith("rank") and name.endswith(".jsonl"):
      metas, _ = timeline_lib.read_rank_file(os.path.join(timeline_dir, name))
      for meta in metas:
        if meta.get("attempt") == attempt:
          out[meta["rank"]] = meta.get("coords", {})
  return out
