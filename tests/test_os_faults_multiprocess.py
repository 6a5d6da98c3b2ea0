"""Faults from outside the training code on real multi-process runs (2 processes x 4 CPU devices
under the driver), through experiments/job.py: its own session, a hard timeout, everything left
behind killed. Two launcher runs: one through a stopped worker, a read-only checkpoint directory
and a corrupted checkpoint; one whose driver is killed and then run again. All `slow`.
"""
import json
import os

import pytest

from experiments import job

pytestmark = pytest.mark.slow

TRAIN_ARGS = job.TINY_GPT + ["--config.train.steps=16", "--config.train.log_every=1",
                             "--config.train.eval_every=16", "--config.train.checkpoint_every=4",
                             "--config.optimizer.warmup_steps=1"]
FLAGS = ["--heartbeat_s=0.5", f"--xla_flags={job.TEST_XLA}", "--hang_timeout_s=4",
         "--hang_step_factor=1", "--nostandby", "--noself_check"]


@pytest.fixture(scope="module")
def compile_cache_flag(tmp_path_factory):
  """One compilation cache for this module's launcher runs (each run's default is its own, in
  its workdir): they train the same model on the same mesh, so only the first compiles."""
  return f"--compile_cache_dir={tmp_path_factory.mktemp('compile_cache')}"


def logged_steps(workdir) -> list[int]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f]


def test_stop_io_error_and_a_corrupt_checkpoint_are_recovered(compile_cache_flag, tmp_path):
  """  0  rank 1 is stopped (SIGSTOP) at step 3: a hang, blamed on rank 1
       1  the checkpoint folder turns read-only once both ranks reached step 5: the save whose
          write is then in flight, or the next, is refused (step 4's background write, 8's or
          12's: the driver acts from outside, on heartbeats half a second apart, so where
          between saves it lands varies), and perhaps the one after it; both ranks drop them
          and train on, the driver hears of it and makes the folder writable again: no restart
       2  at step 14 the newest checkpoint is corrupted on disk and rank 0 killed
       3  the restart finds the checksum wrong, sets it aside, restores the one before (not the
          refused one); completes
  """
  result = job.run(str(tmp_path), [*FLAGS, compile_cache_flag, "--fault=stop:rank=1:step=3",
                                   "--fault=io_error:step=5",
                                   "--fault=corrupt_checkpoint:rank=0:step=14"],
                   TRAIN_ARGS, timeout_s=480)
  assert not result.timed_out and not result.leftovers, result.tail()
  report = result.report
  assert result.status == 0 and report["completed"], result.tail()
  assert len(report["failures"]) == 2, (report["failures"], result.tail())
  stop, corrupt = report["failures"]
  assert stop["injected"] == "stop:rank=1:step=3" and stop["rank"] == 1, stop
  # The folder turns read-only from outside while saves go on in the background: the save then
  # in flight (step 4's write) or the next one (8's, or 12's) is refused, and the one after it
  # may be too before the driver, hearing of the first, makes the folder writable again.
  refusals = report["recovered_in_process"]
  refused = [r["step"] for r in refusals]
  assert refused in ([4], [8], [12], [4, 8], [8, 12]), refusals
  assert refusals[0]["injected"] == "io_error:rank=0:step=5:seconds=0.0", refusals
  for io in refusals:
    assert io["kind"] == "save_refused" and sorted(io["ranks"]) == [0, 1], io
    assert io["attempt"] == stop["attempt"] + 1 == corrupt["attempt"], io   # no restart
    assert f"checkpoint step {io['step']} could not be written" in io["detail"], io
    latest = max([s for s in (4, 8) if s < io["step"] and s not in refused], default=None)
    assert (f"latest complete checkpoint is still step {latest}," if latest else
            "no complete checkpoint yet") in io["detail"], io
  assert corrupt["injected"] == "corrupt_checkpoint:rank=0:step=14"
  assert (corrupt["kind"], corrupt["rank"]) == ("exited", 0)
  # The newest checkpoint with a manifest when the fault fired (12, or 8 if 12's background
  # write was still going) fails its checksum: the restart restores the newest complete one
  # before it (none: from scratch), the refused saves being none.
  marker = json.loads((tmp_path / "resilience" / "faults" /
                       "2-corrupt_checkpoint-driver.json").read_text())
  corrupted = int(marker["checkpoint"])
  assert corrupted not in refused
  assert corrupt["restore_step"] == max(
      [s for s in (4, 8) if s < corrupted and s not in refused], default=0)
  aside = os.listdir(tmp_path / "checkpoints_corrupt")
  assert len(aside) == 1 and aside[0].startswith(f"{corrupted}-")
  logs = "".join(open(tmp_path / "logs" / f"attempt{report['attempts'][-1]['attempt']}"
                      f"-rank0.log").readlines())
  assert f"checkpoint step {corrupted} is corrupt" in logs
  assert logged_steps(tmp_path) == list(range(1, 17))


def test_a_killed_driver_is_resumed_by_the_same_command(compile_cache_flag, tmp_path):
  flags = [*FLAGS, compile_cache_flag, "--fault=kill_driver:step=5"]
  first = job.run(str(tmp_path), flags, TRAIN_ARGS, timeout_s=300, keep_orphans=True)
  try:
    assert first.status == -9, first.tail()
    assert first.leftovers, "the dead driver's workers should still run"
    second = job.run(str(tmp_path), flags, TRAIN_ARGS, timeout_s=300)
    assert not second.timed_out and not second.leftovers, second.tail()
    assert all(not os.path.exists(f"/proc/{pid}") or
               open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
               for pid in first.leftovers), "the second driver must end the first one's workers"
  finally:
    job.end_session(first.session)
  report = second.report
  assert second.status == 0 and report["completed"], second.tail()
  [lost] = report["failures"]
  assert lost["kind"] == "driver_lost" and lost["injected"] == "kill_driver:step=5"
  assert lost["restore_step"] in (4, 8, 12)   # the orphaned workers train on until ended
  assert [a["failure"] for a in report["attempts"]] == ["driver_lost", None]
  assert logged_steps(tmp_path) == list(range(1, 17))   # no step twice, none missing
