"""The generated Slurm batch script, run by a real Slurm (scripts/slurm_local.sh: Debian's
slurmctld, slurmd and munge on this machine, one node, several task slots).

As root (CI) the session fixture installs and starts the daemons once and stops them at the
end; without root every test here is skipped, saying why. Each job has a hard timeout (and is
scancelled past it); no job, step or worker may outlive its test.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from experiments import job
from mscale_jax.resilience.driver.supervisor import free_port

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(job.REPO, "scripts", "slurm_local.sh")
TRAIN = job.TINY_GPT + ["--config.train.steps=12", "--config.train.log_every=1",
                        "--config.train.eval_every=12", "--config.train.checkpoint_every=4",
                        "--config.optimizer.warmup_steps=1"]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
  """The environment for Slurm's clients (SLURM_CONF) while the one-node Slurm runs."""
  if os.geteuid() != 0:
    pytest.skip("a real Slurm needs root (scripts/slurm_local.sh installs and runs slurmd); "
                "CI runs these as root")
  state = tmp_path_factory.mktemp("slurm")
  env = dict(os.environ, MSCALE_SLURM_DIR=str(state), MSCALE_SLURM_PORT=str(_free_pair()))
  started = subprocess.run([SCRIPT, "start"], env=env, capture_output=True, text=True,
                           timeout=600)
  try:
    assert started.returncode == 0, started.stderr[-3000:]
    # The jobs share one compilation cache (each job's default is its own, in its workdir).
    yield dict(env, SLURM_CONF=str(state / "slurm.conf"),
               MSCALE_COMPILE_CACHE=str(tmp_path_factory.mktemp("compile_cache")))
  finally:
    subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, timeout=120)
    for name in ("slurmd.pid", "slurmctld.pid"):
      assert not (state / name).exists(), f"{name} left behind"


def _free_pair() -> int:
  while True:
    port = free_port()
    if port < 65000 and free_port_is(port + 1):
      return port


def free_port_is(port: int) -> bool:
  import socket
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
      return True
    except OSError:
      return False


def sbatch(slurm, workdir, *launch_flags, timeout_s=420, heartbeat_port=None):
  """Emits the batch script, submits it with `sbatch` and waits for the job to end (`wait_for`);
  returns (exit status, its log)."""
  emitted = subprocess.run(
      [sys.executable, "-m", "experiments.launch", "--emit=slurm", f"--workdir={workdir}",
       "--num_processes=2", "--devices_per_process=4", "--tasks_per_node=2",
       "--nocluster_gpus", f"--coordinator_port={free_port()}",
       f"--heartbeat_port={heartbeat_port or free_port()}", "--heartbeat_s=0.5",
       f"--xla_flags={job.TEST_XLA}",
       *launch_flags, "--", *TRAIN], cwd=job.REPO, env=dict(slurm, PYTHONPATH=job.REPO),
      capture_output=True, text=True, timeout=120)
  assert emitted.returncode == 0, emitted.stderr[-2000:]
  script = emitted.stdout.split()[-1]
  submitted = subprocess.run(["sbatch", "--parsable", script], env=slurm, capture_output=True,
                             text=True, timeout=60)
  assert submitted.returncode == 0, submitted.stderr[-2000:]
  job_id = submitted.stdout.split()[0].split(";")[0]
  status = wait_for(slurm, job_id, timeout_s)
  if status is None:
    subprocess.run(["scancel", "--full", job_id], env=slurm, timeout=60)
  with open(os.path.join(workdir, f"slurm-{job_id}.log")) as f:
    log = f.read()
  assert status is not None, f"timed out\n{log[-3000:]}"
  assert not _steps_left(slurm, job_id), f"steps left behind: {_steps_left(slurm, job_id)}"
  assert not _workers_of(workdir), "worker processes left behind"
  return status, log


# Job states in which slurmctld has retired a job (its steps and batch script ended).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE", "OUT_OF_MEMORY"}


def wait_for(slurm, job_id: str, timeout_s: float) -> int | None:
  """The job's exit status once slurmctld lists it as finished, as `sbatch --wait` reports it
  (the batch script's exit status; 1 if a signal ended it); None past `timeout_s`. Polls
  `scontrol show job` twice a second: `sbatch --wait` polls after 2, 10, 42, 74, ... s (its
  interval grows fourfold up to 32 s while under half of MinJobAge), so a job that ends after
  15 s is seen ended at 42."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=slurm,
                           capture_output=True, text=True, timeout=60).stdout
    fields = dict(field.split("=", 1) for field in shown.split() if "=" in field)
    if fields.get("JobState") in FINISHED:
      code, signal = map(int, fields["ExitCode"].split(":"))
      return 1 if signal else code
    time.sleep(0.5)
  return None


def _steps_left(slurm, job_id: str, wait_s: float = 15) -> str:
  """The job's steps squeue still lists, after giving slurmctld `wait_s` to retire them: a job
  can be listed as ended while its batch step still is (seen once with `sbatch --wait`, for a
  job that ended within a second)."""
  deadline = time.monotonic() + wait_s
  while True:
    left = subprocess.run(["squeue", "-h", "-s", "-j", job_id], env=slurm, capture_output=True,
                          text=True).stdout.strip()
    if not left or time.monotonic() > deadline:
      return left
    time.sleep(0.5)


def _workers_of(workdir) -> list[int]:
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    except OSError:
      continue
    if f"--workdir={workdir}" in cmdline and "experiments." in cmdline:
      found.append(int(pid))
  return found


def losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  steps = [r["step"] for r in records]
  assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
  return {r["step"]: r["loss"] for r in records}


def report(workdir, attempt):
  with open(os.path.join(workdir, "resilience", f"report-attempt{attempt}.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def fault_free(slurm, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("fault_free")
  status, log = sbatch(slurm, workdir)
  return workdir, status, log


def test_sbatch_runs_the_emitted_script_to_completion_with_two_tasks(fault_free):
  workdir, status, log = fault_free
  assert status == 0, log[-3000:]
  assert "[job] completed in attempt 0" in log and "attempt 1" not in log, log[-3000:]
  first = report(workdir, 0)
  assert first["completed"] and first["failures"] == [] and first["final_step"] == 12
  # Two JAX processes (Slurm tasks) of 4 CPU devices joined into one data=2 x tensor=4 mesh.
  with open(workdir / "summary.json") as f:
    summary = json.load(f)
  assert summary["mesh"] == {"data": 2, "fsdp": 1, "stage": 1, "tensor": 4}
  assert summary["steps"] == 12
  assert sorted(losses(workdir)) == list(range(1, 13))


def test_a_killed_task_restarts_inside_the_allocation_on_the_fault_free_curve(fault_free,
                                                                                slurm, tmp_path):
  reference_dir, status, _ = fault_free
  assert status == 0
  status, log = sbatch(slurm, tmp_path, "--fault=kill:rank=1:step=6", "--max_restarts=2")
  assert status == 0, log[-3000:]
  assert log.count("[job] restarting from the latest checkpoint") == 1, log[-3000:]
  assert "[job] completed in attempt 1" in log
  assert not report(tmp_path, 0)["completed"] and report(tmp_path, 1)["completed"]
  reference, resumed = losses(reference_dir), losses(tmp_path)
  assert resumed == reference   # the same global batches from the step-4 checkpoint: bitwise
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  with open(reference_dir / "summary.json") as f:
    assert summary["steps"] == 12 and summary["last_loss"] == json.load(f)["last_loss"]


def test_a_spent_budget_ends_the_job_with_status_1_and_says_so(slurm, tmp_path):
  status, log = sbatch(slurm, tmp_path, "--fault=kill:rank=1:step=6", "--max_restarts=0")
  assert status == 1, log[-3000:]
  assert "[job] restart budget (0) spent" in log
  assert "restarting" not in log and not (tmp_path / "summary.json").exists()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]   # kept for a resubmission


def test_a_driver_that_cannot_start_ends_the_job_with_status_2_and_cancels_the_step(slurm,
                                                                                    tmp_path):
  import socket
  with socket.socket() as taken:   # the driver's heartbeat port is someone else's
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    status, log = sbatch(slurm, tmp_path, heartbeat_port=taken.getsockname()[1],
                         timeout_s=120)
  assert status == 2, log[-3000:]
  assert "--heartbeat_port=" in log and "[job] bad driver configuration" in log
  assert "restarting" not in log and not (tmp_path / "checkpoints").exists()
