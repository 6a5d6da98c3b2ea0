"""Where a checkpoint save's stall goes: the time each save holds the training loop, by part.

  python -m experiments.save_stall [--steps=80] [--checkpoint_every=5] [--label=after]

Runs gpt_tiny as the fault drill does (2 processes x 4 CPU devices under the launcher, mesh
data=2 x tensor=4, an asynchronous save every `checkpoint_every` steps) and reads process 0's
per-save figures from its summary.json (mscale_jax/checkpoint.py, `Checkpointer.saves`):

  replica_check_s   the replica-consistency check before the save, on the loop
                    (callbacks/checkpointing.py; since its verdict is read off the loop,
                    dispatching its program)
  stall_s           how long `Checkpointer.save` then held the loop, split into `parts`:
    wait_previous_s   waiting for the previous save's background write
    agree_s           the write probe and every process's agreement that the save can start
    copy_s            copying the state into fresh device buffers, starting the launch thread
  and, on the launch thread, off the loop:
    verify_s          reading the replica check's verdict
    orbax_s           orbax's synchronous part, of which orbax_barriers_s (its barriers between
                      processes) and orbax_d2h_s (the device-to-host copy)

Process 0's figures hold the skew between processes too: the first wait for every process in a
save (the check's all-gather, or the agreement) waits for the process that came to it last,
which without the save would have waited at the next step instead. So `held_s` is taken from every rank's timeline
(its `checkpoint_stall` spans: the check plus the stall), per save the shortest of the ranks'
(the last to come waited for no one): what the save itself cost the job; `skew_s` is how far
apart the ranks came to it. `loop_per_step_s` is rank 0's time from the first save's end to
the last's, per step: steps and saves together (a background write that slowed the steps
beside it would show there). The first save is left out of the medians and means (it compiles
the check's program and orbax's barrier). The record also names the cadence at which
checkpoint stalls plus the replay after faults cost the drill least (`cheapest_cadence`, from
the mean `held_s` and this run's step time).
"""
import glob
import json
import math
import os
import statistics
import tempfile

from absl import app, flags

from experiments import job, results
# The parts Checkpointer.saves splits a save into (mscale_jax/checkpoint.py, STALL_PARTS); the
# figures name those the measured code recorded, so an older tree can be measured too.
STALL_PARTS = ("wait_previous_s", "agree_s", "copy_s", "verify_s", "orbax_s",
               "orbax_barriers_s", "orbax_d2h_s")

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("config", "experiments/configs/gpt_tiny.py", "Config file.")
  flags.DEFINE_integer("steps", 80, "Training steps.")
  flags.DEFINE_integer("checkpoint_every", 5, "Steps between saves.")
  flags.DEFINE_float("faults_per_hour", 36.0, "Fault rate of the drill (for the cadence).")
  flags.DEFINE_string("label", "", "Names the code measured in the record (before/after).")
  flags.DEFINE_string("workdir", None, "Run folder (default: a new temporary one).")
  flags.DEFINE_string("out_dir", None, "Record folder (default: results/).")

def main(argv):
  del argv
  workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="save_stall-")
  summary = _run(workdir)
  saves = summary["checkpoint_saves"]
  spans = _stall_spans(workdir)
  for s in saves:
    ranks = spans[s["step"]]
    s["held_s"] = min(end - start for start, end in ranks)
    s["skew_s"] = max(start for start, _ in ranks) - min(start for start, _ in ranks)
  later = saves[1:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    logged = [json.loads(line) for line in f]
  step_s = statistics.median(r["step_time_s"] for r in logged[1:])
  # Steps and saves together, past the first save (rank 0): what the background write costs
  # the steps beside it shows here, not in `held_s`.
  first, last = min(spans), max(spans)
  per_step_s = (spans[last][0][1] - spans[first][0][1]) / (last - first)

  def summarize(values):
    values = list(values)
    return {"mean": statistics.mean(values), "median": statistics.median(values),
            "max": max(values)}

  figures = {
      "label": FLAGS.label,
      "saves": saves,
      "held_s": summarize(s["held_s"] for s in later),
      "skew_s": summarize(s["skew_s"] for s in later),
      "replica_check_s": summarize(s.get("replica_check_s", 0.0) for s in later),
      "stall_s": summarize(s["stall_s"] for s in later),
      "parts": {p: summarize(s["parts"][p] for s in later)
                for p in STALL_PARTS if all(p in s.get("parts", {}) for s in later)},
      "median_step_s": step_s,
      "loop_per_step_s": per_step_s,
      "cadence": cadence_costs(statistics.mean(s["held_s"] for s in later), step_s,
                               FLAGS.faults_per_hour),
      "mesh": summary["mesh"],
  }
  device = {"platform": "cpu", "processes": 2, "devices_per_process": 4,
            "host_cpu_count": os.cpu_count()}
  path = results.write_record("save_stall-" + summary["config"], figures, device=device,
                              out_dir=FLAGS.out_dir, extra={"workdir": workdir})
  print(json.dumps({k: v for k, v in figures.items() if k != "saves"}, indent=1))
  print(f"record: {path}")


def cadence_costs(held_s: float, step_s: float, faults_per_hour: float) -> dict:
  """Overhead per training second of saving every k steps: the saves' stalls (`held_s` every k
  steps of `step_s`) plus the replay after each fault (k/2 steps on average, at
  `faults_per_hour`), for k = 1..20; and the k where it is least."""
  def overhead(k):
    return held_s / (k * step_s) + faults_per_hour / 3600 * k / 2 * step_s
  table = {k: overhead(k) for k in range(1, 21)}
  best = min(table, key=table.get)
  return {"overhead_per_second": table, "cheapest_cadence": best,
          "continuous_optimum": math.sqrt(2 * held_s * 3600 / faults_per_hour) / step_s}


def _stall_spans(workdir: str) -> dict[int, list[tuple[float, float]]]:
  """{step: [(start, end) of its `checkpoint_stall` span on each rank]} from the timeline
  (every rank's clock is this machine's)."""
  spans = {}   # rank 0's first
  for path in sorted(glob.glob(os.path.join(workdir, "timeline", "rank*.jsonl"))):
    with open(path) as f:
      for record in map(json.loads, f):
        if record.get("name") == "checkpoint_stall":
          spans.setdefault(record["step"], []).append((record["start"], record["end"]))
  return spans


def _run(workdir: str) -> dict:
  """Runs the job in `workdir`; its summary.json."""
  train = [f"--config={FLAGS.config}", f"--config.train.steps={FLAGS.steps}",
           f"--config.train.checkpoint_every={FLAGS.checkpoint_every}",
           f"--config.train.log_every={FLAGS.checkpoint_every}",
           f"--config.train.eval_every={FLAGS.steps}"]
  launcher = ["--num_processes=2", "--devices_per_process=4", "--nostandby"]
  result = job.run(workdir, launcher, train, timeout_s=1200, echo=False)
  if result.status != 0:
    raise SystemExit(f"the run failed (status {result.status}):\n{result.tail()}")
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


if __name__ == "__main__":
  define_flags()
  app.run(main)
