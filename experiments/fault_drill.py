r"""A fault drill: the main job on 2 processes with injected faults, against a fault-free run.

  python -m experiments.fault_drill                      # gpt_tiny, 300 steps, 6 faults
  python -m experiments.fault_drill --fault=kill:rank=1:step=37 --fault=nan:step=60 \
      --reference=runs/drill-reference                   # reuse a fault-free run

Runs `experiments.launch` twice with the same flags (every step logged), once without faults
(the reference) and once with them, then records per fault the detection latency (injection
to detection), the diagnosis (failure kind, self-check verdicts), the restart time (detection
to the first new step), the steps lost (replayed from the checkpoint), and for the run the
effective training time rate (MegaScale's: iterations x iteration time / wall time, with the
reference's steady iteration time) and whether the final loss curve equals the reference step
for step. Writes a results/ record and a loss-curve PNG next to it.
"""
import json
import os
import subprocess
import sys
import time

from absl import app, flags

_FAULTS = flags.DEFINE_multi_string(
    "fault", ["kill:rank=1:step=37", "bad_slot:slot=1", "kill:rank=0:step=80:at=save",
              "hang:rank=0:step=115", "nan:step=150", "exception:rank=1:step=190"],
    "Faults to inject (experiments.launch --fault syntax).")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/gpt_tiny.py", "Config file.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 20, "Checkpoint cadence.")
_SPARES = flags.DEFINE_integer("spare_slots", 1, "Spare slots (a bad slot is replaced).")
_HANG = flags.DEFINE_float("hang_timeout_s", 15.0, "The driver's hang timeout floor.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/fault_drill", "Folder for both runs.")
_REFERENCE = flags.DEFINE_string("reference", None, "A finished fault-free run to compare "
                                 "with (default: run one in WORKDIR/reference).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the record (default results/).")


def launch(workdir: str, faults: list[str]) -> float:
  """Runs experiments.launch to the end, streaming the driver's lines; returns wall seconds."""
  command = [sys.executable, "-m", "experiments.launch", "--num_processes=2",
             "--devices_per_process=4", f"--spare_slots={_SPARES.value}",
             f"--hang_timeout_s={_HANG.value}", f"--workdir={workdir}",
             *[f"--fault={f}" for f in faults], "--", f"--config={_CONFIG.value}",
             f"--config.train.steps={_STEPS.value}",
             f"--config.train.checkpoint_every={_CHECKPOINT_EVERY.value}",
             "--config.train.log_every=1"]
  print("[drill] " + " ".join(command[1:]), flush=True)
  start = time.time()
  result = subprocess.run(command)
  if result.returncode:
    raise SystemExit(f"[drill] the launcher exited with status {result.returncode}; see "
                     f"{workdir}/resilience/report.json and {workdir}/logs/")
  return time.time() - start


def read_json(path):
  with open(path) as f:
    return json.load(f)


def loss_curve(workdir: str) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def compare(reference: dict, run: dict) -> dict:
  """Both runs log every step: is each step's loss the same?"""
  diffs = [abs(run[s] - reference[s]) for s in sorted(reference) if s in run]
  same_steps = sorted(run) == sorted(reference)
  return {"steps_compared": len(diffs), "same_steps": same_steps,
          "bitwise_equal": same_steps and all(d == 0 for d in diffs),
          "max_abs_diff": max(diffs) if diffs else None}


def plot(reference: dict, run: dict, failures: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 3.5))
  ax.plot(list(reference), list(reference.values()), lw=3, alpha=0.4, label="fault-free")
  ax.plot(list(run), list(run.values()), lw=1, label="with faults (after restarts)")
  for f in failures:
    ax.axvline(f["step"] or 0, color="red", lw=0.6, ls="--")
    ax.text(f["step"] or 0, ax.get_ylim()[1], f" {f['kind']}", rotation=90, va="top",
            fontsize=7, color="red")
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats/byte)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  from experiments import results
  from mscale_jax.resilience.faults import parse_faults
  faults = [f.spec for f in parse_faults(_FAULTS.value)]
  ref_dir = _REFERENCE.value or os.path.join(_WORKDIR.value, "reference")
  ref_wall = None
  if not os.path.exists(os.path.join(ref_dir, "summary.json")):
    ref_wall = launch(ref_dir, [])
  run_dir = os.path.join(_WORKDIR.value, f"faults-{time.strftime('%Y%m%d-%H%M%S')}")
  launch(run_dir, faults)
  ref_summary = read_json(os.path.join(ref_dir, "summary.json"))
  report = read_json(os.path.join(run_dir, "resilience", "report.json"))
  summary = read_json(os.path.join(run_dir, "summary.json"))
  # The reference's steady iteration time: tokens per step / steady tokens per second.
  tokens = _tokens_per_step(ref_dir)
  iteration_s = tokens / ref_summary["mean_tokens_per_s"]
  reference, run = loss_curve(ref_dir), loss_curve(run_dir)
  per_fault = [{
      "injected": f["injected"], "kind": f["kind"], "rank": f["rank"], "slot": f["slot"],
      "detail": f["detail"], "detection_latency_s": f["detection_latency_s"],
      "diagnosis": {"self_check_s": f.get("diagnosis", {}).get("seconds"),
                    "excluded": f.get("diagnosis", {}).get("excluded")},
      "restart_s": f["restart_s"], "restore_step": f.get("restore_step"),
      "steps_lost": f.get("steps_lost")} for f in report["failures"]]
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
      "reference_wall_s": ref_wall,
      "reference_effective_training_time_rate": (_STEPS.value * iteration_s / ref_wall
                                                 if ref_wall else None),
      "max_detection_latency_s": max((f["detection_latency_s"] or 0) for f in per_fault),
      "loss_curve_vs_reference": compare(reference, run),
      "checkpoint_saves": summary["checkpoint_saves"],
      "restore_s": summary["restore_s"],
  }
  device = {"platform": "cpu", "processes": 2, "devices_per_process": 4,
            "spare_slots": _SPARES.value, "host_cpu_count": os.cpu_count()}
  path = results.write_record("fault_drill-" + ref_summary["config"], figures, device=device,
                              out_dir=_OUT_DIR.value,
                              extra={"reference_workdir": ref_dir, "workdir": run_dir})
  png = path[:-len(".json")] + ".png"
  plot(reference, run, report["failures"], png)
  print(json.dumps({k: v for k, v in figures.items() if k != "checkpoint_saves"}, indent=1))
  print(f"[drill] wrote {path} and {png}")


def _tokens_per_step(workdir: str) -> int:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  return round(first["tokens_per_s"] * first["step_time_s"])


if __name__ == "__main__":
  app.run(main)
