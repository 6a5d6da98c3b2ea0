r"""A fault drill: the main job on 2 processes with injected faults, against a fault-free run.

  python -m experiments.fault_drill                      # gpt_tiny, 1000 steps, 6 faults
  python -m experiments.fault_drill --fault=kill:rank=1:step=37 --fault=nan:step=60 \
      --steps=300 --reference=runs/drill-reference       # reuse a fault-free run

Runs `experiments.launch` twice with the same flags (every step logged) and one compilation
cache, once without faults (the reference) and once with them, then records per fault the
detection latency (injection to detection), the diagnosis (failure kind, self-check verdicts),
the restart time (detection to the first new step), the steps lost (replayed from the
checkpoint), and for the run the effective training time rate (MegaScale's: iterations x
iteration time / wall time, with the reference's steady iteration time), where the rest of the
wall time went, and whether the final loss curve equals the reference step for step. Writes a
results/ record and, next to it, a PNG of both runs' progress (step against wall time).
"""
import json
import os
import time

from absl import app, flags

from experiments import job

_FAULTS = flags.DEFINE_multi_string(
    "fault", ["kill:rank=1:step=37", "bad_slot:slot=1", "kill:rank=0:step=80:at=save",
              "hang:rank=0:step=115", "nan:step=150", "exception:rank=1:step=190"],
    "Faults to inject (experiments.launch --fault syntax).")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/gpt_tiny.py", "Config file.")
_STEPS = flags.DEFINE_integer("steps", 1000, "Training steps.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 10, "Checkpoint cadence.")
_SPARES = flags.DEFINE_integer("spare_slots", 1, "Spare slots (a bad slot is replaced).")
_HANG = flags.DEFINE_float("hang_timeout_s", 5.0, "The driver's hang timeout floor.")
_HANG_FACTOR = flags.DEFINE_float("hang_step_factor", 10.0, "The driver's hang timeout in step "
                                  "times (the larger of the two applies).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/fault_drill", "Folder for both runs.")
_REFERENCE = flags.DEFINE_string("reference", None, "A finished fault-free run to compare "
                                 "with (default: run one in WORKDIR/reference).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the record (default results/).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 3600, "Give up on a launcher run (and kill all it "
                                "started) after this many seconds.")


def launch(workdir: str, faults: list[str]) -> None:
  """Runs experiments.launch to the end (experiments/job.py), streaming the driver's lines (its
  report holds the wall time)."""
  cache = os.path.abspath(os.path.join(_WORKDIR.value, "compile_cache"))
  result = job.run(
      workdir, ["--num_processes=2", "--devices_per_process=4", f"--spare_slots={_SPARES.value}",
                f"--hang_timeout_s={_HANG.value}", f"--hang_step_factor={_HANG_FACTOR.value}",
                f"--max_restarts={len(faults) + 2}", f"--compile_cache_dir={cache}",
                *[f"--fault={f}" for f in faults]],
      [f"--config={_CONFIG.value}", f"--config.train.steps={_STEPS.value}",
       f"--config.train.checkpoint_every={_CHECKPOINT_EVERY.value}",
       "--config.train.log_every=1"], timeout_s=_TIMEOUT.value, echo=True)
  if result.status != 0:
    ended = "timed out" if result.timed_out else f"exited with status {result.status}"
    raise SystemExit(f"[drill] the launcher {ended}; see {workdir}/resilience/report.json, "
                     f"{workdir}/logs/ and {result.log}")


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


def plot(reference: dict, run: dict, ref_start: float, run_start: float, failures: list[dict],
         path: str) -> None:
  """Both runs' progress, step against seconds since launch: a fault is a gap or a step back."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7.5, 3.8))
  for curve, start, label, style in ((reference, ref_start, "fault-free", dict(lw=3, alpha=0.4)),
                                     (run, run_start, "with faults", dict(lw=1))):
    steps = sorted(curve)
    ax.plot([curve[s]["time"] - start for s in steps], steps, label=label, **style)
  for f in failures:
    ax.axvline(f["detected_at"] - run_start, color="red", lw=0.6, ls="--")
    ax.text(f["detected_at"] - run_start, 0, f" {f['kind']}", rotation=90, va="bottom",
            fontsize=7, color="red")
  ax.set_xlabel("seconds since launch")
  ax.set_ylabel("step (final run of each)")
  ax.set_title("fault drill: progress with and without faults (red: failure detected)",
               fontsize=9)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _restart_s(failure: dict, run: dict) -> float | None:
  """Detection to the end of the first step after the restore (from the step's own log time).

  The driver's own figure comes from heartbeats and so runs up to one heartbeat late.
  """
  first = run.get((failure.get("restore_step") or 0) + 1)
  return first["time"] - failure["detected_at"] if first else None


def where_time_went(report: dict, run: dict, per_fault: list[dict], iteration_s: float) -> dict:
  """Wall seconds of the faulty run split into training and what each kind of loss cost."""
  start = report["attempts"][0]["started"]
  first_step = min(r["time"] for r in run.values()) - start - iteration_s
  lost = {"startup_s": first_step,
          "detection_s": sum(f["detection_latency_s"] or 0 for f in per_fault),
          "restart_s": sum(f["restart_s"] or 0 for f in per_fault),
          "replayed_steps_s": sum(f["steps_lost"] or 0 for f in per_fault) * iteration_s}
  training = len(run) * iteration_s
  lost["other_s"] = report["wall_s"] - training - sum(lost.values())
  return {"training_s": training, **lost,
          "other_is": "checkpoint stalls, evaluations, steps slower than the steady mean and "
                      "the driver's shutdown"}


def main(argv):
  del argv
  from experiments import results
  from mscale_jax.resilience.faults import parse_faults
  faults = [f.spec for f in parse_faults(_FAULTS.value)]
  ref_dir = _REFERENCE.value or os.path.join(_WORKDIR.value, "reference")
  if not os.path.exists(os.path.join(ref_dir, "summary.json")):
    launch(ref_dir, [])
  run_dir = os.path.join(_WORKDIR.value, f"faults-{time.strftime('%Y%m%d-%H%M%S')}")
  launch(run_dir, faults)
  ref_summary = read_json(os.path.join(ref_dir, "summary.json"))
  report = read_json(os.path.join(run_dir, "resilience", "report.json"))
  ref_report = read_json(os.path.join(ref_dir, "resilience", "report.json"))
  summary = read_json(os.path.join(run_dir, "summary.json"))
  # The reference's steady iteration time: tokens per step / steady tokens per second.
  tokens = _tokens_per_step(ref_dir)
  iteration_s = tokens / ref_summary["mean_tokens_per_s"]
  reference, run = metrics(ref_dir), metrics(run_dir)
  warm = {a["attempt"]: a["warm_processes"] for a in report["attempts"]}
  per_fault = [{
      "injected": f["injected"], "kind": f["kind"], "rank": f["rank"], "slot": f["slot"],
      "detail": f["detail"], "detection_latency_s": f["detection_latency_s"],
      "diagnosis": {"self_check_s": f.get("diagnosis", {}).get("seconds"),
                    "excluded": f.get("diagnosis", {}).get("excluded")},
      "restart_s": _restart_s(f, run), "warm_processes": warm.get(f["attempt"] + 1),
      "restore_step": f.get("restore_step"), "steps_lost": f.get("steps_lost")}
      for f in report["failures"]]
  figures = {
      "faults": per_fault,
      "faults_injected": len(faults),
      "failures_detected": len(report["failures"]),
      "excluded_slots": report["excluded_slots"],
      "completed": report["completed"],
      "wall_s": report["wall_s"],
      "steps": _STEPS.value,
      "iteration_s": iteration_s,
      "iteration_s_source": "the fault-free run's steady mean (summary mean_tokens_per_s)",
      "effective_training_time_rate": _STEPS.value * iteration_s / report["wall_s"],
      "where_time_went": where_time_went(report, run, per_fault, iteration_s),
      "restarts": report["restarts"],
      "reference_wall_s": ref_report["wall_s"],
      "reference_effective_training_time_rate": _STEPS.value * iteration_s / ref_report["wall_s"],
      "max_detection_latency_s": max((f["detection_latency_s"] or 0) for f in per_fault),
      "loss_curve_vs_reference": compare({s: r["loss"] for s, r in reference.items()},
                                         {s: r["loss"] for s, r in run.items()}),
      "checkpoint_saves": summary["checkpoint_saves"],
      "restore_s": summary["restore_s"],
  }
  device = {"platform": "cpu", "processes": 2, "devices_per_process": 4,
            "spare_slots": _SPARES.value, "host_cpu_count": os.cpu_count()}
  path = results.write_record("fault_drill-" + ref_summary["config"], figures, device=device,
                              out_dir=_OUT_DIR.value,
                              extra={"reference_workdir": ref_dir, "workdir": run_dir})
  png = path[:-len(".json")] + ".png"
  plot(reference, run, ref_report["attempts"][0]["started"], report["attempts"][0]["started"],
       report["failures"], png)
  print(json.dumps({k: v for k, v in figures.items() if k != "checkpoint_saves"}, indent=1))
  print(f"[drill] wrote {path} and {png}")


def _tokens_per_step(workdir: str) -> int:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  return round(first["tokens_per_s"] * first["step_time_s"])


if __name__ == "__main__":
  app.run(main)
