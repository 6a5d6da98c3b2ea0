"""What a restarted group pays from its start to its first step, with one start-up saving and
without it (`--compare`):

  pre_key             the compile cache's pre-key (mscale_jax/compile_cache.py: the train step
                      found before tracing it); off: MSCALE_COMPILE_CACHE_PREKEY=0
  overlapped_restore  the train step loaded on a thread of its own while the checkpoint is
                      restored (mscale_jax/train.py `Trainer._start`, MSCALE_OVERLAPPED_RESTORE=1;
                      off by default), against the load after the restore. With it,
                      `compile_or_cache_load_s` is only the wait for the load after the restore

  python -m experiments.restart_cost [--compare=pre_key] [--trials=3] [--steps=24]
      [--checkpoint_every=8]

Runs gpt_tiny as the fault drill does (2 processes x 4 CPU devices under the launcher, no warm
standbys), with one compile-cache folder for every run: a first run fills it, then each trial
runs the job twice, once per arm in alternating order, killing process 1 between two saves
(a `kill` fault) so that the driver restarts the group from the last checkpoint. Without the
pre-key every process traces and lowers its programs to key the cache, then loads, as before
the pre-key. Per restart, rank 0's timeline
gives the group's start to the end of its first step and its parts, the group's self-check
among them (experiments/drill_accounting.py `restart_phases`), and `after_start_up_s`, the
same without Python's and JAX's start-up (the noisiest part, untouched by the pre-key); rank
0's log says how the cache served the train step; `first_check_s` is the restarted group's
first replica check (its program is pre-keyed too). `saved_per_restart_s`: per trial, the
arm without the saving minus the arm with it.
"""
import json
import os
import statistics
import tempfile

from absl import app, flags

from experiments import job, results
from experiments.drill_accounting import restart_phases, train_step_served
from mscale_jax.compile_cache import PRE_KEY_SWITCH
from mscale_jax.train import OVERLAP_SWITCH

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "experiments/configs/gpt_tiny.py", "Config file.")
flags.DEFINE_enum("compare", "pre_key", ["pre_key", "overlapped_restore"],
                  "The start-up saving measured (its arm with it, then without).")
flags.DEFINE_integer("trials", 3, "Restarts measured per arm (the arms alternate).")
flags.DEFINE_integer("steps", 24, "Training steps per run (more than the warm-up).")
flags.DEFINE_integer("checkpoint_every", 8, "Steps between saves.")
flags.DEFINE_string("workdir", None, "Folder of the runs (default: a new temporary one).")
flags.DEFINE_string("out_dir", None, "Record folder (default: results/).")

# Per comparison, its arms' environments: with the saving first, then without.
COMPARISONS = {
    "pre_key": {"pre_key": {}, "no_pre_key": {PRE_KEY_SWITCH: "0"}},
    "overlapped_restore": {"overlapped": {OVERLAP_SWITCH: "1"}, "sequential": {OVERLAP_SWITCH: "0"}},
}
PARTS = ("start_to_first_step_s", "after_start_up_s", "process_start_s", "self_check_s",
         "restore_s", "compile_or_cache_load_s", "first_step_s", "first_check_s")


def main(argv):
  del argv
  arms = COMPARISONS[FLAGS.compare]
  workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="restart_cost-")
  cache = os.path.join(workdir, "compile_cache")
  _restart(os.path.join(workdir, "fill"), cache, {})   # fills the cache: not counted
  restarts = []
  for trial in range(FLAGS.trials):
    order = list(arms) if trial % 2 == 0 else list(arms)[::-1]
    for arm in order:
      restarts.append({"trial": trial, "arm": arm,
                       **_restart(os.path.join(workdir, f"{trial}-{arm}"), cache, arms[arm],
                                  arm)})
  figures = {"compare": FLAGS.compare, "restarts": restarts}
  for arm in arms:
    mine = [r for r in restarts if r["arm"] == arm]
    figures[arm] = {f"median_{p}": statistics.median(r[p] for r in mine) for p in PARTS}
    figures[arm]["train_step_served"] = sorted({r["train_step_served"] for r in mine})
  figures["saved_per_restart_s"] = _saved(restarts, "start_to_first_step_s", *arms)
  figures["saved_after_start_up_s"] = _saved(restarts, "after_start_up_s", *arms)
  device = {"platform": "cpu", "processes": 2, "devices_per_process": 4,
            "host_cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
  name = "restart_cost-" + ("" if FLAGS.compare == "pre_key" else FLAGS.compare + "-")
  path = results.write_record(name + os.path.basename(FLAGS.config)[:-3], figures,
                              device=device, out_dir=FLAGS.out_dir,
                              extra={"workdir": workdir, "steps": FLAGS.steps,
                                     "checkpoint_every": FLAGS.checkpoint_every,
                                     "kill_step": _kill_step()})
  for arm in arms:
    print(arm, figures[arm])
  print("saved per restart (s):", figures["saved_per_restart_s"])
  print("saved after start-up (s):", figures["saved_after_start_up_s"])
  print(f"record: {path}")


def _restart(workdir: str, cache: str, env: dict, arm: str = "fill") -> dict:
  """One run killed once and restarted; the restarted group's phases (rank 0)."""
  train = [f"--config={FLAGS.config}", f"--config.train.steps={FLAGS.steps}",
           f"--config.train.checkpoint_every={FLAGS.checkpoint_every}",
           "--config.train.log_every=1", f"--config.train.eval_every={FLAGS.steps}"]
  launcher = ["--num_processes=2", "--devices_per_process=4", "--nostandby",
              f"--compile_cache_dir={cache}", f"--fault=kill:rank=1:step={_kill_step()}",
              "--max_restarts=1"]
  result = job.run(workdir, launcher, train, timeout_s=900, echo=False, env=env)
  if result.status != 0:
    raise SystemExit(f"the run in {workdir} failed (status {result.status}):\n{result.tail()}")
  phases = restart_phases(result.report, workdir)
  if not phases:
    raise SystemExit(f"no restart in {workdir}'s timeline")
  restarted = phases[-1]
  # Without Python's and JAX's start-up (the noisiest part, the same in both arms): from the
  # worker's timeline (the trainer built) to its first step's end.
  restarted["after_start_up_s"] = (restarted["start_to_first_step_s"] -
                                   restarted["process_start_s"] -
                                   (restarted["self_check_s"] or 0.0))
  with open(os.path.join(workdir, "summary.json")) as f:   # the restarted group's
    restarted["first_check_s"] = json.load(f)["checkpoint_saves"][0]["replica_check_s"]
  print(f"[{arm}] {restarted['start_to_first_step_s']:.2f} s to the first step "
        f"(compile or load {restarted['compile_or_cache_load_s']:.2f} s)", flush=True)
  return {**{p: restarted[p] for p in PARTS}, "train_step_served": train_step_served(workdir)}


def _saved(restarts: list[dict], part: str, with_it: str, without: str) -> dict:
  """`part` in the arm without the saving minus the arm with it, per trial, and their median."""
  per_trial = [off[part] - on[part] for off, on in zip(
      *([r for r in restarts if r["arm"] == arm] for arm in (without, with_it)))]
  return {"median": statistics.median(per_trial), "per_trial": per_trial}


def _kill_step() -> int:
  """Half way between the last two saves."""
  return FLAGS.steps - FLAGS.checkpoint_every // 2


if __name__ == "__main__":
  app.run(main)
