r"""A fault drill: the main job on 2 processes with injected faults, against a fault-free run.

  python -m experiments.fault_drill                      # gpt_tiny, 4680 steps, 12 faults
  python -m experiments.fault_drill --fault=stop:rank=1:step=40 --fault=nan:step=60 \
      --steps=300 --reference=runs/drill-reference       # reuse a fault-free run

Runs `experiments.launch` twice with the same flags (every step logged, the production
non-finite policy train.on_nonfinite=rollback) and the launcher's default limits (hang: 60 s
until the step time is known, then 20 x its median, at least 10 s:
mscale_jax/resilience/driver/hang_limit.py), each run with its own workdir and cold compilation
cache (restarts inside a run reuse that run's cache, as they would on a cluster): once without
faults (the reference) and once with them, AT THE SAME TIME on the same machine, so that the
load of a shared machine weighs on both alike (sequential runs on a shared host measured the
load, not the faults). Six faults are injected inside the workers (kill, kill
during a save, hang, NaN, exception) or by a bad slot, six from outside by the driver acting as
the operating system would (SIGSTOP, a busy neighbour on a pinned core, bytes flipped in a
committed checkpoint, a read-only checkpoint directory, SIGKILL of the driver, SIGKILL of
process 0): mscale_jax/resilience/faults.py. When the driver itself is killed, the drill runs
the same launch command again, as an operator would, and the job resumes from its workdir.
The default faults sit at fixed fractions of the run, so a longer run spreads the same 12
(--steps=1560 and 520 are the earlier, denser drills); per-fault costs do not shrink with the
run, so the record states the fault density (faults per hour) next to the rate, and a model of
the rate at any density from the record's measured costs (`density_model`,
experiments/drill_density.py; its plot beside the record, *-density.png).

Recorded per fault: detection (injection to detection), diagnosis (self-check), restart
(detection to the end of the first new step, without the self-check), replay (steps lost x the
fault-free iteration time), how it was recovered (a job restart, or in the process: the NaN's
rollback, the io_error's refused save dropped) and, for a slowdown, the measured extra step
time while it lasted; per restart, its seconds by phase (teardown, process start, restore,
compile or cache load, first step).
For the run: its wall time split into parts each measured on its own (start-up, training steps,
checkpoint stalls and evaluations from rank 0's timeline, the faults' parts; what no part
covers is reported as `unaccounted_s`, not attributed), the effective training time rate of
the fault run and of the fault-free run (MegaScale's: iterations x iteration time / wall time,
with the reference's steady iteration time) and their ratio, and whether the loss curve
equals the reference step for step (through the NaN's rollback, which departs from it by design).
Accounting: experiments/drill_accounting.py. Writes a results/ record and, next to it, a PNG
with one bar per fault split by phase and one of the rate against fault density.
"""
import functools
import json
import os
import statistics
import threading
import time

from absl import app, flags

from experiments import drill_density, job
from experiments.drill_accounting import (compare, metrics, per_fault_rows, read_json,
                                          reference_gain, restart_phases, startup_s,
                                          straggler_flags, timeline_totals, where_time_went)

# The default drill's faults, each at a fraction of the run (--steps): six inside the workers,
# six from outside. A save-time kill lands on a checkpoint step.
# The NaN comes last: the non-finite policy of both runs is the production one, an in-process
# rollback that goes on after the offending batch, so from there on the fault run trains on
# other batches than the reference and its loss curve departs from it by design; every fault
# before it is checked bitwise against the reference.
OLD_FAULTS = [("kill:rank=1", 0.071), ("bad_slot:slot=1", 0.067), ("kill:rank=0:at=save", 0.154),
              ("hang:rank=0", 0.221), ("exception:rank=1", 0.365), ("nan", 0.94)]
OS_FAULTS = [("stop:rank=1", 0.442), ("contend:rank=1:seconds=30", 0.519),
             ("corrupt_checkpoint:rank=0", 0.615), ("io_error", 0.702), ("kill_driver", 0.788),
             ("kill_coordinator", 0.875)]
FLAGS = flags.FLAGS
TARGET = 0.95   # the fault run keeps this fraction of the fault-free run's rate (issue 18)


def default_faults(steps: int, checkpoint_every: int) -> list[str]:
  """The 12 drill faults placed at their fractions of a `steps`-step run, in the order they
  strike."""
  out = []
  for spec, fraction in sorted(OLD_FAULTS + OS_FAULTS, key=lambda f: f[1]):
    step = max(round(fraction * steps), 1)
    if "at=save" in spec:
      step = max(round(step / checkpoint_every), 1) * checkpoint_every
    out.append(f"{spec}:step={step}")
  return out


def launch_flags(faults: list[str]) -> tuple[list[str], list[str]]:
  """The launcher's and the training's flags of a drill run with `faults`."""
  return (["--num_processes=2", "--devices_per_process=4", f"--spare_slots={FLAGS.spare_slots}",
           f"--max_restarts={len(faults) + 2}", *[f"--fault={f}" for f in faults]],
          [f"--config={FLAGS.config}", f"--config.train.steps={FLAGS.steps}",
           f"--config.train.checkpoint_every={FLAGS.checkpoint_every}",
           "--config.train.log_every=1", "--config.train.on_nonfinite=rollback"])


def launch(workdir: str, faults: list[str], echo: bool = True) -> list[dict]:
  """Runs experiments.launch to the end (experiments/job.py), streaming the driver's lines
  (`echo`); when the driver is killed (kill_driver), runs the same command again. Returns one
  entry per launcher run: {'status', 'wall_s', 'started', 'ended'}."""
  runs, sessions = [], []
  try:
    while True:
      started = time.time()
      result = job.run(workdir, *launch_flags(faults), timeout_s=FLAGS.timeout_s, echo=echo,
          keep_orphans=True)
      sessions.append(result.session)
      runs.append({"status": result.status, "wall_s": result.wall_s, "started": started,
                   "ended": time.time()})
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


def side_by_side(jobs: dict, twin) -> dict:
  """Runs each of `jobs` ({name: function}) in a thread of its own, all at the same time, and
  keeps the machine's load alike to the end: once one has finished while another still runs,
  `twin(stop, out)` (a load twin: load_twin) runs in its place until all have ended, then
  `stop` (a threading.Event) is set. Returns {name: result, 'load_twin': what the twin put in
  out['load_twin'], or None}; re-raises the first failure once all have ended."""
  out, errors = {}, []

  def one(name, fn):
    try:
      out[name] = fn()
    except BaseException as e:   # noqa: B036 (launch() ends with SystemExit)
      errors.append(e)

  threads = [threading.Thread(target=one, args=item) for item in jobs.items()]
  for t in threads:
    t.start()
  while all(t.is_alive() for t in threads):
    time.sleep(0.05)
  stop, filler = threading.Event(), None
  if any(t.is_alive() for t in threads):
    filler = threading.Thread(target=twin, args=(stop, out))
    filler.start()
  for t in threads:
    t.join()
  stop.set()
  if filler is not None:
    filler.join()
  if errors:
    raise errors[0]
  out.setdefault("load_twin", None)
  return out


def load_twin(workdir: str, stop: threading.Event, out: dict) -> None:
  """The fault-free job in `workdir`, started again (afresh, cold cache) each time it ends,
  until `stop`; its results are never read. Puts {'started', 'ended', 'workdir'} in out."""
  import shutil
  import subprocess
  launcher, train = launch_flags([])
  out["load_twin"] = {"started": time.time(), "workdir": workdir}
  while not stop.is_set():
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    proc = subprocess.Popen(job.command(workdir, launcher, train), cwd=job.REPO,
                            env=dict(os.environ, PYTHONPATH=job.REPO), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
      while not stop.wait(1.0) and proc.poll() is None:
        pass
    finally:
      job.end_session(proc.pid)
      proc.wait()
  out["load_twin"]["ended"] = time.time()


PHASES = ("detection_s", "diagnosis_s", "restart_s", "replay_s", "slowdown_s")
COLORS = {"detection_s": "#d62728", "diagnosis_s": "#9467bd", "restart_s": "#1f77b4",
          "replay_s": "#ff7f0e", "slowdown_s": "#8c564b"}


def plot(per_fault: list[dict], figures: dict, path: str) -> None:
  """One bar per fault in the order they struck, split by phase (seconds of the fault run's
  wall time it cost)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from mscale_jax.resilience.faults import parse_fault
  per_fault = sorted(per_fault, key=lambda f: parse_fault(f["injected"]).step)
  fig, ax = plt.subplots(figsize=(9, 4.2))
  labels = [f["injected"].split(":")[0] + (" at save" if "at=save" in f["injected"] else "")
            + ("\n(found by a restart's\nself-check: no own cost)"
               if f["kind"] == "self_check_failed" else "")
            + ("\n(not flagged)" if f["kind"] == "not flagged" else "")
            + ("\n(rolled back in-process)" if f.get("in_process") and f["kind"] == "nonfinite"
               else "\n(save dropped in-process)" if f.get("in_process") else "")
            for f in per_fault]
  bottom = [0.0] * len(per_fault)
  for phase in PHASES:
    values = [f["phases"].get(phase) or 0.0 for f in per_fault]
    ax.bar(range(len(per_fault)), values, bottom=bottom, color=COLORS[phase],
           label=phase[:-2])
    bottom = [b + v for b, v in zip(bottom, values)]
  ax.set_xticks(range(len(per_fault)), labels, rotation=35, ha="right", fontsize=8)
  ax.set_ylim(0, max(bottom + [1.0]) * 1.1)
  ax.set_ylabel("seconds of wall time")
  ratio = figures["rate_vs_fault_free"] if figures["runs_comparable"] else \
      figures["own_iteration_rates"]["rate_vs_fault_free"]
  ax.set_title(f"fault drill: where each fault's time went (rate {ratio:.1%} of the fault-free "
               f"run{' beside it' if figures.get('runs_concurrent') else ''}"
               f"{'' if figures['runs_comparable'] else ', each at its own iteration time'}, "
               f"target {TARGET:.0%}; "
               f"{figures['faults_per_hour']:.0f} faults per hour)", fontsize=8)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_multi_string("fault", [], "Faults to inject (experiments.launch --fault "
                            "syntax; default: OLD_FAULTS + OS_FAULTS spread over --steps).")
  flags.DEFINE_string("config", "experiments/configs/gpt_tiny.py", "Config file.")
  flags.DEFINE_integer("steps", 4680, "Training steps; the 12 default faults sit at fixed "
                       "fractions of them, so this sets the fault density. 4680: about 14 "
                       "faults per hour of the fault run on this 2-core host side by side "
                       "(~0.6 s a step, ~50 min; 1560 steps gave 38.6 per hour, "
                       "results/fault_drill-gpt_tiny-cpu-20261126T235744.json). Why: the "
                       "longest drill this host affords; still ~40x the density of a real "
                       "large job (Llama 3's 405B run: 466 interruptions in 54 days, 0.36 per "
                       "hour), whose rate the density model (experiments/drill_density.py) "
                       "gives from the record's per-fault costs.")
  flags.DEFINE_integer("checkpoint_every", 5, "Checkpoint cadence. 5: a save holds the loop "
                       "~0.03 s (results/save_stall-*), so the stalls of saving every 5 steps "
                       "cost less than the replay they save after each fault (10 before the "
                       "saves were short).")
  flags.DEFINE_integer("spare_slots", 1, "Spare slots (a bad slot is replaced).")
  flags.DEFINE_string("workdir", "runs/fault_drill", "Folder for both runs.")
  flags.DEFINE_string("reference", None, "A finished fault-free run to compare "
                      "with (default: run one in WORKDIR/reference-<time>).")
  flags.DEFINE_string("run", None, "A finished fault run (its workdir) to record again "
                      "instead of running one (with --reference).")
  flags.DEFINE_string("out_dir", None, "Folder for the record (default results/).")
  flags.DEFINE_integer("timeout_s", 7200, "Give up on a launcher run (and kill all it "
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
  run_dir = FLAGS.run or os.path.join(FLAGS.workdir, f"faults-{stamp}")
  if not FLAGS.run:   # kept with the run, so that it can be recorded again (--run)
    jobs = {"faults": lambda: launch(run_dir, faults)}
    if not os.path.exists(os.path.join(ref_dir, "summary.json")):
      jobs["reference"] = lambda: launch(ref_dir, [], echo=False)
      print(f"[drill] the fault-free reference runs at the same time in {ref_dir} (its output: "
            f"{ref_dir}/launcher.log)", flush=True)
    ran = side_by_side(jobs, functools.partial(
        load_twin, os.path.join(FLAGS.workdir, f"load_twin-{stamp}")))
    with open(os.path.join(run_dir, "drill_runs.json"), "w") as f:
      json.dump({"launcher_runs": ran["faults"], "reference_runs": ran.get("reference"),
                 "concurrent": "reference" in ran, "load_twin": ran["load_twin"],
                 "load_average": [load_before[0], os.getloadavg()[0]]}, f)
  drill_runs = read_json(os.path.join(run_dir, "drill_runs.json"))
  load = drill_runs["load_average"]
  ref_summary = read_json(os.path.join(ref_dir, "summary.json"))
  report = read_json(os.path.join(run_dir, "resilience", "report.json"))
  ref_report = read_json(os.path.join(ref_dir, "resilience", "report.json"))
  summary = read_json(os.path.join(run_dir, "summary.json"))
  reference, run = metrics(ref_dir), metrics(run_dir)
  # Run side by side, both runs meet the same load; a run recorded against an older, sequential
  # reference may not: then each run's rate at its own median iteration time is the comparison
  # that survives a change of load.
  own = statistics.median(r["step_time_s"] for r in run.values())
  ref_own = statistics.median(r["step_time_s"] for r in reference.values())
  own_rate, ref_own_rate = FLAGS.steps * own / report["wall_s"], \
      FLAGS.steps * ref_own / ref_report["wall_s"]
  concurrent = bool(drill_runs.get("concurrent"))
  comparable = concurrent or abs(own / ref_own - 1) <= 0.1
  # The iteration time the fault run's accounting uses: the reference's steady one (tokens per
  # step / steady tokens per second) when the loads were alike, else the run's own.
  iteration_s = _tokens_per_step(ref_dir) / ref_summary["mean_tokens_per_s"] if comparable \
      else own
  rows = per_fault_rows(faults, report, run, run_dir, iteration_s)
  # Side by side, the reference gains while the fault run is down: how much, and the ratio had
  # it not (its wall time plus what it saved).
  gain = reference_gain(reference, run)
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
      "runs_concurrent": bool(drill_runs.get("concurrent")),
      "runs_concurrent_how": "the fault-free reference and the fault run started together on "
                             "the same machine, each with its own workdir and cold compilation "
                             "cache; once one had ended, a copy of the fault-free job (the load "
                             "twin, results not read) ran until the other ended, so that the "
                             "load stayed alike to the end" if drill_runs.get("concurrent")
                             else "one after the other",
      "reference_runs": drill_runs.get("reference_runs"),
      "reference_gain_while_fault_run_down": gain,
      "rate_vs_fault_free_without_that_gain": (ref_report["wall_s"] + gain["reference_saved_s"])
                                              / report["wall_s"],
      "load_twin": drill_runs.get("load_twin"),
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
      "runs_comparable_rule": "the runs ran side by side (the same load by construction), or "
                              "their median iteration times are within 10% of each other; "
                              "otherwise rate_vs_fault_free measures the load, not the faults. "
                              "Side by side, rate_vs_fault_free is the reference's wall time "
                              "over the fault run's (same steps, same time); the fault run's "
                              "slower steps (its cold restarts, the busy core, the reference "
                              "sped up while the fault run was down) are part of it. "
                              "own_iteration_rates leaves per-step speed out",
      "own_iteration_rates": {"fault_run": own_rate, "fault_free_run": ref_own_rate,
                              "rate_vs_fault_free": own_rate / ref_own_rate},
      "target_rate_vs_fault_free": TARGET,
      "meets_target": (rate / ref_rate if comparable else own_rate / ref_own_rate) >= TARGET,
      "where_time_went": where_time_went(report, run, rows, run_dir, iteration_s),
      "reference_where_time_went": {**timeline_totals(ref_dir),
                                    "startup_s": startup_s(ref_report, reference)},
      "restart_phases": restart_phases(report, run_dir),
      "straggler_flags": straggler_flags(run_dir, report),
      "reference_straggler_flags": straggler_flags(ref_dir, ref_report),
      "recovered_how": {r["injected"]: r.get("recovered") for r in rows},
      "restarts": report["restarts"],
      "max_detection_latency_s": max((r.get("detection_latency_s") or 0) for r in rows),
      "loss_curve_vs_reference": compare({s: r["loss"] for s, r in reference.items()},
                                         {s: r["loss"] for s, r in run.items()}),
      "checkpoint_saves": summary["checkpoint_saves"],
      "restore_s": summary["restore_s"],
      "limits": "the launcher's defaults (hang: 60 s until 20 step times are known, then 20 x "
                "their median, at least 10 s; startup 600 s; io 120 s); each run's own "
                "cold compilation cache; train.on_nonfinite=rollback in both runs",
      "loss_curve_note": "equal_through_step: how far every loss is bitwise equal to the "
                         "reference's. Two faults can end that by design: the NaN (the last "
                         "fault), rolled back in the process, goes on after the offending batch; "
                         "a bad slot corrupts the updates from its step on (on its replicas "
                         "only), and the next save's replica check refuses them "
                         "(replica_divergence), so the restart restores the checkpoint before "
                         "(older records: such a checkpoint was written and restored as it was)",
      "machine_note": "a shared machine (2 cores, several engineers' jobs): timings are noisy; "
                      f"1-min load average {load[0]:.1f} before the runs, {load[1]:.1f} after "
                      "them. The drill's own two runs (4 workers) load it too; a step of the "
                      "fault run that ran faster than the reference's steady mean shows as a "
                      "negative steps_slower_than_steady_s",
  }
  device = {"platform": "cpu", "processes": 2, "devices_per_process": 4,
            "spare_slots": FLAGS.spare_slots, "host_cpu_count": os.cpu_count()}
  try:   # the rate at any fault density, from this run's measured costs
    figures["density_model"] = drill_density.model(figures)
  except (KeyError, TypeError, ZeroDivisionError) as e:
    figures["density_model"] = {"error": f"not modelled: {type(e).__name__}: {e}"}
  path = results.write_record("fault_drill-" + ref_summary["config"], figures, device=device,
                              out_dir=FLAGS.out_dir,
                              extra={"reference_workdir": ref_dir, "workdir": run_dir})
  png = path[:-len(".json")] + ".png"
  plot(rows, figures, png)
  if "model" in figures["density_model"]:
    drill_density.plot([("this drill", figures["density_model"])], png[:-4] + "-density.png")
    print(f"[drill] density model: {drill_density.summary_line(figures['density_model'])}")
  print(json.dumps({k: v for k, v in figures.items() if k not in ("checkpoint_saves", "faults",
                                                             "density_model")},
                   indent=1, default=str))
  print(f"[drill] wrote {path}, {png} and its -density.png")


def _tokens_per_step(workdir: str) -> int:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  return round(first["tokens_per_s"] * first["step_time_s"])


if __name__ == "__main__":
  define_flags()
  app.run(main)
