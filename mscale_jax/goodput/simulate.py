"""A discrete-event simulator of one synchronous training job through its failures.

  from mscale_jax.goodput import simulate
  out = simulate.simulate(job, seed=0, hours=30 * 24)
  out.rate, out.breakdown            # effective training time rate; wall seconds by category

The job trains, checkpoints every K iterations (a synchronous stall, then a background persist
after which the checkpoint is durable) and is interrupted by failures that arrive as a Poisson
process in wall time, one stream per seed, at `Job.failures_per_hour` split by kind. A failure
stops training; recovery then runs detection, diagnosis (self-checks), replacement of the
failed node (a warm spare, or a cold node from the scheduler) and restart (process start,
initialisation, compilation, checkpoint restore), and training resumes from the latest durable
checkpoint, so the work since then is replayed. Failures keep arriving during recovery; one
that does starts the recovery over (its time so far stays charged to the phase it cut short).
A planned stop checkpoints first and loses no work. A slow machine does not stop the job: every
iteration runs `slowdown` times longer until the straggler detector has watched it for
`Detection.straggler_s` of training, then it is evicted like a failed node (self-checks do not
find slow machines, MegaScale §5, so restarts in between keep it). An in-memory checkpoint tier
(copies in peers' host memory, Gemini) survives any single failure and is restored from first
when it is the newer one.

The effective training time rate is MegaScale's: iterations x fault-free iteration time over
wall time, i.e. `breakdown['training'] / wall_s`; every wall second falls in one of CATEGORIES.
Failure arrival times and kinds depend only on the seed, never on the job's policy, so two jobs
simulated with one seed meet the same failures (common random numbers for comparisons).
Scheduled faults (`ScheduledFault`, e.g. a drill's) fire when training first reaches a given
iteration, with their own measured costs.
"""
import collections
import dataclasses
import heapq
import math
import random
import statistics

from mscale_jax.errors import ConfigError
from mscale_jax.goodput.job import FailureKind, Job, validate

CATEGORIES = ("training", "replay", "checkpoint", "startup", "detection", "diagnosis",
              "replacement", "restart", "slowdown", "overhead")
_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class ScheduledFault:
  """A fault at a known point with known costs (from a drill record).

  at_iteration: iterations completed when it strikes (a fault injected at step s strikes after
    s - 1); it fires once, the first time training gets there.
  during_save: it strikes during the save at `at_iteration`, which is then lost.
  detection_s, diagnosis_s: measured latencies; restart_s: diagnosis end to training again
    (process start, restore, replacement included).
  saves_written: the saves still persisting when it strikes are written all the same (it struck
    once they were, e.g. a fault from outside that fires on a late heartbeat).
  newest_corrupt: the newest durable checkpoint is unusable (corrupted), so the restart restores
    the one before it.
  newest_unwritten: the newest save before it had not committed when it struck (its background
    write still running: a race the sim cannot call, read from a drill's record), so the
    restart restores the one before it.
  """
  at_iteration: float
  name: str
  detection_s: float
  diagnosis_s: float
  restart_s: float
  during_save: bool = False
  saves_written: bool = False
  newest_corrupt: bool = False
  newest_unwritten: bool = False


@dataclasses.dataclass(frozen=True)
class Recovered:
  """One completed recovery: what caused it, where training stood, where it resumed."""
  cause: str
  at_iteration: float
  restored_to: float

  @property
  def lost_iterations(self) -> float:
    return self.at_iteration - self.restored_to


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One simulated run. breakdown: wall seconds by CATEGORIES (they sum to wall_s)."""
  wall_s: float
  breakdown: dict
  failures: dict          # kind -> arrivals (during recovery too)
  recoveries: tuple       # Recovered, in order

  @property
  def rate(self) -> float:
    """Effective training time rate: first-time iterations x iteration time / wall time."""
    return self.breakdown["training"] / self.wall_s if self.wall_s else 0.0


@dataclasses.dataclass(frozen=True)
class _Cause:
  """What a recovery has to do: a random failure's kind with the job's costs, or a fault's."""
  name: str
  planned: bool
  replace_node: bool
  detection_s: float
  diagnosis_s: float
  restart_s: float | None      # None: the job's restart + the restore it needs


class _Run:
  """The state of one simulated job; `go` runs it to the end."""

  def __init__(self, job: Job, seed: int, faults, stop_s: float, stop_iterations: float):
    self.job, self.stop_s, self.stop_iterations = job, stop_s, stop_iterations
    self.rng = random.Random(seed)
    self.rate_per_s = job.failures_per_hour / 3600.0
    self.weights = [k.per_node_hour for k in job.kinds]
    self.faults = sorted(faults, key=lambda f: (f.at_iteration, not f.during_save))
    self.t = 0.0
    self.done = 0.0              # iterations of the current trajectory
    self.high = 0.0              # furthest iteration ever reached
    self.durable = 0.0           # latest durable storage checkpoint (iteration)
    self.pending = []            # [(iteration, durable_at)] storage saves still persisting
    self.memory = None           # latest in-memory checkpoint (iteration)
    # A stall-free in-memory tier needs no events: see _snapshot_memory.
    self.free_memory = bool(job.memory_every) and job.checkpointing.memory_stall_s == 0
    self.first_save = True
    self.slow = []               # [slowdown, training seconds left until detected]
    self.spares = job.recovery.warm_spares
    self.restock = []            # heap of times used spares are back
    self.acc = dict.fromkeys(CATEGORIES, 0.0)
    self.failures = collections.Counter()
    self.recoveries = []
    self.next_failure = self._draw()

  # -- failure arrivals and the clock -------------------------------------------------------------
  def _draw(self) -> tuple:
    """(time, kind) of the next failure arrival (time inf without failures)."""
    if self.rate_per_s <= 0:
      return math.inf, None
    when = self.t + self.rng.expovariate(self.rate_per_s)
    return when, self.rng.choices(self.job.kinds, weights=self.weights)[0]

  def _run_for(self, duration: float, training: bool):
    """Lets up to `duration` seconds pass; returns (seconds passed, event or None).

    Events: ('stop',), ('failure', kind), ('straggler', index) (the detector has found slow
    machine `index`), ('slow',) (a machine turned slow: the pace changed). During recovery
    (`training` False) a machine turning slow or a planned stop is absorbed, not an event, and
    the straggler detector, which watches iterations, does not advance.
    """
    spent = 0.0
    while True:
      left = duration - spent
      detect, first = math.inf, None
      if training and self.slow:
        first = min(range(len(self.slow)), key=lambda i: self.slow[i][1])
        detect = self.t + max(0.0, self.slow[first][1])
      when, kind = self.next_failure
      cut = min(when, detect, self.stop_s)
      if self.t + left <= cut:
        self._tick(left, training)
        return duration, None
      step = max(0.0, cut - self.t)
      self._tick(step, training)
      spent += step
      if cut == self.stop_s:
        return spent, ("stop",)
      if cut == detect:
        return spent, ("straggler", first)
      self.failures[kind.name] += 1
      self.next_failure = self._draw()
      if kind.detected_by == "straggler":
        self.slow.append([kind.slowdown, self.job.detection.straggler_s])
        if training:
          return spent, ("slow",)
      elif kind.detected_by != "planned" or training:
        return spent, ("failure", kind)

  def _tick(self, seconds: float, training: bool) -> None:
    self.t += seconds
    if training:
      for s in self.slow:
        s[1] -= seconds

  # -- training and checkpoints -------------------------------------------------------------------
  def _slowdown(self) -> float:
    """How much longer an iteration takes now: the job runs at its slowest machine's pace."""
    return max((s[0] for s in self.slow), default=1.0)

  def _pace(self, slowdown: float) -> float:
    """Wall seconds per iteration at `slowdown`, fault-free overhead included."""
    return self.job.iteration_s * slowdown + self.job.overhead_per_iteration_s

  def _credit(self, iterations: float, slowdown: float) -> None:
    """Charges `iterations` just run at `slowdown`: first-time work, replay, slow-machine and
    overhead time."""
    job = self.job
    new = max(0.0, self.done + iterations - max(self.done, self.high))
    self.acc["training"] += new * job.iteration_s
    self.acc["replay"] += (iterations - new) * job.iteration_s
    self.acc["slowdown"] += iterations * job.iteration_s * (slowdown - 1.0)
    self.acc["overhead"] += iterations * job.overhead_per_iteration_s
    self.done += iterations
    self.high = max(self.high, self.done)

  def _train(self):
    """Trains (and checkpoints) until an event; returns it."""
    job = self.job
    every = job.checkpoint_every
    memory_every = None if self.free_memory else job.memory_every   # saves with a stall
    while True:
      self._fast_forward()
      boundary = _next_multiple(self.done, every)
      if memory_every:
        boundary = min(boundary, _next_multiple(self.done, memory_every))
      fault = self.faults[0] if self.faults else None
      fault_at = fault.at_iteration if fault else math.inf
      target = min(boundary, fault_at, self.stop_iterations)
      slowdown = self._slowdown()
      pace = self._pace(slowdown)
      spent, event = self._run_for((target - self.done) * pace, training=True)
      self._credit(spent / pace if event else target - self.done, slowdown)
      if event == ("slow",):
        continue
      if event:
        return event
      at_fault = fault is not None and self.done >= fault_at - _EPS
      storage = _is_multiple(self.done, every)
      memory = bool(memory_every) and _is_multiple(self.done, memory_every)
      if at_fault and fault.during_save and (storage or memory):
        return ("fault", self.faults.pop(0))
      if (storage or memory) and self.done > self._latest_taken() + _EPS:
        event = self._save(storage, memory)
        if event:
          return event
        continue
      if at_fault:
        return ("fault", self.faults.pop(0))
      if self.done >= self.stop_iterations - _EPS:
        return ("stop",)

  def _fast_forward(self) -> None:
    """Runs whole uneventful cycles (K iterations, then a save) in one step.

    Only from a storage checkpoint just taken, with steady saves (not the first after a start,
    no stalled in-memory tier, each persist done before the next save is due), and stopping
    short of the next failure, straggler detection, scheduled fault and end: the cycles it
    skips are exactly those the event loop would run, only faster.
    """
    job, cp = self.job, self.job.checkpointing
    every = job.checkpoint_every
    if (self.first_save and cp.first_stall_s is not None) or \
        (job.memory_every and not self.free_memory) or not self.pending or \
        abs(self.pending[-1][0] - self.done) > _EPS:
      return
    slowdown = self._slowdown()
    pace = self._pace(slowdown)
    if cp.persist_s > every * pace:
      return
    cycle = every * pace + cp.stall_s
    detect = min((s[1] for s in self.slow), default=math.inf)
    cut = min(self.next_failure[0], self.t + detect, self.stop_s)
    fault_at = self.faults[0].at_iteration if self.faults else math.inf
    n = min((cut - self.t) / cycle, (min(fault_at, self.stop_iterations) - self.done) / every)
    if n == math.inf:
      raise ConfigError("hours/iterations", "inf", "a finite end (no failure will stop it)")
    n = math.floor(n - _EPS)
    if n < 1:
      return
    self._credit(n * every, slowdown)
    self.acc["checkpoint"] += n * cp.stall_s
    self._tick(n * cycle, training=True)
    self.durable = max(self.durable, self.done - every)
    self.pending = [(self.done, self.t + cp.persist_s)]

  def _latest_taken(self) -> float:
    """The latest checkpoint taken on this trajectory, durable or not (never saved twice)."""
    taken = [self.durable] + [p for p, _ in self.pending]
    if self.memory is not None:
      taken.append(self.memory)
    return max(taken)

  def _save(self, storage: bool, memory: bool):
    """The stall of the save(s) due now; returns an event if one cuts it short (save lost)."""
    cp = self.job.checkpointing
    stall = 0.0
    if storage:
      first = cp.first_stall_s if self.first_save and cp.first_stall_s is not None else None
      backlog = max(0.0, self.pending[-1][1] - self.t) if self.pending else 0.0
      stall = (cp.stall_s if first is None else first) + backlog
    elif memory:
      stall = cp.memory_stall_s
    event = ("slow",)
    while event == ("slow",):    # a machine turning slow does not stop the save
      spent, event = self._run_for(stall, training=True)
      self.acc["checkpoint"] += spent
      stall -= spent
    if event:
      return event
    if storage:
      self.durable = max([self.durable] + [p for p, at in self.pending if at <= self.t])
      self.pending = [(p, at) for p, at in self.pending if at > self.t]
      self.pending.append((self.done, self.t + cp.persist_s))
      self.first_save = False
    if memory or (storage and self.job.memory_every):
      self.memory = self.done
    return None

  def _snapshot_memory(self) -> None:
    """With a stall-free in-memory tier every M iterations, the latest snapshot when a failure
    strikes is the last multiple of M reached (never older than what is in memory already)."""
    if self.free_memory:
      every = self.job.memory_every
      latest = math.floor(self.done / every + _EPS) * every
      self.memory = max(latest, self.memory if self.memory is not None else 0.0)

  def _settle(self, now: float) -> None:
    """Makes saves whose persist finished by `now` durable; drops the rest (their writers are
    gone with the restart)."""
    for progress, durable_at in self.pending:
      if durable_at <= now + _EPS:
        self.durable = max(self.durable, progress)
    self.pending = []

  # -- recovery -----------------------------------------------------------------------------------
  def _cause(self, event) -> _Cause:
    job = self.job
    if event[0] == "fault":
      f = event[1]
      return _Cause(f.name, False, False, f.detection_s, f.diagnosis_s, f.restart_s)
    if event[0] == "straggler":
      self.slow.pop(event[1])   # found and evicted: no detection or diagnosis left to do
      return _Cause("straggler evicted", False, True, 0.0, 0.0, None)
    kind: FailureKind = event[1]
    return _Cause(kind.name, kind.detected_by == "planned", kind.replace_node,
                  job.detection.seconds(kind.detected_by), job.recovery.self_check_s, None)

  def _take_node(self) -> float:
    """Seconds to get a replacement node: a warm spare if one is left, else a cold one."""
    r = self.job.recovery
    while self.restock and self.restock[0] <= self.t:
      heapq.heappop(self.restock)
      self.spares += 1
    if self.spares > 0:
      self.spares -= 1
      heapq.heappush(self.restock, self.t + r.spare_restock_s)
      return r.spare_swap_s
    return r.cold_replace_s

  def _recover(self, event):
    """From an interruption to training again; returns ('stop',) if the run ends first."""
    r = self.job.recovery
    at = self.done
    cause = self._cause(event)
    if cause.planned:
      event = self._planned_stop()
      if event is None:
        self._resume(cause.name, at)
        return None
      if event[0] == "stop":
        return event
      cause = self._cause(event)
    self._snapshot_memory()
    fault = event[1] if event[0] == "fault" else None
    self._settle(math.inf if fault and fault.saves_written else self.t)
    if fault and fault.newest_corrupt:
      self.durable = max(0.0, self.durable - self.job.checkpoint_every)
    if fault and fault.newest_unwritten:   # at most the save before the newest one it followed
      every = self.job.checkpoint_every
      self.durable = min(self.durable, max(0.0, (math.floor(fault.at_iteration / every) - 1)
                                           * every))
    while True:
      use_memory = self.memory is not None and self.memory >= self.durable
      restart = cause.restart_s
      if restart is None:
        restart = r.restart_s + (self.job.checkpointing.memory_restore_s if use_memory
                                 else r.restore_s)
      phases = [("detection", cause.detection_s), ("diagnosis", cause.diagnosis_s),
                ("replacement", None if cause.replace_node else 0.0), ("restart", restart)]
      for category, seconds in phases:
        seconds = self._take_node() if seconds is None else seconds
        spent, event = self._run_for(seconds, training=False)
        self.acc[category] += spent
        if event:
          break
      else:
        self._resume(cause.name, at, use_memory)
        return None
      if event[0] == "stop":
        return event
      cause = self._cause(event)

  def _planned_stop(self):
    """A planned stop saves synchronously to storage first; returns an event that cut it."""
    cp = self.job.checkpointing
    spent, event = self._run_for(cp.stall_s + cp.persist_s, training=False)
    self.acc["checkpoint"] += spent
    if event:
      return event
    self.pending = []
    self.durable = self.done
    spent, event = self._run_for(self.job.recovery.restart_s + self.job.recovery.restore_s,
                                 training=False)
    self.acc["restart"] += spent
    return event

  def _resume(self, cause: str, at: float, use_memory: bool = False) -> None:
    restored = self.memory if use_memory else self.durable
    if not use_memory:
      self.memory = None if self.memory is None or self.memory > restored else self.memory
    self.recoveries.append(Recovered(cause, at, restored))
    self.done = restored
    self.first_save = True

  # -- the run ------------------------------------------------------------------------------------
  def go(self) -> Outcome:
    spent, event = self._run_for(self.job.startup_s, training=False)
    self.acc["startup"] += spent
    while True:
      if event is None:
        event = self._train()
      if event[0] == "stop":
        break
      event = self._recover(event)
    return Outcome(self.t, dict(self.acc), dict(self.failures), tuple(self.recoveries))


def _next_multiple(x: float, every: int) -> float:
  return (math.floor(x / every + _EPS) + 1) * every


def _is_multiple(x: float, every: int) -> bool:
  return abs(x - round(x / every) * every) < 1e-6


def simulate(job: Job, seed: int = 0, *, hours: float | None = None,
             iterations: float | None = None, faults=()) -> Outcome:
  """Runs `job` for `hours` of wall time or until `iterations` are trained (exactly one)."""
  validate(job)
  if (hours is None) == (iterations is None):
    raise ConfigError("hours/iterations", (hours, iterations), "exactly one of them set")
  if hours is not None and not hours > 0:
    raise ConfigError("hours", hours, "a duration > 0")
  if iterations is not None and not iterations > 0:
    raise ConfigError("iterations", iterations, "a count > 0")
  stop_s = math.inf if hours is None else hours * 3600.0
  stop_iterations = math.inf if iterations is None else float(iterations)
  return _Run(job, seed, faults, stop_s, stop_iterations).go()


@dataclasses.dataclass(frozen=True)
class Spread:
  """The effective training time rate over seeds, and the mean breakdown (fractions of wall)."""
  rates: tuple
  breakdown: dict

  @property
  def mean(self) -> float:
    return statistics.fmean(self.rates)

  @property
  def stderr(self) -> float:
    n = len(self.rates)
    return statistics.stdev(self.rates) / math.sqrt(n) if n > 1 else 0.0

  def quantile(self, q: float) -> float:
    """The q-quantile of the per-seed rates (linear interpolation)."""
    xs = sorted(self.rates)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(job: Job, seeds, **kwargs) -> Spread:
  """Simulates `job` once per seed (same arguments as `simulate`)."""
  outs = [simulate(job, s, **kwargs) for s in seeds]
  total = sum(o.wall_s for o in outs)
  breakdown = {c: sum(o.breakdown[c] for o in outs) / total for c in CATEGORIES}
  return Spread(tuple(o.rate for o in outs), breakdown)
