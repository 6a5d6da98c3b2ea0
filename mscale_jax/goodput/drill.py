"""Replaying our own fault drills: read a results/fault_drill-*.json record, feed the simulator its
schedule of faults and its measured costs, and predict its effective training time rate.

What the simulator is given, all measured in the record: the fault-free iteration time; the
checkpoint cadence, the stall of the first save after a start and the mean stall of the others
(a mean, since the simulator adds them up), the background write time; the start-up time; for
each fault, the step it struck (from its injection spec), its detection latency, its self-check
time and its restart time (detection to the end of the first new step, less the self-check and
that step). A fault the driver injects from outside fires on the step a heartbeat reported,
seconds late: it is placed at the step logged last before its restart (restore step + steps
lost) and, where that restart lost nothing, after the save in flight was written; a
corrupt_checkpoint fault makes the newest written checkpoint unusable. What it predicts: which
checkpoint each restart falls back to (so the replayed steps), how many saves run (replays save
again), and the wall time and its split. Time the record does not itemise as fault costs is,
where the run measured it itself (where_time_went.other_split: evaluations, and its steps' time
over the fed iteration time, which is negative when they ran faster than the reference's;
measured once per step, so it is charged to the replayed runs of a step too), taken from there;
otherwise from the fault-free reference run (evaluations, logging, slower steps, shutdown, and
any start-up it had beyond this run's, e.g. a cold compilation cache): its wall time minus the
simulated fault-free run, per step. When a record lacks the reference's wall
time, a record measured against the same reference run (same reference workdir and iteration
time) lends it; without a reference, records measuring evaluations directly (a 'where_time_went'
key naming them) use those. Faults that slow the job rather than stop it (contend) and faults
found only by a later self-check (a bad slot that no save's replica check met first) have no
restart of their own, nor do refused saves recovered in the process (an io_error since
train.max_refused_saves): they are listed as unplaced.

The reader is tolerant: fields it does not know are ignored, missing optional ones fall back as
documented in `read_case`, a fault it cannot place or cost is listed in `DrillCase.unplaced`
with the reason, never guessed; a record missing what the replay needs raises ConfigError naming
the file and the field.
"""
import dataclasses
import glob
import json
import math
import os
import re
import statistics

from mscale_jax.errors import ConfigError
from mscale_jax.goodput.job import Checkpointing, Detection, Job, Recovery
from mscale_jax.goodput.simulate import ScheduledFault, simulate

DRILL_KEYS = ("training_s", "startup_s", "detection_s", "restart_s", "replayed_steps_s", "other_s")


@dataclasses.dataclass(frozen=True)
class DrillCase:
  """What one drill record says, in the simulator's terms, and what it measured."""
  path: str
  steps: int
  iteration_s: float
  checkpoint_every: int
  stall_s: float
  first_stall_s: float | None
  persist_s: float
  startup_s: float
  startup_recorded: bool        # False: startup_s is 0 and the start-up sits in the residual
  faults: tuple                 # ScheduledFault, in the record's order
  recorded_lost: tuple          # steps lost per placed fault, as recorded (None if absent)
  unplaced: tuple               # (fault description, why it was not simulated)
  measured_rate: float
  measured_wall_s: float
  measured_breakdown: dict      # the record's where_time_went (seconds), if any
  reference_wall_s: float | None
  reference_from: str           # where reference_wall_s came from
  evaluation_s: float | None    # evaluations measured in the faulty run, if recorded
  own_steps_slower_s: float | None = None  # its steps' time over iteration_s, each step once
  notes: tuple = ()
  specs: tuple = ()             # the injection spec of each placed fault
  measured_other_split: dict = dataclasses.field(default_factory=dict)  # other_s itemised
  reference_startup_s: float | None = None   # the reference run's own start-up, if recorded
  first_new_steps_s: float | None = None  # restarts' first new steps (in restart_s), if recorded

  @property
  def own_residual(self) -> bool:
    """Whether the faulty run measured its own non-fault time (evaluations and step times)."""
    return self.evaluation_s is not None and self.own_steps_slower_s is not None


def _number(*values):
  """The first value that is a finite number, else None."""
  for v in values:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
      return float(v)
  return None


def _phase(fault: dict, *names):
  """A per-fault phase time under any of `names`, top level or in a 'phases'/'phase_s' dict."""
  phases = fault.get("phases") or fault.get("phase_s")
  phases = phases if isinstance(phases, dict) else {}
  return _number(*[fault.get(n) for n in names], *[phases.get(n) for n in names])


def _checkpoint_every(record: dict, figures: dict, saves: list) -> tuple:
  """(iterations between saves, how it was found): the record's own field, the command's flag,
  or the spacing of the recorded saves."""
  every = _number(figures.get("checkpoint_every"))
  if every:
    return int(every), "figures.checkpoint_every"
  match = re.search(r"--checkpoint_every[= ](\d+)", str(record.get("command") or ""))
  if match:
    return int(match.group(1)), "command flag"
  steps = sorted({s["step"] for s in saves if isinstance(s.get("step"), int)})
  gaps = [b - a for a, b in zip(steps, steps[1:])]
  if gaps:
    return math.gcd(*gaps), "spacing of the recorded saves"
  return None, "not found"


def _placement(fault: dict) -> tuple:
  """(iterations completed when the fault struck, during a save?, how it was placed) or
  (None, False, why not)."""
  spec = str(fault.get("injected") or fault.get("spec") or "")
  during_save = "at=save" in spec
  # Where it actually struck: a driver-injected fault once a rank reported step N done, a
  # worker's before step N runs (or during step N's save).
  fired = _number(fault.get("injected_step"))
  restore, lost = _number(fault.get("restore_step")), _number(fault.get("steps_lost"))
  if fault.get("kind") == "replica_divergence" and restore is not None and lost is not None:
    # Silent corruption is found at the next save, which the replica check refuses: the fault
    # costs that save, and the restart restores the checkpoint before it.
    return int(restore + lost), True, "the save the replica check refused (as recorded)"
  if (fault.get("by") == "driver" or spec.startswith("nan")) and restore is not None \
      and lost is not None:
    # The driver fires on the step a heartbeat reported (every few seconds), so the fault
    # strikes at or after it; a non-finite loss is found once its step has run, and whether the
    # driver heard of that step first is a race: the last step the driver saw before the
    # restart says where training stood.
    return int(restore + lost), during_save, "its restore step + steps lost (as recorded)"
  if fired is not None:
    done = fault.get("by") == "driver" or during_save
    return int(fired) - (0 if done else 1), during_save, "the step it was injected at"
  match = re.search(r"(?:^|:)step=(\d+)", spec)
  if match:
    step = int(match.group(1))
    return (step if during_save else step - 1), during_save, "its injection step"
  step = _number(fault.get("step"))
  if step is not None:
    return step - 1, during_save, "its recorded step"
  if restore is not None and lost is not None:
    return restore + lost, during_save, "its recorded restore step + steps lost"
  return None, False, "no injection step, step or restore point recorded"


def _fault(fault: dict, iteration_s: float, every: int):
  """A ScheduledFault from one record fault (`every`: the checkpoint cadence), or (None, why)."""
  at, during_save, how = _placement(fault)
  if at is None:
    return None, how
  detection = _phase(fault, "detection_latency_s", "detection_s", "detection")
  diagnosis = _number((fault.get("diagnosis") or {}).get("self_check_s")
                      if isinstance(fault.get("diagnosis"), dict) else None,
                      _phase(fault, "self_check_s", "diagnosis_s", "self_check", "diagnosis"))
  restart = _phase(fault, "restart_s")
  if restart is not None:
    restart -= (diagnosis or 0.0) + iteration_s   # the sim runs the first new step itself
  else:
    parts = [_phase(fault, n) for n in ("replacement", "process_start", "restore", "compile",
                                        "restart")]
    restart = sum(p for p in parts if p is not None) if any(p is not None for p in parts) \
        else None
  if detection is None or restart is None:
    if fault.get("found_while_recovering_from"):
      return None, (f"found by the self-check of {fault['found_while_recovering_from']}'s "
                    "restart: its cost is in that restart")
    if _phase(fault, "slowdown_s") is not None:
      return None, "slowed the job, no restart: its slowdown is in the run's step times"
    if fault.get("in_process"):
      return None, ("recovered in the process (a refused save dropped, training went on): no "
                    "restart to simulate; its cost is in the run's own time")
    return None, "no detection or restart time recorded (no restart to simulate)"
  name = str(fault.get("kind") or spec_kind(fault))
  # Nothing lost though it struck on a save step: that save was written before it struck (a
  # race the sim cannot call: a worker killed right after a save began lost it in earlier
  # drills, and not in the side-by-side drill of 2026-11-26 11:22, whose slower steps gave the
  # write time to finish).
  written = _number(fault.get("steps_lost")) == 0
  # Restored from the checkpoint before the newest one that preceded it, though that one was
  # neither corrupted nor refused: its background write had not committed when the fault
  # struck (a kill 2 steps after a save, on a loaded host, in the drill of 2026-11-27 03:57).
  restore, corrupt = _number(fault.get("restore_step")), spec_kind(fault) == "corrupt_checkpoint"
  unwritten = (restore is not None and not during_save and not corrupt
               and fault.get("kind") != "replica_divergence"
               and restore == (int(at) // every - 1) * every)
  return ScheduledFault(at, name, detection, diagnosis or 0.0, max(0.0, restart), during_save,
                        saves_written=written, newest_corrupt=corrupt,
                        newest_unwritten=unwritten), how


def spec_kind(fault: dict) -> str:
  """The fault's kind from its injection spec ('kill:rank=1:step=37' -> 'kill')."""
  return str(fault.get("injected") or "fault").split(":")[0]


def _load(path: str) -> dict:
  """The record's JSON object, or ConfigError naming the file."""
  try:
    with open(path) as f:
      record = json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(path, f"line {e.lineno}", f"a JSON drill record ({e.msg})") from e
  if not isinstance(record, dict):
    raise ConfigError(path, type(record).__name__, "a JSON object (a drill record)")
  return record


def _required(path: str, figures: dict, field: str, why: str) -> float:
  """figures[field] as a finite number, or ConfigError naming the file and the field."""
  value = _number(figures.get(field))
  if value is None:
    raise ConfigError(f"{path}: figures.{field}", figures.get(field),
                      f"a finite number ({why}); not a drill record this reader can replay")
  return value


def _dicts(value) -> list:
  """The dict entries of a list field (anything else: none)."""
  return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def _split_from_faults(faults, lost, steps, iteration_s, startup, wall) -> dict:
  """fault_drill's where_time_went from a record's per-fault times, for records that predate
  it: training and replay at the fed iteration time, detection, restart (self-check and the
  first new step included), start-up if recorded; other_s the rest of the wall."""
  split = {"training_s": steps * iteration_s,
           "detection_s": sum(f.detection_s for f in faults),
           "restart_s": sum(f.diagnosis_s + f.restart_s + iteration_s for f in faults),
           "replayed_steps_s": sum(x or 0 for x in lost) * iteration_s}
  if startup is not None:
    split["startup_s"] = startup
  split["other_s"] = wall - sum(split.values())
  return split


def read_case(path: str, records: dict | None = None) -> DrillCase:
  """Reads one drill record. `records` ({path: record}) lets a record without the reference
  run's wall time borrow it from another measured against the same reference run.

  Needed (ConfigError naming the file and field otherwise): figures.iteration_s, steps,
  wall_s, and the checkpoint cadence (figures.checkpoint_every, the command's flag or the
  spacing of the recorded saves). Optional: effective_training_time_rate (else steps x
  iteration_s / wall_s), checkpoint_saves (no stalls: 0), where_time_went (start-up, the
  measured split and the run's own residual), reference_wall_s, per-fault phase times."""
  record = _load(path)
  figures = record.get("figures", record)
  if not isinstance(figures, dict):
    raise ConfigError(f"{path}: figures", type(figures).__name__, "an object of figures")
  iteration_s = _required(path, figures, "iteration_s", "the fault-free iteration time")
  steps = _required(path, figures, "steps", "the run's length in iterations")
  wall = _required(path, figures, "wall_s", "the measured wall time to compare with")
  saves = _dicts(figures.get("checkpoint_saves"))
  every, every_from = _checkpoint_every(record, figures, saves)
  if every is None:
    raise ConfigError(f"{path}: figures.checkpoint_every", figures.get("checkpoint_every"),
                      "the checkpoint cadence, recorded there, as the command's "
                      "--checkpoint_every or by the spacing of figures.checkpoint_saves")
  stalls = [float(s["stall_s"]) for s in saves if _number(s.get("stall_s")) is not None]
  writes = [float(s["write_s"]) for s in saves if _number(s.get("write_s")) is not None]
  notes = [f"checkpoint every {every} steps ({every_from})"]
  # The record lists the saves since the last start: the first one's stall is a start's.
  first_stall = stalls[0] if len(stalls) > 1 else None
  stall = statistics.fmean(stalls[1:] if len(stalls) > 1 else stalls) if stalls else 0.0
  if not stalls:
    notes.append("no checkpoint stalls recorded: taken as 0")
  where_raw = figures.get("where_time_went")
  where_raw = where_raw if isinstance(where_raw, dict) else {}
  where = {k: float(v) for k, v in where_raw.items() if _number(v) is not None}
  startup = _number(where.get("startup_s"), figures.get("startup_s"))
  if startup is None:
    notes.append("start-up time not recorded: left in the fault-free residual")
  faults, lost, unplaced, specs = [], [], [], []
  for f in _dicts(figures.get("faults")):
    fault, how = _fault(f, iteration_s, every)
    label = str(f.get("injected") or f.get("kind"))
    if fault is None:
      unplaced.append((label, how))
      continue
    faults.append(fault)
    specs.append(label)
    lost.append(_number(f.get("steps_lost")))
  if "training_s" not in where and faults:
    where = {**where, **_split_from_faults(faults, lost, steps, iteration_s, startup, wall)}
    notes.append("measured split worked out from the per-fault times as fault_drill does (the "
                 "record has no where_time_went)" + ("" if startup is not None else
                                                     "; its other_s holds the start-up"))
  reference, source = _number(figures.get("reference_wall_s")), "this record"
  if reference is None and records:
    reference, source = _borrow_reference(path, record, records)
  split = where_raw.get("other_split") if isinstance(where_raw.get("other_split"), dict) else {}
  of_which = split.get("of_which") if isinstance(split.get("of_which"), dict) else {}
  split = {k: float(v) for k, v in split.items() if _number(v) is not None}
  evaluation = _number(split.get("evaluation_s"),
                       *[v for k, v in where.items() if "eval" in k.lower()])
  ref_where = figures.get("reference_where_time_went")
  ref_where = ref_where if isinstance(ref_where, dict) else {}
  rate = _number(figures.get("effective_training_time_rate"))
  if rate is None:
    rate = steps * iteration_s / wall
    notes.append("effective training time rate not recorded: steps x iteration_s / wall_s")
  return DrillCase(
      path=path, steps=int(steps), iteration_s=iteration_s, checkpoint_every=every,
      stall_s=stall, first_stall_s=first_stall,
      persist_s=statistics.fmean(writes) if writes else 0.0, startup_s=startup or 0.0,
      startup_recorded=startup is not None, faults=tuple(faults), recorded_lost=tuple(lost), unplaced=tuple(unplaced),
      measured_rate=rate, measured_wall_s=wall, measured_breakdown=where,
      reference_wall_s=reference, reference_from=source, evaluation_s=evaluation,
      own_steps_slower_s=split.get("steps_slower_than_steady_s"),
      notes=tuple(notes), specs=tuple(specs), measured_other_split=split,
      reference_startup_s=_number(ref_where.get("startup_s"), figures.get("reference_startup_s")),
      first_new_steps_s=_number(of_which.get("first_new_steps_in_restart_s")))


def _borrow_reference(path: str, record: dict, records: dict) -> tuple:
  """(reference wall time, its record) from a record of the same reference run, or (None, why)."""
  figures = record.get("figures") if isinstance(record.get("figures"), dict) else {}
  for other_path, other in sorted(records.items()):
    of = other.get("figures") if isinstance(other.get("figures"), dict) else {}
    if other_path != path and other.get("reference_workdir") == record.get("reference_workdir") \
        and of.get("iteration_s") == figures.get("iteration_s") \
        and _number(of.get("reference_wall_s")) is not None:
      return float(of["reference_wall_s"]), os.path.basename(other_path)
  return None, "none recorded"


def read_all(pattern: str) -> list:
  """Every drill record matching `pattern` that this reader understands, as DrillCases, plus
  (path, error) for those it does not: returns (cases, errors)."""
  records, errors = {}, []
  for p in sorted(glob.glob(pattern)):
    try:
      records[p] = _load(p)
    except (OSError, ValueError) as e:
      errors.append((p, str(e)))
  cases = []
  for p in records:
    try:
      cases.append(read_case(p, records))
    except (ValueError, KeyError, TypeError) as e:
      errors.append((p, str(e)))
  return cases, sorted(errors)


def missing_inputs(case: DrillCase) -> tuple:
  """What the replay of `case` had to do without, in words: the measurements whose absence puts
  a run's non-fault time on an estimate (a reference run's, or none)."""
  missing = []
  if not case.own_residual:
    missing.append("its own evaluations and step times (where_time_went.other_split)")
  if not case.measured_breakdown:
    missing.append("its measured split of wall time (where_time_went)")
  if not case.startup_recorded:
    missing.append("its start-up time")
  if not case.own_residual and case.reference_wall_s is not None and case.startup_s \
      and case.reference_startup_s is None:
    missing.append("the reference run's start-up time (the start-up it had beyond this run's, "
                   "e.g. a cold compilation cache, lands in the residual)")
  if case.reference_wall_s is None:
    missing.append("a fault-free reference run")
  elif case.reference_from != "this record":
    missing.append(f"a reference run of its own (lent by {case.reference_from})")
  return tuple(missing)


def job_for(case: DrillCase, overhead_per_iteration_s: float = 0.0) -> Job:
  """The drill's job: no random failures, its measured checkpoint and start-up costs."""
  return Job(nodes=1, iteration_s=case.iteration_s, kinds=(),
             detection=Detection(0.0, 0.0),
             recovery=Recovery(self_check_s=0.0, restart_s=0.0, restore_s=0.0),
             checkpointing=Checkpointing(every_s=case.checkpoint_every * case.iteration_s,
                                         stall_s=case.stall_s, persist_s=case.persist_s,
                                         first_stall_s=case.first_stall_s),
             startup_s=case.startup_s, overhead_per_iteration_s=overhead_per_iteration_s)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """The simulator's replay of one drill next to what the drill measured."""
  case: DrillCase
  rate_events_only: float       # fed the itemised costs alone
  rate: float                   # plus the fault-free residual (the prediction)
  residual_per_step_s: float | None
  residual_from: str
  breakdown: dict               # predicted, in the drill's categories (DRILL_KEYS)
  lost: tuple                   # predicted steps lost per placed fault
  other_split: dict = dataclasses.field(default_factory=dict)  # predicted other_s: stalls, fed
  residual_needed_s: float = 0.0    # the residual that would have matched the measured wall
  rate_from_reference: float | None = None   # with the reference run's residual, if it has one

  @property
  def difference_points(self) -> float:
    return 100.0 * (self.rate - self.case.measured_rate)


def _drill_breakdown(out, iteration_s: float) -> dict:
  """The simulated run split as fault_drill.where_time_went splits a measured one: restarts run
  from detection to the end of the first new step, so that step is in both restart and
  training/replay, and 'other' is the rest (checkpoint stalls, evaluations, ...)."""
  b = out.breakdown
  restarts = b["diagnosis"] + b["restart"] + len(out.recoveries) * iteration_s
  split = {"training_s": b["training"], "startup_s": b["startup"],
           "detection_s": b["detection"], "restart_s": restarts,
           "replayed_steps_s": b["replay"]}
  split["other_s"] = out.wall_s - sum(split.values())
  return split


def _reference_residual(case: DrillCase) -> float | None:
  """Per step: the fault-free reference run's wall time less its simulation (evaluations,
  logging, slower steps, shutdown), or None. The simulation starts up as this run did; where the
  reference's own start-up is recorded, the difference (e.g. a cold compilation cache against a
  warm one) is taken out, else it stays in the residual."""
  if case.reference_wall_s is None:
    return None
  fault_free = simulate(job_for(case), iterations=case.steps).wall_s
  extra_startup = 0.0 if case.reference_startup_s is None \
      else case.reference_startup_s - case.startup_s
  return max(0.0, case.reference_wall_s - extra_startup - fault_free) / case.steps


def _steady_excess_per_step(case: DrillCase) -> float:
  """The run's step time over the fed iteration time, per step (each step timed once, its last
  run). Where the record times the restarts' first new steps, their excess is left out: their
  whole time is in the fed restart time already."""
  excess, steps = case.own_steps_slower_s, case.steps
  if case.first_new_steps_s is not None and case.faults:
    excess -= case.first_new_steps_s - len(case.faults) * case.iteration_s
    steps -= len(case.faults)
  return excess / steps


def _stalls_from_timeline(case: DrillCase) -> DrillCase:
  """`case` fed the mean stall of every save where the record measured their total (rank 0's
  timeline, every attempt: other_split.checkpoint_stall_s): the saves it lists are the last
  start's only, a biased sample when the machine's load changed during the run. The number of
  saves is the simulated one (replays save again)."""
  total = case.measured_other_split.get("checkpoint_stall_s")
  if total is None:
    return case
  unit = dataclasses.replace(case, stall_s=1.0, first_stall_s=None)
  saves = simulate(job_for(unit), iterations=case.steps, faults=case.faults).breakdown[
      "checkpoint"]
  return dataclasses.replace(unit, stall_s=total / saves) if saves > 0 else case


def predict(case: DrillCase) -> Prediction:
  """Replays `case`: events only, then with a residual per iteration run, in order of
  preference: the run's own (its evaluations spread over the iterations it ran, its steps'
  time over the fed iteration time per step, replays included: `_steady_excess_per_step`); the
  fault-free reference run's; the evaluations it measured."""
  case = _stalls_from_timeline(case)
  events = simulate(job_for(case), iterations=case.steps, faults=case.faults)
  ran = case.steps + sum(r.lost_iterations for r in events.recoveries)
  reference = _reference_residual(case)
  residual, source = None, "none: the record has no fault-free reference and no evaluations"
  if case.own_residual:    # this run's own, not a reference run's on another load
    residual = case.evaluation_s / ran + _steady_excess_per_step(case)
    source = "this run's evaluations and step times"
  elif reference is not None:
    residual, source = reference, f"fault-free reference run ({case.reference_from})"
  elif case.evaluation_s is not None:
    residual, source = case.evaluation_s / ran, "evaluations measured in this run"

  def run(per_iteration_s):
    return simulate(job_for(case, per_iteration_s), iterations=case.steps, faults=case.faults)

  out = events if residual is None else run(residual)
  return Prediction(
      case, events.rate, out.rate, residual, source, _drill_breakdown(out, case.iteration_s),
      tuple(r.lost_iterations for r in out.recoveries),
      other_split={"checkpoint_stall_s": out.breakdown["checkpoint"],
                   "residual_s": out.breakdown["overhead"]},
      residual_needed_s=case.measured_wall_s - events.wall_s,
      rate_from_reference=(None if reference is None else
                           out.rate if residual == reference else run(reference).rate))
