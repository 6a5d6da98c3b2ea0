"""Real multi-process runs (2 processes x 4 CPU devices over gloo) under the driver.

Few and tiny: each attempt compiles the model in every process. Three launcher runs, through
experiments/job.py (its own session, a hard timeout, everything it leaves killed): the
fault-free reference, one run through three failures and a bad slot, and one whose bad slot
corrupts training until a save's replica check refuses it. Every test here is
`slow` (scripts/test.sh --fast leaves them out).
"""
import json

import numpy as np
import pytest

from experiments import job

pytestmark = pytest.mark.slow

TRAIN_ARGS = job.TINY_GPT + ["--config.train.steps=12", "--config.train.log_every=1",
                             "--config.train.eval_every=12", "--config.train.checkpoint_every=4",
                             "--config.optimizer.warmup_steps=1"]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """One compilation cache for this module's launcher runs (each run's default is its own, in
  its workdir): they train the same model on the same meshes, so only the first compiles."""
  return str(tmp_path_factory.mktemp("compile_cache"))


def launch(workdir, compile_cache, *flags, timeout_s=300):
  """Runs the launcher to the end: it must exit by itself and leave no process behind."""
  result = job.run(workdir, ["--heartbeat_s=0.5", f"--xla_flags={job.TEST_XLA}",
                             f"--compile_cache_dir={compile_cache}", *flags],
                   TRAIN_ARGS, timeout_s=timeout_s)
  assert not result.timed_out, result.tail()
  assert not result.leftovers, f"processes left behind: {result.leftovers}\n{result.tail()}"
  return result


def losses(workdir) -> dict[int, float]:
  with open(workdir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  steps = [r["step"] for r in records]
  assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
  return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, compile_cache):
  """The fault-free run: 2 processes x 4 devices, mesh data=2 x tensor=4."""
  workdir = tmp_path_factory.mktemp("reference")
  result = launch(workdir, compile_cache, "--nostandby")
  report = result.report
  assert result.status == 0 and report["completed"] and report["failures"] == [], result.tail()
  return losses(workdir)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, compile_cache):
  """One run through every kind of recovery, attempt by attempt:

    0  slots [0, 1]  rank 1 is killed (kill -9) before step 6: restart from step 4
    1  slots [0, 1]  (warm standbys) the self-check fails slot 1 (bad_slot: since step 5 what
                     its process receives is corrupt): start without it
    2  slot [0]      (a warm standby) the job shrinks to data=1; rank 0 is killed while step
                     8's save is being written: restart from step 4 again (step 8's
                     checkpoint never completed)
    3  slot [0]      the self-check passes; rank 0 hangs before step 10: restart from step 8
    4  slot [0]      completes
  """
  workdir = tmp_path_factory.mktemp("faulty")
  result = launch(workdir, compile_cache, "--fault=kill:rank=1:step=6",
                  "--fault=bad_slot:slot=1:step=5",
                  "--fault=kill:rank=0:step=8:at=save", "--fault=hang:rank=0:step=10",
                  "--hang_timeout_s=4", "--hang_step_factor=1", timeout_s=420)
  assert result.status == 0 and result.report["completed"], result.tail()
  return workdir, result


def test_two_processes_equal_one_process(reference, tmp_path):
  from experiments.configs import gpt_tiny
  from mscale_jax.config import Config
  from mscale_jax.train import Trainer
  config = gpt_tiny.get_config()
  for arg in TRAIN_ARGS[1:]:
    key, value = arg[len("--config."):].split("=")
    section, field = key.split(".")
    config[section][field] = type(config[section][field])(value)
  trainer = Trainer(Config.from_dict(config.to_dict()), str(tmp_path), show_progress=False)
  assert dict(trainer.mesh.shape) == {"data": 2, "fsdp": 1, "stage": 1, "tensor": 4}
  trainer.train()
  single = losses(tmp_path)
  assert sorted(single) == sorted(reference) == list(range(1, 13))
  np.testing.assert_allclose([reference[s] for s in single], list(single.values()), rtol=1e-5)
  assert len(set(single.values())) > 6   # a curve, not a constant


def test_kills_mid_run_and_mid_save_are_detected_and_restored(faulty):
  workdir, result = faulty
  failures = result.report["failures"]
  assert [(f["kind"], f["rank"], f["injected"]) for f in failures] == [
      ("exited", 1, "kill:rank=1:step=6:at=step"), ("exited", 0, "kill:rank=0:step=8:at=save"),
      ("hang", 0, "hang:rank=0:step=10")], result.tail()
  kill, save_kill, _ = failures
  assert "signal 9" in kill["detail"] and kill["detection_latency_s"] < 5
  assert kill["restore_step"] in (0, 4)   # 4 unless its background write was still going
  # Killed while step 8's save was being written: that checkpoint never became complete.
  assert "signal 9" in save_kill["detail"] and save_kill["detection_latency_s"] < 5
  assert save_kill["restore_step"] == 4


def test_a_hang_is_detected_and_restored(faulty):
  workdir, result = faulty
  hang = result.report["failures"][2]
  # Declared once 4 s (the configured timeout) passed without a new step; the latency is
  # counted from the injection, which may come a little after the last step was reported.
  assert 2 < hang["detection_latency_s"] < 4 + 5, hang
  assert hang["restore_step"] == 8


def test_a_bad_slot_is_excluded_and_the_job_shrinks(faulty):
  workdir, result = faulty
  report = result.report
  assert list(report["excluded_slots"]) == ["1"]
  assert "corrupt" in report["excluded_slots"]["1"]
  # The group restarted after the first kill (from warm standbys) self-checks, fails slot 1
  # and exits before training; the next starts without it, warm too (standbys are refilled
  # once a group trains, so with self-checks the pool holds two groups' processes). Both
  # checks are the kill's diagnosis.
  assert [(a["slots"], a["failure"], a["warm_processes"]) for a in report["attempts"]] == [
      ([0, 1], "exited", 0), ([0, 1], "self_check_failed", 2), ([0], "exited", 1),
      ([0], "hang", 1), ([0], None, 1)]
  kill = report["failures"][0]
  assert list(kill["diagnosis"]["excluded"]) == ["1"]
  assert [c["slots"] for c in kill["diagnosis"]["checks"]] == [[0, 1], [0]]
  with open(workdir / "summary.json") as f:
    assert json.load(f)["mesh"] == {"data": 1, "fsdp": 1, "stage": 1, "tensor": 4}


def test_the_recovered_curve_equals_the_fault_free_one(reference, faulty):
  # Same global batches on half the processes (restored resharded after every failure): the
  # same curve, each step logged once, up to float32 reduction order (data=1 vs data=2).
  workdir, _ = faulty
  resumed = losses(workdir)
  assert sorted(resumed) == list(range(1, 13))
  np.testing.assert_allclose([resumed[s] for s in reference], list(reference.values()),
                             rtol=1e-4)


def test_silent_corruption_is_caught_at_save_and_the_curve_stays_fault_free(reference,
                                                                             compile_cache,
                                                                             tmp_path):
  """bad_slot from step 6: what slot 1's process holds after each step is corrupt, so the two
  data replicas of the parameters diverge. Step 8's save refuses them (replica_divergence), the
  job restarts from step 4, the restart's self-check excludes slot 1 and the spare takes its
  place: the curve is the fault-free one, bit for bit (same mesh, same batches)."""
  result = launch(tmp_path, compile_cache, "--fault=bad_slot:slot=1:step=6",
                  "--spare_slots=1", timeout_s=420)
  report = result.report
  assert result.status == 0 and report["completed"], result.tail()
  [failure] = report["failures"]
  assert failure["kind"] == "replica_divergence" and failure["step"] == 8, failure
  assert failure["injected"] == "bad_slot:slot=1:step=6" and failure["detection_latency_s"] > 0
  assert "no majority among processes [0, 1]" in failure["detail"]
  assert failure["restore_step"] == 4
  assert list(report["excluded_slots"]) == ["1"]
  assert [(a["slots"], a["failure"]) for a in report["attempts"]] == [
      ([0, 1], "replica_divergence"), ([0, 1], "self_check_failed"), ([0, 2], None)]
  assert losses(tmp_path) == reference
