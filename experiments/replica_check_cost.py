"""What the replica-consistency check before each save costs (mscale_jax/replicas.py).

  python -m experiments.replica_check_cost [--steps=60] [--checkpoint_every=10] [--restart]

Runs gpt_tiny as the fault drill does (2 processes x 4 CPU devices under the launcher, mesh
data=2 x tensor=4, so every parameter and optimizer state has one replica per process) and reads
process 0's per-save figures from its summary.json: the check's cost, `replica_check_s` +
`parts.verify_s` (dispatching the checksum program and the all-gather of the table across
processes at the save, plus reading its verdict on the save's launch thread, off the loop; the
run's last save checks on the loop, all in `replica_check_s`; the first save's includes compiling
the program), next to `stall_s` (how long the same save then held the loop) and the median step
time of the same run (its logged intervals, the first left out). With `--restart` the driver
kills process 1 half way (a `kill` fault) and restarts the group, as in the fault drill
(restored from the last checkpoint, executables from the per-process compile cache); the
figures are then those of the restarted group, whose first check is `first_check_s`.
"""
import json
import os
import statistics
import tempfile

from absl import app, flags

from experiments import job, results
from experiments.drill_accounting import train_step_served

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "experiments/configs/gpt_tiny.py", "Config file.")
flags.DEFINE_integer("steps", 60, "Training steps.")
flags.DEFINE_integer("checkpoint_every", 10, "Steps between saves (each save is checked).")
flags.DEFINE_bool("restart", False, "Kill process 1 half way; measure the restarted group.")
flags.DEFINE_string("workdir", None, "Run folder (default: a new temporary one).")
flags.DEFINE_string("out_dir", None, "Record folder (default: results/).")


def main(argv):
  del argv
  workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="replica_check_cost-")
  summary = _run(workdir)
  saves = summary["checkpoint_saves"]
  later = saves[1:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    logged = [json.loads(line) for line in f]
  # The first logged interval holds compiling; with --restart only steps past the kill are the
  # restarted group's alone.
  after = _kill_step() if FLAGS.restart else logged[0]["step"]
  step_s = statistics.median(r["step_time_s"] for r in logged if r["step"] > after)
  figures = {
      "saves": saves,
      "first_check_s": _check_s(saves[0]),
      "median_check_s": statistics.median(_check_s(s) for s in later),
      "median_stall_s": statistics.median(s["stall_s"] for s in later),
      "median_step_s": step_s,
      "mesh": summary["mesh"],
      "num_params": summary.get("num_params"),
  }
  if FLAGS.restart:
    figures["restarted"] = True
    figures["train_step"] = train_step_served(workdir)
  device = {"platform": "cpu", "processes": 2, "devices_per_process": 4,
            "host_cpu_count": os.cpu_count()}
  path = results.write_record("replica_check_cost-" + summary["config"], figures,
                              device=device, out_dir=FLAGS.out_dir,
                              extra={"workdir": workdir})
  print(json.dumps({k: v for k, v in figures.items() if k != "saves"}, indent=1))
  print(f"record: {path}")


def _check_s(save: dict) -> float:
  """A save's replica check: its dispatch on the loop and its verdict's wait off it."""
  return save["replica_check_s"] + save["parts"]["verify_s"]


def _run(workdir: str) -> dict:
  """Runs the job in `workdir` (with --restart: killed half way and restarted); the last
  group's summary.json."""
  train = [f"--config={FLAGS.config}", f"--config.train.steps={FLAGS.steps}",
           f"--config.train.checkpoint_every={FLAGS.checkpoint_every}",
           f"--config.train.log_every={FLAGS.checkpoint_every}",
           f"--config.train.eval_every={FLAGS.steps}"]
  launcher = ["--num_processes=2", "--devices_per_process=4", "--nostandby"]
  if FLAGS.restart:
    launcher += [f"--fault=kill:rank=1:step={_kill_step()}", "--max_restarts=1"]
  result = job.run(workdir, launcher, train, timeout_s=1200, echo=True)
  if result.status != 0:
    raise SystemExit(f"the run failed (status {result.status}):\n{result.tail()}")
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def _kill_step() -> int:
  """The step at which --restart kills process 1: half way, between two saves."""
  return FLAGS.steps // 2 + FLAGS.checkpoint_every // 2


if __name__ == "__main__":
  app.run(main)
