"""The fault drill's accounting (experiments/fault_drill.py): per fault, what detected it and
the seconds of each phase; per restart, where its seconds went; and the fault run's wall time
split into parts, each measured on its own.

Inputs are what a launcher run leaves in its workdir: metrics.jsonl (every step logged),
resilience/report.json (the driver's failures and attempts), resilience/faults/ (the fired
markers), timeline/rank0.jsonl (rank 0's spans, every attempt) and logs/ (the workers' output).
"""
import json
import os
import re

def read_json(path):
  with open(path) as f:
    return json.load(f)


def metrics(workdir: str) -> dict[int, dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f)}


def compare(reference: dict, run: dict) -> dict:
  """Both runs log every step: is each step's loss the same? `equal_through_step`: the last
  step up to which every loss is bitwise equal (a rollback departs from the reference there)."""
  diffs = [abs(run[s] - reference[s]) for s in sorted(reference) if s in run]
  same_steps = sorted(run) == sorted(reference)
  first_diff = next((s for s in sorted(reference) if s in run and run[s] != reference[s]), None)
  return {"steps_compared": len(diffs), "same_steps": same_steps,
          "bitwise_equal": same_steps and all(d == 0 for d in diffs),
          "max_abs_diff": max(diffs) if diffs else None,
          "equal_through_step": (first_diff - 1) if first_diff is not None else max(run),
          "final_loss": {"fault_run": run[max(run)], "fault_free_run": reference[max(reference)]}}


def reference_gain(reference: dict, run: dict, gap_s: float = 3.0) -> dict:
  """Side by side, the reference runs faster while the fault run is down (detecting, restarting:
  its CPUs are freer), which flatters the reference. Estimated from the step logs: the
  reference's mean step time during the fault run's gaps (more than `gap_s` between two of its
  logged steps) against the rest, and the seconds the reference saved that way."""
  times = sorted(r["time"] for r in run.values())
  gaps = [(a, b) for a, b in zip(times, times[1:]) if b - a > gap_s]
  down = [r["step_time_s"] for r in reference.values()
          if any(a < r["time"] <= b for a, b in gaps)]
  up = [r["step_time_s"] for r in reference.values()
        if not any(a < r["time"] <= b for a, b in gaps)]
  if not down or not up:
    return {"gaps": len(gaps), "reference_saved_s": 0.0}
  mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
  return {"gaps": len(gaps), "gaps_s": sum(b - a for a, b in gaps),
          "reference_steps_in_gaps": len(down), "reference_step_s_in_gaps": mean(down),
          "reference_step_s_otherwise": mean(up),
          "reference_saved_s": len(down) * (mean(up) - mean(down))}


def startup_s(report: dict, run: dict) -> float:
  """Launch to the start of the first step: process start, JAX init, restore or init, compile."""
  start = next(a["started"] for a in report["attempts"] if a.get("started"))
  first = min(run.values(), key=lambda r: r["step"])
  return first["time"] - start - first["step_time_s"]


def step_ends(run_dir: str, run: dict) -> dict[int, list[float]]:
  """Each step's end, every run of it: rank 0's timeline (the end of the step's last loop span
  in each process that ran it), or the step's log time in `run` (its last run) without one.
  metrics.jsonl cannot tell: a restore truncates it to the restored step."""
  from mscale_jax.observability import timeline
  path = os.path.join(run_dir, "timeline", "rank0.jsonl")
  if not os.path.exists(path):
    return {step: [r["time"]] for step, r in run.items()}
  ends = {}
  for s in timeline.read_rank_file(path)[1]:
    if s["track"] == "loop" and s["step"] is not None:
      key = (s["step"], s["segment"])
      ends[key] = max(ends.get(key, s["end"]), s["end"])
  out = {}
  for (step, _), end in ends.items():
    out.setdefault(step, []).append(end)
  return out


def _restart_s(failure: dict, ends: dict[int, list[float]]) -> float | None:
  """Detection to the end of the first step after the restore: its first run after the
  detection, as the next restart may go back to the same checkpoint and run that step again
  (the drill's bad_slot, then a kill at step 111, both from step 100).

  The driver's own figure comes from heartbeats and so runs up to one heartbeat late.
  """
  after = [t for t in ends.get((failure.get("restore_step") or 0) + 1, ())
           if t > failure["detected_at"]]
  return min(after) - failure["detected_at"] if after else None


def _marker(run_dir: str, spec: str) -> dict | None:
  """The fired marker of fault `spec` (worker- or driver-injected), if it fired."""
  directory = os.path.join(run_dir, "resilience", "faults")
  for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
    marker = read_json(os.path.join(directory, name))
    if marker["fault"] == spec:
      return marker
  return None


def _slowdown(run_dir: str, spec: str, run: dict, iteration_s: float, report: dict) -> dict:
  """A fault that slows rather than stops (contend): when it began, the extra step time while
  it lasted (from each step's own time), and when the straggler detector flagged it."""
  from mscale_jax.resilience.faults import parse_fault
  marker, fault = _marker(run_dir, spec), parse_fault(spec)
  if marker is None:
    return {"fired": False}
  end = marker["time"] + fault.seconds
  window = [r for r in run.values() if marker["time"] <= r["time"] <= end + iteration_s]
  since = [f for f in straggler_flags(run_dir, report)
           if marker["time"] <= (f.get("time") or 0) <= end + 60]
  victim = [f for f in since if f.get("rank") == fault.rank]   # the first flag of the victim
  return {"fired": True, "core": marker.get("core"), "steps_in_window": len(window),
          "slowdown_s": sum(max(r["step_time_s"] - iteration_s, 0.0) for r in window),
          "flagged_rank": victim[0]["rank"] if victim else None,
          "flagged_metric": victim[0].get("metric") if victim else None,
          "other_ranks_flagged": sorted({f.get("rank") for f in since} - {fault.rank}),
          "detection_latency_s": victim[0]["time"] - marker["time"] if victim else None}


def straggler_flags(run_dir: str, report: dict) -> list[dict]:
  """Every straggler flag of the job: WORKDIR/resilience/stragglers.jsonl (every driver's, also
  one killed by kill_driver: the report holds only the last driver's), else the report's."""
  path = os.path.join(run_dir, "resilience", "stragglers.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      return [flag for flag in map(json.loads, filter(str.strip, f)) if isinstance(flag, dict)]
  return [f for f in report["observability"].get("straggler_flags") or [] if isinstance(f, dict)]


def per_fault_rows(faults: list[str], report: dict, run: dict, run_dir: str,
                   iteration_s: float) -> list[dict]:
  """One row per injected fault: what detected it, how, and the time of each phase."""
  from mscale_jax.resilience.faults import parse_fault
  warm = {a["attempt"]: a.get("warm_processes") for a in report["attempts"]}
  failures = {f["injected"]: f for f in report["failures"] if f.get("injected")}
  rows, ends = [], step_ends(run_dir, run)
  for spec in (parse_fault(f).spec for f in faults):
    f = failures.get(spec)
    if spec.startswith("contend"):
      slow = _slowdown(run_dir, spec, run, iteration_s, report)
      rows.append({"injected": spec, "kind": "straggler (warn)" if slow.get("flagged_rank")
                   is not None else "not flagged", "detected": slow.get("flagged_rank") is not None,
                   "recovered": "nothing to recover: the job went on slower while it lasted",
                   "detection_latency_s": slow.get("detection_latency_s"), **slow,
                   "phases": {"slowdown_s": slow.get("slowdown_s")}})
      continue
    if spec.startswith("bad_slot") and f is None:   # found by the next restart's self-check
      # (a save's replica check finds it first, as its own failure, when it reaches one)
      owner = next((x for x in report["failures"] if (x.get("diagnosis") or {}).get("excluded")),
                   None)
      rows.append({"injected": spec, "kind": "self_check_failed",
                   "detected": owner is not None, "recovered": "its slot excluded by the "
                   "self-check of the restart it fell into; a spare slot took its place",
                   "excluded": owner and owner["diagnosis"]["excluded"],
                   "found_while_recovering_from": owner and owner["injected"], "phases": {}})
      continue
    if f is None and spec.startswith("nan") and (found := rollback(run_dir, spec)):
      rows.append(rollback_row(spec, found, run, iteration_s))
      continue
    refused = next((r for r in report.get("recovered_in_process") or ()
                    if r.get("injected") == spec), None)
    if f is None and refused is not None:
      rows.append(refused_save_row(spec, refused, _marker(run_dir, spec) or {}))
      continue
    if f is None:
      rows.append({"injected": spec, "kind": None, "detected": False, "phases": {}})
      continue
    diagnosis = (f.get("diagnosis") or {}).get("seconds")
    restart = _restart_s(f, ends)
    marker = _marker(run_dir, spec) or {}
    rows.append({
        "injected": spec, "injected_step": marker.get("step"), "by": marker.get("by", "worker"),
        "kind": f["kind"], "rank": f["rank"], "slot": f.get("slot"),
        "detected": True, "recovered": "job restart (the driver restarted the group from the"
        " latest checkpoint)" if f["kind"] != "driver_lost" else "the same launch command run "
        "again resumed the job from its workdir",
        "detail": f["detail"], "detection_latency_s": f["detection_latency_s"],
        "diagnosis": {"self_check_s": diagnosis,
                      "excluded": (f.get("diagnosis") or {}).get("excluded")},
        "restart_s": restart, "warm_processes": warm.get(f["attempt"] + 1),
        "restore_step": f.get("restore_step"), "steps_lost": f.get("steps_lost"),
        "phases": {"detection_s": f["detection_latency_s"], "diagnosis_s": diagnosis,
                   "restart_s": restart - (diagnosis or 0.0) if restart is not None else None,
                   "replay_s": (f.get("steps_lost") or 0) * iteration_s}})
  return rows


def rollback(run_dir: str, spec: str) -> dict | None:
  """An in-process rollback after fault `spec` (a NaN; train.on_nonfinite=rollback): the fired
  marker, rank 0's restore span that followed it and the step it went back to (its log line);
  None if the fault did not fire or no rollback followed."""
  marker = _marker(run_dir, spec)
  path = os.path.join(run_dir, "timeline", "rank0.jsonl")
  if marker is None or not os.path.exists(path):
    return None
  from mscale_jax.observability import timeline
  _, spans = timeline.read_rank_file(path)
  restore = next((s for s in spans if s["name"] == "restore" and s["start"] >= marker["time"]),
                 None)
  back = None
  logs = os.path.join(run_dir, "logs")
  for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
    if name.endswith("rank0.log"):
      with open(os.path.join(logs, name), errors="replace") as f:
        found = re.findall(r"rolled back to step (\d+)", f.read())
      back = int(found[-1]) if found else back
  if restore is None or back is None:
    return None
  return {"marker": marker, "restore": restore, "restore_step": back}


def rollback_row(spec: str, found: dict, run: dict, iteration_s: float) -> dict:
  """The row of a fault recovered in-process by a rollback: detection (injection to the
  restore), restart (the restore to the end of the first new step), replay (the steps from the
  checkpoint to the one before the NaN step; the NaN step itself is inside detection)."""
  marker, restore, back = found["marker"], found["restore"], found["restore_step"]
  detection = restore["start"] - marker["time"]
  first = run.get(back + 1)
  restart = first["time"] - restore["start"] if first else None
  lost = max(marker["step"] - 1 - back, 0)
  return {"injected": spec, "injected_step": marker["step"], "by": "worker",
          "kind": "nonfinite", "recovered": "in-process rollback (train.on_nonfinite=rollback):"
          " no process died, no restart", "rank": None, "detected": True,
          "detection_latency_s": detection, "restore_s": restore["end"] - restore["start"],
          "restart_s": restart, "restore_step": back, "steps_lost": lost, "in_process": True,
          "restore_span": restore,
          "phases": {"detection_s": detection, "restart_s": restart,
                     "replay_s": lost * iteration_s}}


def refused_save_row(spec: str, refused: dict, marker: dict) -> dict:
  """The row of a fault recovered in-process by dropping a save (an io_error; the driver's
  `recovered_in_process` record): no restart and no replay; the refused save's stall is in the
  checkpoint stalls, and detection (the folder turning read-only to the refusal reported)
  is mostly the wait for the next save, while training went on."""
  return {"injected": spec, "injected_step": marker.get("step"), "by": marker.get("by", "driver"),
          "kind": refused["kind"], "rank": None, "ranks": refused.get("ranks"), "detected": True,
          "recovered": f"in-process: the refused save (step {refused['step']}) was dropped, "
          "training went on and the next save tried again; no process died, no restart",
          "detail": refused.get("detail"), "detection_latency_s": refused["detection_latency_s"],
          "refused_step": refused["step"], "restart_s": None, "steps_lost": 0,
          "in_process": True, "phases": {}}


def train_step_served(run_dir: str) -> str:
  """How rank 0's newest process got its train step: 'compiled', 'loaded' or 'loaded before
  lowering' (compile_cache.load_or_lower), as its log says; 'unknown' if it says nothing."""
  logs = os.path.join(run_dir, "logs")
  newest = max((f for f in os.listdir(logs) if f.endswith("rank0.log")),
               key=lambda f: os.path.getmtime(os.path.join(logs, f)))
  with open(os.path.join(logs, newest)) as f:
    said = [line for line in f if " the train step in " in line]
  return said[-1].split(" the train step in ")[0].split("] ")[-1].strip() if said else "unknown"


def restart_phases(report: dict, run_dir: str) -> list[dict]:
  """Per restart, where its seconds went (rank 0): the driver's teardown (detection to the new
  group's start), process start to the worker's timeline (Python and JAX start-up or a warm
  standby's hand-over, jax.distributed, the self-check, building the trainer), the restore (with
  the first batch), the compilation or compile-cache load (the step's tracing and lowering
  unless the cache's pre-key found it before them; in a resuming process the load runs beside
  the restore and this is only the wait for it after the restore), and the first step.
  `process_start_s` leaves the self-check (`self_check_s`) out; a restart after one whose
  self-check excluded a slot has no failure of its own (`self_check_s` None: its check is
  inside `process_start_s`).
  `start_to_first_step_s`: from the group's start to the end of its first step, all of it."""
  from mscale_jax.observability import timeline
  path = os.path.join(run_dir, "timeline", "rank0.jsonl")
  metas, spans = timeline.read_rank_file(path) if os.path.exists(path) else ([], [])
  detected = {f["attempt"] + 1: f for f in report["failures"]}
  attempts = {a["attempt"]: a for a in report["attempts"]}
  out = []
  for a in report["attempts"]:
    failure = detected.get(a["attempt"])
    before = attempts.get(a["attempt"] - 1) or {}
    if failure is None and before.get("failure") and before.get("ended"):
      # The attempt before ended without a failure record of its own (its self-check excluded
      # a slot): this restart counts from its end; its self-check is in process_start_s.
      failure = {"kind": before["failure"], "detected_at": before["ended"]}
    segment = next((i + 1 for i, m in enumerate(metas) if m.get("attempt") == a["attempt"]),
                   None)
    if failure is None or segment is None or not a.get("started"):
      continue
    mine = [s for s in spans if s["segment"] == segment]
    check = (failure.get("diagnosis") or {}).get("seconds")
    first = lambda name: next((s for s in mine if s["name"] == name), None)  # noqa: E731
    restore, compiled = first("restore"), first("compile")
    step = min((s["step"] for s in mine if s["step"] is not None and s["track"] == "loop"),
               default=None)
    step_end = max((s["end"] for s in mine if s["step"] == step and s["track"] == "loop"),
                   default=None)
    out.append({
        "attempt": a["attempt"], "after": failure.get("injected") or failure["kind"],
        "warm_processes": a.get("warm_processes"),
        "teardown_s": a["started"] - failure["detected_at"],
        "process_start_s": metas[segment - 1]["wall0"] - a["started"] - (check or 0.0),
        "self_check_s": check,
        "restore_s": restore and restore["end"] - restore["start"],
        "compile_or_cache_load_s": compiled and compiled["end"] - compiled["start"],
        "first_step_s": step_end - compiled["end"] if compiled and step_end else None,
        "start_to_first_step_s": step_end - a["started"] if step_end else None})
  return out


def timeline_totals(run_dir: str, first_steps=(), rollbacks=()) -> dict:
  """Rank 0's measured seconds, every attempt: checkpoint stalls, evaluations, the training
  steps (each step once, its last run; without its evaluation and checkpoint stall) and, of
  those, the steps in `first_steps` (each restart's first new step).

  `rollbacks`: (restore span, step gone back to) of each in-process rollback; the runs it
  discarded (steps after that step, same process, ended before the restore) are left out of the
  training steps and summed as `rolled_back_steps_s` (the replay and detection hold them).
  """
  from mscale_jax.observability import timeline
  path = os.path.join(run_dir, "timeline", "rank0.jsonl")
  if not os.path.exists(path):
    return {}
  _, spans = timeline.read_rank_file(path)
  discarded = lambda s: any(  # noqa: E731
      s["segment"] == r["segment"] and s["track"] == "loop" and (s["step"] or 0) > back
      and s["end"] <= r["start"] for r, back in rollbacks)
  kept = [s for s in spans if not discarded(s)]
  total = lambda name: sum(s["end"] - s["start"] for s in spans if s["name"] == name)  # noqa
  steps = {step: sum(v for k, v in phases.items() if k not in ("eval", "checkpoint_stall"))
           for step, phases in timeline.per_iteration(kept).items()}
  dropped = {step: sum(v for k, v in phases.items() if k not in ("eval", "checkpoint_stall"))
             for step, phases in timeline.per_iteration(
                 [s for s in spans if discarded(s)]).items()}
  return {"checkpoint_stall_s": total("checkpoint_stall"), "evaluation_s": total("eval"),
          "training_s": sum(steps.values()),
          "first_new_steps_s": sum(steps.get(s, 0.0) for s in first_steps),
          "rolled_back_steps_s": sum(dropped.values())}


def where_time_went(report: dict, run: dict, rows: list[dict], run_dir: str,
                    iteration_s: float) -> dict:
  """Wall seconds of the faulty run: training at the fault-free rate, start-up, and per fault
  detection, restart (with its self-check and first step) and replay, as the goodput reader
  (mscale_jax/goodput/drill.py) splits a simulated run; the rest, `other_s`, itemised into
  parts each measured on its own, and what none of them covers (`unaccounted_s`)."""
  restarted = [r for r in rows if r.get("restart_s") is not None]
  split = {"training_s": len(run) * iteration_s, "startup_s": startup_s(report, run),
           "detection_s": sum(r["detection_latency_s"] or 0.0 for r in restarted),
           "restart_s": sum(r["restart_s"] for r in restarted),
           "replayed_steps_s": sum(r["phases"]["replay_s"] for r in restarted)}
  split["other_s"] = report["wall_s"] - sum(split.values())
  # Each step's last run is in the training time once: a step two restarts went back to is
  # the first new step of the later one only (the earlier one's run of it was replayed again).
  measured = timeline_totals(
      run_dir, {r["restore_step"] + 1 for r in restarted if r.get("restore_step") is not None},
      [(r["restore_span"], r["restore_step"]) for r in rows if r.get("restore_span")])
  other = {"checkpoint_stall_s": measured.get("checkpoint_stall_s"),
           "evaluation_s": measured.get("evaluation_s"),
           "steps_slower_than_steady_s": measured["training_s"] - split["training_s"]
           if "training_s" in measured else None}
  # Counted twice above, so added back once: each restart's first new step (inside restart_s
  # and in the training time) and contend's slowdown (inside steps_slower_than_steady_s).
  twice = measured.get("first_new_steps_s") or 0.0
  other["unaccounted_s"] = split["other_s"] - sum(v or 0.0 for v in other.values()) + twice
  other["of_which"] = {"first_new_steps_in_restart_s": twice,
                       "rolled_back_steps_s": measured.get("rolled_back_steps_s") or 0.0,
                       "slowdown_in_steps_slower_s": sum(r["phases"].get("slowdown_s") or 0.0
                                                         for r in rows)}
  split["other_split"] = other
  split["sources"] = (
      "training_s: steps x the fault-free iteration time; startup_s: launch to the first step; "
      "detection/restart: the driver's report and each step's log time (restart: detection to "
      "the end of the first new step, self-check included); replayed_steps_s: steps lost x the "
      "iteration time. other_split, each measured on its own: checkpoint stalls and evaluations"
      " (rank 0's timeline, every attempt), steps slower than steady (rank 0's timeline, each "
      "step once, less training_s; contend's slowdown is inside it: of_which); unaccounted_s: "
      "what none of these covers (driver shutdown, the relaunch after kill_driver, "
      "heartbeat-late detection), with each restart's first new step, which restart_s and the "
      "training time both hold, counted once (of_which). A NaN's in-process rollback: detection "
      "is the NaN step to the restore, restart the restore to the end of the first new step; "
      "the step runs it discarded are left out of the steps (of_which.rolled_back_steps_s: "
      "detection and replayed_steps_s hold them)")
  return split


