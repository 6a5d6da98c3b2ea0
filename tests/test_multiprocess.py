"""Real multi-process runs (2 processes x 4 CPU devices over gloo) under the driver.

Few and tiny: each run compiles the model in every process. Every launcher runs in its own
session; afterwards every process left in that session is killed, and a test fails if any was.
"""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_ARGS = ["--config=experiments/configs/gpt_tiny.py", "--config.train.steps=12",
              "--config.train.log_every=1", "--config.train.eval_every=12",
              "--config.train.checkpoint_every=4", "--config.optimizer.warmup_steps=1",
              "--config.model.hidden=32", "--config.model.mlp_dim=64",
              "--config.model.seq_len=32", "--config.train.global_batch=8",
              "--config.data.prefetch=0"]
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _session_processes(sid: int) -> list[int]:
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[3]) == sid and fields[0] != "Z":   # fields[3]: session id
        pids.append(int(entry))
  return pids


def launch(workdir, *flags, timeout=240):
  """Runs the launcher to the end; returns (exit status, output, report). Kills leftovers."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.launch", f"--workdir={workdir}", "--heartbeat_s=0.5",
       f"--xla_flags={FAST_XLA}", *flags, "--", *TRAIN_ARGS],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      start_new_session=True)
  try:
    output, _ = proc.communicate(timeout=timeout)
  finally:
    leftovers = _session_processes(proc.pid)
    for pid in leftovers:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    proc.kill()
    proc.wait()
  assert not leftovers, f"processes left behind: {leftovers}\n{output[-3000:]}"
  with open(os.path.join(workdir, "resilience", "report.json")) as f:
    return proc.returncode, output, json.load(f)


def losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  steps = [r["step"] for r in records]
  assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
  return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The fault-free run: 2 processes x 4 devices, mesh data=2 x tensor=4."""
  workdir = tmp_path_factory.mktemp("reference")
  status, output, report = launch(workdir, "--nostandby")
  assert status == 0 and report["completed"] and report["failures"] == [], output[-3000:]
  return losses(workdir)


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


def test_kills_mid_run_and_mid_save_are_recovered_exactly(reference, tmp_path):
  status, output, report = launch(
      tmp_path, "--fault=kill:rank=1:step=6", "--fault=kill:rank=0:step=8:at=save",
      "--noself_check")
  assert status == 0 and report["completed"], output[-3000:]
  kinds = [(f["kind"], f["rank"], f["injected"]) for f in report["failures"]]
  assert kinds == [("exited", 1, "kill:rank=1:step=6:at=step"),
                   ("exited", 0, "kill:rank=0:step=8:at=save")], output[-3000:]
  kill, save_kill = report["failures"]
  assert "signal 9" in kill["detail"] and kill["detection_latency_s"] < 5
  assert kill["restore_step"] in (0, 4)   # 4 unless its background write was still going
  # Killed while step 8's save was being written: that checkpoint never became complete.
  assert save_kill["restore_step"] == 4 and save_kill["detection_latency_s"] < 5
  resumed = losses(tmp_path)
  assert sorted(resumed) == list(range(1, 13))
  np.testing.assert_allclose([resumed[s] for s in reference], list(reference.values()),
                             rtol=1e-5)


def test_a_hang_is_detected_and_a_bad_slot_excluded(reference, tmp_path):
  status, output, report = launch(tmp_path, "--fault=hang:rank=1:step=7",
                                  "--fault=bad_slot:slot=1", "--hang_timeout_s=4",
                                  "--hang_step_factor=1")
  assert status == 0 and report["completed"], output[-3000:]
  (hang,) = report["failures"]
  assert hang["kind"] == "hang" and hang["injected"] == "hang:rank=1:step=7"
  # Declared once 4 s (the configured timeout) passed without a new step; the latency is
  # counted from the injection, which may come a little after the last step was reported.
  assert 2 < hang["detection_latency_s"] < 4 + 5
  assert list(report["excluded_slots"]) == ["1"]
  assert "corrupt" in report["excluded_slots"]["1"]
  # The restarted group (warm standbys) self-checks, fails slot 1 and exits before training;
  # the next starts without it. Both checks are the hang's diagnosis.
  assert [(a["slots"], a["failure"], a["warm_processes"]) for a in report["attempts"]] == [
      ([0, 1], "hang", 0), ([0, 1], "self_check_failed", 2), ([0], None, 0)]
  assert list(hang["diagnosis"]["excluded"]) == ["1"]
  assert [c["slots"] for c in hang["diagnosis"]["checks"]] == [[0, 1], [0]]
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  assert summary["mesh"] == {"data": 1, "fsdp": 1, "stage": 1, "tensor": 4}
  # Same global batches on half the processes (restored resharded): the same curve, up to
  # float32 reduction order.
  resumed = losses(tmp_path)
  assert sorted(resumed) == list(range(1, 13))
  np.testing.assert_allclose([resumed[s] for s in reference], list(reference.values()),
                             rtol=1e-4)
