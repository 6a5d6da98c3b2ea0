r"""A fault drill: the main job on 2 processes with injected faults, against a fault-free run.

  python -m experiments.fault_drill                      # gpt_tiny, 1560 steps, 12 faults
  python -m experiments.fault_drill --fault=stop:rank=1:step=40 --fault=nan:step=60 \
      --steps=300 --reference=runs/drill-reference       # reuse a fault-free run

Runs `experiments.launch` twice with the same flags (every step logged) and the launcher's
default limits (hang: 60 s until the step time is known, then 20 x its 95th percentile, at least
10 s: mscale_jax/resilience/driver/supervisor.py), each run with its own, cold, compilation cache
(restarts inside a run reuse that run's cache, as they would on a cluster): once without faults
(the reference) and once with them. Six faults are injected inside the workers (kill, kill
during a save, hang, NaN, exception) or by a bad slot, six from outside by the driver acting as
the operating system would (SIGSTOP, a busy neighbour on a pinned core, bytes flipped in a
committed checkpoint, a read-only checkpoint directory, SIGKILL of the driver, SIGKILL of
process 0): mscale_jax/resilience/faults.py. When the driver itself is killed, the drill runs
the same launch command again, as an operator would, and the job resumes from its workdir.
The default faults sit at fixed fractions of the run, so a longer run spreads the same 12
(--steps=520 is the earlier, denser drill); per-fault costs do not shrink with the run, so the
record states the fault density (faults per hour) next to the rate.

Recorded per fault: detection (injection to detection), diagnosis (self-check), restart
(detection to the end of the first new step, without the self-check), replay (steps lost x the
fault-free iteration time) and, for a slowdown, the measured extra step time while it lasted.
For the run: its wall time split into parts each measured on its own (start-up, training steps,
checkpoint stalls and evaluations from rank 0's timeline, the faults' parts; what no part
covers is reported as `unaccounted_s`, not attributed), the effective training time rate of
the fault run and of the fault-free run (MegaScale's: iterations x iteration time / wall time,
with the reference's steady iteration time) and their ratio, and whether the final loss curve
equals the reference step for step. Writes a results/ record and, next to it, a PNG with one bar
per fault split by phase.
"""
import json
import os
import statistics
import time

from absl import app, flags

from experiments import job

# The default drill's faults, each at a fraction of the run (--steps): six inside the workers,
# six from outside. A save-time kill lands on a checkpoint step.
OLD_FAULTS = [("kill:rank=1", 0.071), ("bad_slot:slot=1", 0.067), ("kill:rank=0:at=save", 0.154),
              ("hang:rank=0", 0.221), ("nan", 0.288), ("exception:rank=1", 0.365)]
OS_FAULTS = [("stop:rank=1", 0.442), ("contend:rank=1:seconds=30", 0.519),
             ("corrupt_checkpoint:rank=0", 0.615), ("io_error", 0.702), ("kill_driver", 0.788),
             ("kill_coordinator", 0.875)]
FLAGS = flags.FLAGS
TARGET = 0.95   # the fault run keeps this fraction of the fault-free run's rate (issue 18)


def default_faults(steps: int, checkpoint_every: int) -> list[str]:
  """The 12 drill faults placed at their fractions of a `steps`-step run."""
  out = []
  for spec, fraction in OLD_FAULTS + OS_FAULTS:
    step = max(round(fraction * steps), 1)
    if "at=save" in spec:
      step = max(round(step / checkpoint_every), 1) * checkpoint_every
    out.append(f"{spec}:step={step}")
  return out


def launch(workdir: str, faults: list[str]) -> list[dict]:
  """Runs experiments.launch to the end (experiments/job.py), streaming the driver's lines; when
  the driver is killed (kill_driver), runs the same command again. Returns one entry per
  launcher run: {'status', 'wall_s', 'ended'}."""
  runs, sessions = [], []
  try:
    while True:
      result = job.run(
          workdir, ["--num_processes=2", "--devices_per_process=4",
                    f"--spare_slots={FLAGS.spare_slots}", f"--max_restarts={len(faults) + 2}",
                    *[f"--fault={f}" for f in faults]],
          [f"--config={FLAGS.config}", f"--config.train.steps={FLAGS.steps}",
           f"--config.train.checkpoint_every={FLAGS.checkpoint_every}",
           "--config.train.log_every=1"], timeout_s=FLAGS.timeout_s, echo=True,
          keep_orphans=True)
      sessions.append(result.session)
      runs.append({"status": result.status, "wall_s": result.wall_s, "ended": time.time()})
      if result.status is not None and result.status < 0 and len(runs) <= len(faults):
        print(f"[drill] the driver died (signal {-result.status}); running the same launch "
              f"command again", flush=True)
        continue
      break
  finally:
    for session in sessions:
      job.end_session(session)
  if result.status != 0:
    ended = "timed out" if result.timed_out else f"exited with status {result.status}"
    raise SystemExit(f"[drill] the launcher {ended}; see {workdir}/resilience/report.json, "
                     f"{workdir}/logs/ and {result.log}")
  return runs


def read_json(path):
  with open(path) as f:
    return json.load(f)


def metrics(workdir: str) -> dict[int, dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f)}


def compare(reference: dict, run: dict) -> dict:
  """Both runs log every step: is each step's loss the same?"""
  diffs = [abs(run[s] - reference[s]) for s in sorted(reference) if s in run]
  same_steps = sorted(run) == sorted(reference)
  return {"steps_compared": len(diffs), "same_steps": same_steps,
          "bitwise_equal": same_steps and all(d == 0 for d in diffs),
          "max_abs_diff": max(diffs) if diffs else None}


PHASES = ("detection_s", "diagnosis_s", "restart_s", "replay_s", "slowdown_s")
COLORS = {"detection_s": "#d62728", "diagnosis_s": "#9467bd", "restart_s": "#1f77b4",
          "replay_s": "#ff7f0e", "slowdown_s": "#8c564b"}


def plot(per_fault: list[dict], figures: dict, path: str) -> None:
  """One bar per fault, split by phase (seconds of the fault run's wall time it cost)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(9, 4.2))
  labels = [f["injected"].split(":")[0] + (" at save" if "at=save" in f["injected"] else "")
            + ("\n(found by a restart's\nself-check: no own cost)"
               if f["injected"].startswith("bad_slot") else "")
            + ("\n(not flagged)" if f["kind"] == "not flagged" else "") for f in per_fault]
  bottom = [0.0] * len(per_fault)
  for phase in PHASES:
    values = [f["phases"].get(phase) or 0.0 for f in per_fault]
    ax.bar(range(len(per_fault)), values, bottom=bottom, color=COLORS[phase],
           label=phase[:-2])
    bottom = [b + v for b, v in zip(bottom, values)]
  ax.set_xticks(range(len(per_fault)), labels, rotation=35, ha="right", fontsize=8)
  ax.set_ylabel("seconds of wall time")
  ratio = figures["rate_vs_fault_free"] if figures["runs_comparable"] else \
      figures["own_iteration_rates"]["rate_vs_fault_free"]
  ax.set_title(f"fault drill: where each fault's time went (rate {ratio:.1%} of the fault-free "
               f"run{'' if figures['runs_comparable'] else ', each at its own iteration time'}, "
               f"target {TARGET:.0%}; "
               f"{figures['faults_per_hour']:.0f} faults per hour)", fontsize=8)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _restart_s(failure: dict, run: dict) -> float | None:
  """Detection to the end of the first step after the restore (from the step's own log time).

  The driver's own figure comes from heartbeats and so runs up to one heartbeat late.
  """
  first = run.get((failure.get("restore_step") or 0) + 1)
  return first["time"] - failure["detected_at"] if first else None


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
  since = [f for f in report["observability"].get("straggler_flags") or []
           if isinstance(f, dict) and marker["time"] <= (f.get("time") or 0) <= end + 60]
  victim = [f for f in since if f.get("rank") == fault.rank]   # the first flag of the victim
  return {"fired": True, "core": marker.get("core"), "steps_in_window": len(window),
          "slowdown_s": sum(max(r["step_time_s"] - iteration_s, 0.0) for r in window),
          "flagged_rank": victim[0]["rank"] if victim else None,
          "flagged_metric": victim[0].get("metric") if victim else None,
          "other_ranks_flagged": sorted({f.get("rank") for f in since} - {fault.rank}),
          "detection_latency_s": victim[0]["time"] - marker["time"] if victim else None}


def per_fault_rows(faults: list[str], report: dict, run: dict, run_dir: str,
                   iteration_s: float) -> list[dict]:
  """One row per injected fault: what detected it, how, and the time of each phase."""
  from mscale_jax.resilience.faults import parse_fault
  warm = {a["attempt"]: a.get("warm_processes") for a in report["attempts"]}
  failures = {f["injected"]: f for f in report["failures"] if f.get("injected")}
  rows = []
  for spec in (parse_fault(f).spec for f in faults):
    f = failures.get(spec)
    if spec.startswith("contend"):
      slow = _slowdown(run_dir, spec, run, iteration_s, report)
      rows.append({"injected": spec, "kind": "straggler (warn)" if slow.get("flagged_rank")
                   is not None else "not flagged", "detected": slow.get("flagged_rank") is not None,
                   "detection_latency_s": slow.get("detection_latency_s"), **slow,
                   "phases": {"slowdown_s": slow.get("slowdown_s")}})
      continue
    if spec.startswith("bad_slot"):   # found by the self-check of the next restart
      owner = next((x for x in report["failures"] if (x.get("diagnosis") or {}).get("excluded")),
                   None)
      rows.append({"injected": spec, "kind": "self_check_failed",
                   "detected": owner is not None,
                   "excluded": owner and owner["diagnosis"]["excluded"],
                   "found_while_recovering_from": owner and owner["injected"], "phases": {}})
      continue
    if f is None:
      rows.append({"injected": spec, "kind": None, "detected": False, "phases": {}})
      continue
    diagnosis = (f.get("diagnosis") or {}).get("seconds")
    restart = _restart_s(f, run)
    marker = _marker(run_dir, spec) or {}
    rows.append({
        "injected": spec, "injected_step": marker.get("step"), "by": marker.get("by", "worker"),
        "kind": f["kind"], "rank": f["rank"], "slot": f.get("slot"),
        "detected": True, "detail": f["detail"], "detection_latency_s": f["detection_latency_s"],
        "diagnosis": {"self_check_s": diagnosis,
                      "excluded": (f.get("diagnosis") or {}).get("excluded")},
        "restart_s": restart, "warm_processes": warm.get(f["attempt"] + 1),
        "restore_step": f.get("restore_step"), "steps_lost": f.get("steps_lost"),
        "phases": {"detection_s": f["detection_latency_s"], "diagnosis_s": diagnosis,
                   "restart_s": restart - (diagnosis or 0.0) if restart is not None else None,
                   "replay_s": (f.get("steps_lost") or 0) * iteration_s}})
  return rows


def timeline_totals(run_dir: str, first_steps=()) -> dict:
  """Rank 0's measured seconds, every attempt: checkpoint stalls, evaluations, the training
  steps (each step once, its last run; without its evaluation and checkpoint stall) and, of
  those, the steps in `first_steps` (each restart's first new step)."""
  from mscale_jax.observability import timeline
  path = os.path.join(run_dir, "timeline", "rank0.jsonl")
  if not os.path.exists(path):
    return {}
  _, spans = timeline.read_rank_file(path)
  total = lambda name: sum(s["end"] - s["start"] for s in spans if s["name"] == name)  # noqa
  steps = {step: sum(v for k, v in phases.items() if k not in ("eval", "checkpoint_stall"))
           for step, phases in timeline.per_iteration(spans).items()}
  return {"checkpoint_stall_s": total("checkpoint_stall"), "evaluation_s": total("eval"),
          "training_s": sum(steps.values()),
          "first_new_steps_s": sum(steps.get(s, 0.0) for s in first_steps)}


def where_time_went(report: dict, run: dict, rows: list[dict], run_dir: str,
                    iteration_s: float) -> dict:
  """Wall seconds of the faulty run: training at the fault-free rate, start-up, and per fault
  detection, restart (with its self-check and first step) and replay, as the goodput reader
  (mscale_jax/goodput/drill.py) splits a simulated run; the rest, `other_s`, itemised into
  parts each measured on its own, and what none of them covers (`unaccounted_s`)."""
  start = next(a["started"] for a in report["attempts"] if a.get("started"))
  first = min(run.values(), key=lambda r: r["step"])
  restarted = [r for r in rows if r.get("restart_s") is not None]
  split = {"training_s": len(run) * iteration_s,
           "startup_s": first["time"] - start - first["step_time_s"],
           "detection_s": sum(r["detection_latency_s"] or 0.0 for r in restarted),
           "restart_s": sum(r["restart_s"] for r in restarted),
           "replayed_steps_s": sum(r["phases"]["replay_s"] for r in restarted)}
  split["other_s"] = report["wall_s"] - sum(split.values())
  measured = timeline_totals(run_dir, [r["restore_step"] + 1 for r in restarted
                                       if r.get("restore_step") is not None])
  other = {"checkpoint_stall_s": measured.get("checkpoint_stall_s"),
           "evaluation_s": measured.get("evaluation_s"),
           "steps_slower_than_steady_s": measured["training_s"] - split["training_s"]
           if "training_s" in measured else None}
  # Counted twice above, so added back once: each restart's first new step (inside restart_s
  # and in the training time) and contend's slowdown (inside steps_slower_than_steady_s).
  twice = measured.get("first_new_steps_s") or 0.0
  other["unaccounted_s"] = split["other_s"] - sum(v or 0.0 for v in other.values()) + twice
  other["of_which"] = {"first_new_steps_in_restart_s": twice,
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
      "training time both hold, counted once (of_which)")
  return split


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_multi_string("fault", [], "Faults to inject (experiments.launch --fault "
                            "syntax; default: OLD_FAULTS + OS_FAULTS spread over --steps).")
  flags.DEFINE_string("config", "experiments/configs/gpt_tiny.py", "Config file.")
  flags.DEFINE_integer("steps", 1560, "Training steps.")
  flags.DEFINE_integer("checkpoint_every", 10, "Checkpoint cadence.")
  flags.DEFINE_integer("spare_slots", 1, "Spare slots (a bad slot is replaced).")
  flags.DEFINE_string("workdir", "runs/fault_drill", "Folder for both runs.")
  flags.DEFINE_string("reference", None, "A finished fault-free run to compare "
                      "with (default: run one in WORKDIR/reference-<time>).")
  flags.DEFINE_string("run", None, "A finished fault run (its workdir) to record again "
                      "instead of running one (with --reference).")
  flags.DEFINE_string("out_dir", None, "Folder for the record (default results/).")
  flags.DEFINE_integer("timeout_s", 3600, "Give up on a launcher run (and kill all it "
                       "started) after this many seconds.")


def main(argv):
  del argv
  from experiments import results
  from mscale_jax.resilience.faults import parse_faults
  faults = [f.spec for f in parse_faults(
      FLAGS.fault or default_faults(FLAGS.steps, FLAGS.checkpoint_every))]
  stamp = time.strftime("%Y%m%d-%H%M%S")
  load_before = os.getloadavg()
  ref_dir = FLAGS.reference or os.path.join(FLAGS.workdir, f"reference-{stamp}")
  if not os.path.exists(os.path.join(ref_dir, "summary.json")):
    launch(ref_dir, [])
  run_dir = FLAGS.run or os.path.join(FLAGS.workdir, f"faults-{stamp}")
  if not FLAGS.run:   # kept with the run, so that it can be recorded again (--run)
    launches = launch(run_dir, faults)
    with open(os.path.join(run_dir, "drill_runs.json"), "w") as f:
      json.dump({"launcher_runs": launches, "load_average": [load_before[0], os.getloadavg()[0]]},
                f)
  drill_runs = read_json(os.path.join(run_dir, "drill_runs.json"))
  load = drill_runs["load_average"]
  ref_summary = read_json(os.path.join(ref_dir, "summary.json"))
  report = read_json(os.path.join(run_dir, "resilience", "report.json"))
  ref_report = read_json(os.path.join(ref_dir, "resilience", "report.json"))
  summary = read_json(os.path.join(run_dir, "summary.json"))
  reference, run = metrics(ref_dir), metrics(run_dir)
  # On a shared machine the load can change between the two (sequential) runs: each run's rate
  # with its own median iteration time is the comparison that survives that.
  own = statistics.median(r["step_time_s"] for r in run.values())
  ref_own = statistics.median(r["step_time_s"] for r in reference.values())
  own_rate, ref_own_rate = FLAGS.steps * own / report["wall_s"], \
      FLAGS.steps * ref_own / ref_report["wall_s"]
  comparable = abs(own / ref_own - 1) <= 0.1
  # The iteration time the fault run's accounting uses: the reference's steady one (tokens per
  # step / steady tokens per second) when the loads were alike, else the run's own.
  iteration_s = _tokens_per_step(ref_dir) / ref_summary["mean_tokens_per_s"] if comparable \
      else own
  rows = per_fault_rows(faults, report, run, run_dir, iteration_s)
  rate = FLAGS.steps * iteration_s / report["wall_s"]
  ref_rate = FLAGS.steps * iteration_s / ref_report["wall_s"]
  figures = {
      "faults": rows,
      "faults_injected": len(faults),
      # Fault density: the drill's fixed per-fault costs weigh more the denser the faults.
      "faults_per_hour": len(faults) / (report["wall_s"] / 3600),
      "faults_detected": sum(bool(r["detected"]) for r in rows),
      "failures_detected": len(report["failures"]),
      "excluded_slots": report["excluded_slots"],
      "completed": report["completed"],
      "wall_s": report["wall_s"],
      "launcher_runs": drill_runs["launcher_runs"],
      "steps": FLAGS.steps,
      "checkpoint_every": FLAGS.checkpoint_every,
      "iteration_s": iteration_s,
      "iteration_s_source": "the fault-free run's steady mean (summary mean_tokens_per_s)"
                            if comparable else "the fault run's own median (runs_comparable "
                            "is false: the fault-free run's would measure the load)",
      "effective_training_time_rate": rate,
      "reference_wall_s": ref_report["wall_s"],
      "reference_effective_training_time_rate": ref_rate,
      "rate_vs_fault_free": rate / ref_rate,
      "median_iteration_s": {"fault_run": own, "fault_free_run": ref_own},
      "runs_comparable": comparable,
      "runs_comparable_rule": "the runs' median iteration times within 10% of each other (the "
                              "machine's load alike); otherwise rate_vs_fault_free measures the "
                              "load, not the faults",
      "own_iteration_rates": {"fault_run": own_rate, "fault_free_run": ref_own_rate,
                              "rate_vs_fault_free": own_rate / ref_own_rate},
      "target_rate_vs_fault_free": TARGET,
      "meets_target": (rate / ref_rate if comparable else own_rate / ref_own_rate) >= TARGET,
      "where_time_went": where_time_went(report, run, rows, run_dir, iteration_s),
      "reference_where_time_went": timeline_totals(ref_dir),
      "restarts": report["restarts"],
      "max_detection_latency_s": max((r.get("detection_latency_s") or 0) for r in rows),
      "loss_curve_vs_reference": compare({s: r["loss"] for s, r in reference.items()},
                                         {s: r["loss"] for s, r in run.items()}),
      "checkpoint_saves": summary["checkpoint_saves"],
      "restore_s": summary["restore_s"],
      "limits": "the launcher's defaults (hang: 60 s until 20 step times are known, then 20 x "
                "their 95th percentile, at least 10 s; startup 600 s; io 120 s); each run's own "
                "cold compilation cache",
      "machine_note": "a shared machine (2 cores, several engineers' jobs): timings are noisy; "
                      f"1-min load average {load[0]:.1f} before the runs, {load[1]:.1f} after "
                      "the fault run. Steps of the fault run ran faster than the reference's "
                      "steady mean when the machine was less busy: other_split then holds a "
                      "negative steps_slower_than_steady_s",
  }
  device = {"platform": "cpu", "processes": 2, "devices_per_process": 4,
            "spare_slots": FLAGS.spare_slots, "host_cpu_count": os.cpu_count()}
  path = results.write_record("fault_drill-" + ref_summary["config"], figures, device=device,
                              out_dir=FLAGS.out_dir,
                              extra={"reference_workdir": ref_dir, "workdir": run_dir})
  png = path[:-len(".json")] + ".png"
  plot(rows, figures, png)
  print(json.dumps({k: v for k, v in figures.items() if k not in ("checkpoint_saves", "faults")},
                   indent=1, default=str))
  print(f"[drill] wrote {path} and {png}")


def _tokens_per_step(workdir: str) -> int:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  return round(first["tokens_per_s"] * first["step_time_s"])


if __name__ == "__main__":
  define_flags()
  app.run(main)
