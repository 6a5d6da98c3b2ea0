"""Cluster job files from the launcher's flags, and the driver's watch mode (no JAX needed)."""
import json
import os
import subprocess
import sys
import threading

from mscale_jax.resilience import events
from mscale_jax.resilience.driver.supervisor import Driver, DriverOptions, free_port
from mscale_jax.resilience.worker.heartbeat import HeartbeatClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--num_processes=4", "--devices_per_process=8", "--coordinator_port=1234",
         "--heartbeat_port=8470", "--max_restarts=3", "--fault=kill:rank=2:step=9"]
TRAIN = ["--", "--config.mesh.data=-1", "--config.train.steps=50"]


def emit(kind, workdir):
  env = dict(os.environ, PYTHONPATH=REPO)
  result = subprocess.run([sys.executable, "-m", "experiments.launch", f"--emit={kind}",
                           f"--workdir={workdir}", *FLAGS, *TRAIN], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout.strip().split()[-1]


def test_slurm_script(tmp_path):
  path = emit("slurm", tmp_path)
  assert path == str(tmp_path / "gpt-tiny.slurm")
  assert subprocess.run(["bash", "-n", path]).returncode == 0   # it parses
  text = open(path).read()
  for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
               "export MSCALE_COORDINATOR=auto", "export JAX_COORDINATOR_PORT=1234",
               ":8470/heartbeat", "seq 0 3", "srun --ntasks=4"):
    assert line in text, line
  worker = [l for l in text.splitlines() if "experiments.train" in l][0]
  assert worker.split("experiments.train")[1].rstrip(" &").split() == [
      "--config.mesh.data=-1", "--config.train.steps=50", f"--workdir={tmp_path}"]
  driver = [l for l in text.splitlines() if "--watch" in l][0]
  assert "--num_processes=4" in driver and "--heartbeat_port=8470" in driver
  assert "kill:rank=2:step=9" in text


def test_kubernetes_jobset(tmp_path):
  manifest = json.load(open(emit("kubernetes", tmp_path)))
  assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 3
  jobs = {j["name"]: j["template"]["spec"] for j in manifest["spec"]["replicatedJobs"]}
  workers, driver = jobs["workers"], jobs["driver"]
  assert workers["parallelism"] == workers["completions"] == 4
  assert workers["completionMode"] == "Indexed"
  (container,) = workers["template"]["spec"]["containers"]
  assert container["command"][:3] == ["python", "-m", "experiments.train"]
  assert container["command"][3:] == ["--config.mesh.data=-1", "--config.train.steps=50",
                                      f"--workdir={tmp_path}"]
  assert container["ports"] == [{"containerPort": 1234, "name": "coordinator"}]
  assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
  env = {e["name"]: e for e in container["env"]}
  assert env["MSCALE_NUM_PROCESSES"]["value"] == "4"
  assert env["MSCALE_COORDINATOR"]["value"] == "gpt-tiny-workers-0-0.gpt-tiny:1234"
  assert env["MSCALE_HEARTBEAT_URL"]["value"].endswith(":8470/heartbeat")
  assert "job-completion-index" in env["MSCALE_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
  (watcher,) = driver["template"]["spec"]["containers"]
  assert "--watch" in watcher["command"] and "--num_processes=4" in watcher["command"]
  # Driver and workers read the same restart attempt (Kubernetes expands $(VAR) in commands).
  assert "--attempt=$(MSCALE_ATTEMPT)" in watcher["command"]
  assert watcher["env"] == [env["MSCALE_ATTEMPT"]]
  assert watcher["ports"][0]["containerPort"] == 8470


def _watch(tmp_path, attempt, worker_script):
  port = free_port()
  options = DriverOptions(worker_command=[], workdir=str(tmp_path), num_processes=2,
                          heartbeat_port=port, hang_timeout_s=30, poll_s=0.05,
                          heartbeat_token="job-secret")
  url = f"http://127.0.0.1:{port}/heartbeat"
  result = {}
  watcher = threading.Thread(target=lambda: result.update(
      report=Driver(options, out=open(os.devnull, "w")).watch(attempt)))
  watcher.start()
  hooks = [HeartbeatClient(rank=r, heartbeat_url=url, interval_s=60, attempt=attempt,
                           token="job-secret")
           for r in range(2)]
  while watcher.is_alive() and not result:   # posts until the watcher has decided
    worker_script(hooks)
    watcher.join(timeout=0.2)
  watcher.join(timeout=30)
  return result["report"]


def test_watch_mode_sees_completion_and_failures(tmp_path):
  def finish(hooks):
    for h in hooks:
      h.progress(10, 2.0, 1.0, 0.0)
      h.phase(events.DONE)
      h.post()
  report = _watch(tmp_path, 0, finish)
  assert report["completed"] and report["failures"] == []
  assert os.path.exists(tmp_path / "resilience" / "report-attempt0.json")

  def fail(hooks):
    hooks[0].phase(events.TRAINING)
    hooks[0].post()
    hooks[1].failure(events.EXCEPTION, "RuntimeError: device lost", step=12)
  report = _watch(tmp_path, 1, fail)
  assert not report["completed"]
  (failure,) = report["failures"]
  assert (failure["kind"], failure["rank"], failure["step"]) == ("exception", 1, 12)
