r"""Straggler + hang drill under the driver: clean steps, then a slow rank, then a hung rank.

  python -m experiments.observability_drill                      # 2 x 4 CPU devices, ~6 min
  python -m experiments.observability_drill --clean_steps=100 --num_processes=4 \
      --devices_per_process=2

Runs `experiments.launch` on a small GPT (the multi-process tests' shape) with
`--fault=slow:rank=1:factor=F:step=CLEAN+1` and `--fault=hang:rank=0:step=CLEAN+SLOW+1`, no
restart, and checks what the observability layer said: nobody flagged during the clean steps,
rank 1 flagged (which phase, since when, how many steps after the slowdown began), the hang
localised to rank 0 over the mesh coordinates. Writes results/observability_drill-*.json (the
detector's output, the hang localisation, the per-rank timeline summary) and copies the merged
heat-map to results/observability_drill-heatmap.png.
"""
import json
import os
import shutil
import time

from absl import app, flags

from experiments import job

_CLEAN = flags.DEFINE_integer("clean_steps", 300, "Fault-free steps before the slowdown.")
_SLOW = flags.DEFINE_integer("slow_steps", 30, "Steps with the slow rank before the hang.")
_FACTOR = flags.DEFINE_float("factor", 1.5, "Slowdown of rank 1 (its steps take F x as long).")
_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Worker processes.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "Devices per process.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder (default /tmp/observability_drill-"
                               "<time>).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Give up (and kill the job) after this.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the record and the heat-map "
                               "(default results/).")

MODEL_ARGS = job.TINY_GPT + ["--config.optimizer.warmup_steps=10"]


def main(argv):
  del argv
  from experiments import results
  clean, slow = _CLEAN.value, _SLOW.value
  steps = clean + slow + 10
  workdir = os.path.abspath(_WORKDIR.value or time.strftime("/tmp/observability_drill-%H%M%S"))
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  result = job.run(
      workdir, [f"--num_processes={_PROCESSES.value}",
                f"--devices_per_process={_DEVICES.value}", "--heartbeat_s=1",
                f"--fault=slow:rank=1:factor={_FACTOR.value}:step={clean + 1}",
                f"--fault=hang:rank=0:step={clean + slow + 1}", "--hang_timeout_s=10",
                "--max_restarts=0", "--status_every_s=60"],
      [*MODEL_ARGS, f"--config.train.steps={steps}", "--config.train.log_every=10",
       # One evaluation and save, at the end (never reached): a first multi-process orbax
       # save on this loaded machine once outlasted the driver's hang limit.
       f"--config.train.eval_every={steps}", f"--config.train.checkpoint_every={steps}"],
      timeout_s=_TIMEOUT.value, echo=True)
  if result.timed_out:
    raise SystemExit(f"[drill] the launcher timed out after {_TIMEOUT.value} s (killed); see "
                     f"{result.log}")
  wall = result.wall_s
  with open(os.path.join(workdir, "resilience", "report.json")) as f:
    report = json.load(f)
  with open(os.path.join(workdir, "timeline", "summary.json")) as f:
    timeline = json.load(f)
  obs = report["observability"]
  flags_ = obs["straggler_flags"]
  step_flags = [f for f in flags_ if f["unit"] == "step"]   # host-probe flags count rounds
  false_flags = [f for f in step_flags if f["since"] <= clean]
  slow_flags = [f for f in step_flags if f["since"] > clean]
  hangs = obs["hang_localisations"]
  figures = {
      "clean_steps": clean, "slow_steps": slow, "factor": _FACTOR.value,
      "flags_during_clean_steps": len(false_flags),
      "slow_rank_flagged": [f["rank"] for f in slow_flags] == [1],
      "flag": slow_flags[0] if slow_flags else None,
      "steps_from_slowdown_to_flag": (slow_flags[0]["at"] - clean) if slow_flags else None,
      "hang_odd_ranks": hangs[0]["odd_ranks"] if hangs else None,
      "hang_localisation": hangs[0] if hangs else None,
      "hang_detection_latency_s": report["failures"][0]["detection_latency_s"]
      if report["failures"] else None,
      "all_flags": flags_,
      "timeline_summary": timeline,
      "wall_s": wall,
  }
  out_dir = _OUT_DIR.value or os.path.join(results.REPO_ROOT, "results")
  os.makedirs(out_dir, exist_ok=True)
  png = os.path.join(out_dir, "observability_drill-heatmap.png")
  shutil.copy(os.path.join(workdir, "timeline", "heatmap.png"), png)
  path = results.write_record(
      "observability_drill", figures, out_dir=out_dir,
      extra={"workdir": workdir, "heatmap": os.path.relpath(png, results.REPO_ROOT),
             "note": "Tiny GPT (hidden 32, seq 32, batch 8) on 2 processes x 4 simulated CPU "
                     "devices of a shared 2-core machine; flags are the driver's "
                     "(mscale_jax/observability/observer.py), defaults threshold 0.1 of a step, "
                     "window 10 steps."},
      device={"platform": "cpu", "device_kind": "cpu", "process_count": _PROCESSES.value,
              "devices_per_process": _DEVICES.value, "host_cpu_count": os.cpu_count()})
  print(f"[drill] flags during the {clean} clean steps: {len(false_flags)}; slow rank flagged: "
        f"{figures['slow_rank_flagged']} ({figures['steps_from_slowdown_to_flag']} steps after "
        f"the slowdown); hang localised to ranks {figures['hang_odd_ranks']}")
  print(f"[drill] wrote {path} and {png}")


if __name__ == "__main__":
  app.run(main)
