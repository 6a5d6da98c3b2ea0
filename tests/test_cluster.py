"""Cluster job files from the launcher's flags, and the driver's watch mode (no JAX needed)."""
import json
import os
import re
import subprocess
import sys
import threading

import yaml

from mscale_jax.resilience import events
from mscale_jax.resilience.driver.supervisor import Driver, DriverOptions, free_port
from mscale_jax.resilience.worker.heartbeat import HeartbeatClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--num_processes=4", "--devices_per_process=8", "--coordinator_port=1234",
         "--heartbeat_port=8470", "--max_restarts=3", "--fault=kill:rank=2:step=9"]
TRAIN = ["--", "--config.mesh.data=-1", "--config.train.steps=50"]


def emit(kind, workdir, *extra, status=0, train_extra=()):
  env = dict(os.environ, PYTHONPATH=REPO)
  result = subprocess.run([sys.executable, "-m", "experiments.launch", f"--emit={kind}",
                           f"--workdir={workdir}", *FLAGS, *extra, *TRAIN, *train_extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == status, result.stderr[-2000:]
  return result.stdout.strip().splitlines()[0].split()[-1] if status == 0 else result.stderr


def test_slurm_script(tmp_path):
  path = emit("slurm", tmp_path)
  assert path == str(tmp_path / "gpt-tiny.slurm")
  assert subprocess.run(["bash", "-n", path]).returncode == 0   # it parses
  text = open(path).read()
  for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks=4", "#SBATCH --ntasks-per-node=1",
               "#SBATCH --gpus-per-node=8", f"#SBATCH --output={tmp_path}/slurm-%j.log",
               "export MSCALE_COORDINATOR=auto", "export JAX_COORDINATOR_PORT=1234",
               ":8470/heartbeat", "export MSCALE_HEARTBEAT_TOKEN=", "seq 0 3",
               "--ntasks=4 --ntasks-per-node=1", "scancel $ids", "[job] restart budget (3) spent"):
    assert line in text, line
  assert "kill -KILL" not in text   # a signal to srun does not reach other nodes' tasks
  worker = [l for l in text.splitlines() if "experiments.train" in l][0]
  assert worker.split("experiments.train")[1].rstrip(" &").split() == [
      "--config.mesh.data=-1", "--config.train.steps=50", f"--workdir={tmp_path}"]
  assert f"{sys.executable} -m experiments.train" in worker   # the emitting interpreter
  driver = [l for l in text.splitlines() if "--watch" in l][0]
  assert "--num_processes=4" in driver and "--heartbeat_port=8470" in driver
  assert "kill:rank=2:step=9" in text


def test_slurm_script_on_cpus_packs_tasks_per_node(tmp_path):
  text = open(emit("slurm", tmp_path, "--tasks_per_node=2", "--nocluster_gpus")).read()
  assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=2" in text
  assert "--gpus-per-node" not in text
  assert "export JAX_PLATFORMS=cpu" in text
  assert "export XLA_FLAGS=--xla_force_host_platform_device_count=8" in text


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def test_kubernetes_jobset(tmp_path):
  """Every field a JobSet controller (jobset.x-k8s.io/v1alpha2) and the Job and Pod specs under
  it need, and what makes it run: shared storage, working directory, coordinator, restarts."""
  text = open(emit("kubernetes", tmp_path, "--pvc=ckpts", "--image=reg/mscale:1")).read()
  manifest = yaml.safe_load(text)   # JSON is YAML: what kubectl apply -f reads
  assert manifest == json.loads(text)
  assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  name = manifest["metadata"]["name"]
  assert name == "gpt-tiny" and DNS_LABEL.fullmatch(name)
  spec = manifest["spec"]
  assert spec["network"] == {"enableDNSHostnames": True, "subdomain": name}
  assert spec["failurePolicy"] == {"maxRestarts": 3}
  jobs = {j["name"]: j for j in spec["replicatedJobs"]}
  assert set(jobs) == {"driver", "workers"} and all(j["replicas"] == 1 for j in jobs.values())
  assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["workers"]}
  workdir = f"/mnt/mscale/{tmp_path.name}"
  containers = {}
  for job_name, count in (("driver", 1), ("workers", 4)):
    job_spec = jobs[job_name]["template"]["spec"]
    assert job_spec["parallelism"] == job_spec["completions"] == count
    assert job_spec["completionMode"] == "Indexed"
    assert job_spec["backoffLimit"] == 0   # a failed pod fails the Job: the set restarts
    pod = job_spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["volumes"] == [{"name": "workdir", "persistentVolumeClaim": {"claimName": "ckpts"}}]
    (container,) = pod["containers"]
    containers[job_name] = container
    assert DNS_LABEL.fullmatch(container["name"]) and container["image"] == "reg/mscale:1"
    assert container["workingDir"] == "/workspace/mscale-jax"
    assert container["volumeMounts"] == [{"name": "workdir", "mountPath": "/mnt/mscale"}]
    assert all(ENV_NAME.fullmatch(e["name"]) for e in container["env"])
    assert all(len(p["name"]) <= 15 and DNS_LABEL.fullmatch(p["name"])
               for p in container["ports"])
    assert f"--workdir={workdir}" in container["command"]   # on the claim, not this machine
    assert str(tmp_path) not in json.dumps(container)
    assert len(f"{name}-{job_name}-0-{count - 1}") <= 63   # pod host names
  worker, watcher = containers["workers"], containers["driver"]
  assert worker["command"][:3] == ["python", "-m", "experiments.train"]
  assert worker["command"][3:] == ["--config.mesh.data=-1", "--config.train.steps=50",
                                   f"--workdir={workdir}"]
  assert worker["ports"] == [{"containerPort": 1234, "name": "coordinator"}]
  assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
  env = {e["name"]: e for e in worker["env"]}
  assert env["MSCALE_NUM_PROCESSES"]["value"] == "4"
  # Worker 0's host name under the JobSet's headless service (named after its subdomain).
  assert env["MSCALE_COORDINATOR"]["value"] == "gpt-tiny-workers-0-0.gpt-tiny:1234"
  assert env["MSCALE_HEARTBEAT_URL"]["value"] == \
      "http://gpt-tiny-driver-0-0.gpt-tiny:8470/heartbeat"
  assert "job-completion-index" in env["MSCALE_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
  assert env["MSCALE_COMPILE_CACHE"]["value"] == f"{workdir}/resilience/compile_cache"
  token = {"secretKeyRef": {"name": "gpt-tiny-heartbeat", "key": "token"}}
  assert env["MSCALE_HEARTBEAT_TOKEN"]["valueFrom"] == token
  assert "--watch" in watcher["command"] and "--num_processes=4" in watcher["command"]
  # Driver and workers read the same restart attempt (Kubernetes expands $(VAR) in commands).
  assert "--attempt=$(MSCALE_ATTEMPT)" in watcher["command"]
  assert watcher["env"] == [env["MSCALE_ATTEMPT"], env["MSCALE_HEARTBEAT_TOKEN"]]
  assert watcher["ports"][0]["containerPort"] == 8470


def test_kubernetes_without_a_claim_or_with_a_bad_name_is_one_line_and_exit_2(tmp_path):
  error = emit("kubernetes", tmp_path, status=2)
  assert error.strip().splitlines() == [error.strip()] and "--pvc" in error
  error = emit("kubernetes", tmp_path, "--pvc=c", status=2, train_extra=["--config.name=GPT_Big"])
  assert "config.name (the job name)='GPT-Big'" in error and "63 characters" in error
  assert not os.listdir(tmp_path)   # nothing written


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


# What the launcher parses from an emitted driver command: its driver-policy flags' values.
_PARSE_DRIVER = """import json, sys
from absl import flags
from experiments import launch
flags.FLAGS(sys.argv)
print(json.dumps({name: flags.FLAGS[name].value for name in launch.DRIVER_FLAGS}))
"""


def _driver_policy(args):
  """The driver-policy flag values the launcher reads from `args` (a driver command's)."""
  env = dict(os.environ, PYTHONPATH=REPO)
  result = subprocess.run([sys.executable, "-c", _PARSE_DRIVER, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr[-2000:]
  return json.loads(result.stdout)


def test_emitted_files_pass_the_driver_policy_flags_on(tmp_path):
  """The driver in watch mode gets the launcher's hang floor, limits and straggler policy as
  given (not its own defaults): parsed back from the Slurm script and the JobSet manifest."""
  import shlex
  given = ["--hang_floor_s=7", "--hang_step_factor=12", "--io_timeout_s=33",
           "--straggler_policy=evict", "--straggler_window=4"]
  slurm = open(emit("slurm", tmp_path / "s", *given)).read()
  line = [l for l in slurm.splitlines() if "--watch" in l][0].replace("$attempt", "0")
  args = shlex.split(line.rstrip(" &"))[1:]        # after the interpreter
  manifest = json.loads(open(emit("kubernetes", tmp_path / "k", "--pvc=c", *given)).read())
  (driver,) = [j for j in manifest["spec"]["replicatedJobs"] if j["name"] == "driver"]
  command = [a.replace("$(MSCALE_ATTEMPT)", "0") for a in   # expanded by Kubernetes
             driver["template"]["spec"]["template"]["spec"]["containers"][0]["command"]]
  for parsed in (_driver_policy(args[2:]), _driver_policy(command[3:])):
    assert {k: parsed[k] for k in ("hang_floor_s", "hang_step_factor", "io_timeout_s",
                                   "straggler_policy", "straggler_window")} == {
        "hang_floor_s": 7.0, "hang_step_factor": 12.0, "io_timeout_s": 33.0,
        "straggler_policy": "evict", "straggler_window": 4}
    assert parsed["startup_timeout_s"] == 600.0   # the launcher's default, passed on as well
