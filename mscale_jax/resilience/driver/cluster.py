"""Job files for clusters, generated from the launcher's flags: a Slurm batch script and a
Kubernetes JobSet manifest.

On a cluster the scheduler starts the workers (one JAX process per host) and restarts them;
the driver runs beside them in watch mode (`experiments.launch --watch`): it receives their
heartbeats over HTTP/JSON, and when it detects a failure (hang, exception, non-finite stop,
fatal log line) it exits, which ends the attempt; the next attempt resumes from the latest
checkpoint, up to the restart budget.

  Slurm       workers by `srun` (tasks_per_node per node); JAX's cluster auto-detection reads
              the SLURM_* variables (coordinator: the first node). The batch script loops over
              attempts inside its allocation: each runs the driver and one worker step, reads
              both exit statuses, and cancels the step (scancel) when the driver reports a
              failure. Run for real on a one-node Slurm (scripts/slurm_local.sh,
              tests/test_slurm.py).
  Kubernetes  a JobSet with two replicated Jobs: 'driver' (one pod) and 'workers' (an Indexed
              Job of N pods; pod i is process i, coordinator: pod 0 via the JobSet's headless
              service), the workdir on a shared PersistentVolumeClaim, the heartbeat token
              from a Secret. JobSet's failurePolicy restarts the whole set on any failure.
              Checked field by field (tests/test_cluster.py), not run on a cluster.

Self-check diagnostics and slot exclusion are local-launcher features: on a cluster the
scheduler's node health checks and spare nodes play that part.
"""
import dataclasses
import json
import os
import re
import shlex

from mscale_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ClusterJob:
  """What both job files need (from experiments.launch's flags)."""
  name: str
  num_processes: int
  devices_per_process: int
  coordinator_port: int
  heartbeat_port: int
  train_args: list[str]
  workdir: str
  image: str = "mscale-jax:latest"
  faults: list[str] = dataclasses.field(default_factory=list)
  heartbeat_s: float = 2.0
  hang_timeout_s: float = 60.0
  # The launcher's other driver-policy flags, passed on to the driver in watch mode as given
  # (e.g. ['--hang_floor_s=10.0', '--straggler_policy=warn']): experiments.launch.DRIVER_FLAGS.
  driver_flags: list[str] = dataclasses.field(default_factory=list)
  max_restarts: int = 5
  repo: str = "."                  # Slurm: the checkout the tasks run in (shared by the nodes)
  python: str = "python"           # Slurm: the interpreter (the one that wrote the script)
  tasks_per_node: int = 1          # Slurm: worker processes per node
  gpus: bool = True                # request devices_per_process GPUs per process; else CPUs
  xla_flags: str = ""              # extra XLA_FLAGS for the workers
  pvc: str = ""                    # Kubernetes: the claim holding the workdir (ReadWriteMany)
  mount: str = "/mnt/mscale"       # Kubernetes: where the claim is mounted in every pod
  image_repo: str = "/workspace/mscale-jax"   # Kubernetes: the checkout inside the image

  def worker_command(self, workdir: str | None = None) -> list[str]:
    """The command line of one training process."""
    return [self.python, "-m", "experiments.train", *self.train_args,
            f"--workdir={workdir or self.workdir}"]

  def driver_command(self, attempt: str, workdir: str | None = None) -> list[str]:
    """The command line of the driver in watch mode (the scheduler started the workers)."""
    return [self.python, "-m", "experiments.launch", "--watch", f"--attempt={attempt}",
            f"--num_processes={self.num_processes}",
            f"--devices_per_process={self.devices_per_process}",
            "--coordinator_host=0.0.0.0", f"--heartbeat_port={self.heartbeat_port}",
            f"--heartbeat_s={self.heartbeat_s}", f"--hang_timeout_s={self.hang_timeout_s}",
            *self.driver_flags,
            f"--workdir={workdir or self.workdir}", "--", *self.train_args]

  def worker_env(self) -> dict[str, str]:
    env = {"MSCALE_HEARTBEAT_S": str(self.heartbeat_s), "MSCALE_FAULTS": json.dumps(self.faults)}
    if not self.gpus:   # JAX processes on CPU devices (e.g. the test Slurm on one machine)
      env["JAX_PLATFORMS"] = "cpu"
      env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={self.devices_per_process}"
    if self.xla_flags:
      env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {self.xla_flags}".strip()
    return env


def slurm_script(job: ClusterJob) -> str:
  """A bash batch script for `sbatch`: the driver on the batch node, the workers as one `srun`
  step per attempt (`tasks_per_node` per node).

  Each attempt ends one of three ways. Every rank reported 'done' (the driver exits 0) or the
  step succeeded: the job is complete and ends with status 0, never rerun (a rerun would
  overwrite summary.json). The driver detected a failure (exit 1): the step is cancelled with
  `scancel` (which, unlike a signal to `srun`, reaches tasks on other nodes) and the next
  attempt resumes from the latest checkpoint. The step failed first: likewise, unless a worker
  said the configuration is bad (status 2), which ends the job with status 2. After
  `max_restarts` restarts the job ends with status 1, saying so.
  """
  q = shlex.quote
  nodes = -(-job.num_processes // job.tasks_per_node)
  gpus = f"#SBATCH --gpus-per-node={job.devices_per_process * job.tasks_per_node}\n" \
      if job.gpus else ""
  env = "\n".join(f"export {k}={q(v)}" for k, v in job.worker_env().items())
  worker = " ".join(map(q, job.worker_command()))
  driver = " ".join(map(q, job.driver_command("$attempt"))).replace("'--attempt=$attempt'",
                                                                       '"--attempt=$attempt"')
  workdir = q(job.workdir)
  report = f"{job.workdir}/resilience/report-attempt"
  return f"""#!/bin/bash
# Generated by experiments.launch --emit=slurm. Submit with: sbatch {q(job.workdir + "/" + job.name + ".slurm")}
#SBATCH --job-name={job.name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks={job.num_processes}
#SBATCH --ntasks-per-node={job.tasks_per_node}
{gpus}#SBATCH --output={job.workdir}/slurm-%j.log
set -u
cd {q(job.repo)}
mkdir -p {workdir}/logs
# Workers join with JAX's cluster auto-detection (SLURM_* variables; process 0 on the first
# node serves the coordinator on port {job.coordinator_port}); heartbeats go to the driver here,
# with the job's secret token (made here, per job).
export MSCALE_COORDINATOR=auto
export JAX_COORDINATOR_PORT={job.coordinator_port}
export MSCALE_HEARTBEAT_URL="http://$(hostname):{job.heartbeat_port}/heartbeat"
export MSCALE_HEARTBEAT_TOKEN="$(od -An -N24 -tx1 /dev/urandom | tr -d ' \\n')"
export MSCALE_COMPILE_CACHE="${{MSCALE_COMPILE_CACHE:-{job.workdir}/resilience/compile_cache}}"
{env}

end_step() {{   # cancels attempt $1's worker step on every node, then reaps srun ($2)
  local ids
  while kill -0 "$2" 2>/dev/null; do   # (a step that srun has not registered yet: wait for it)
    ids=$(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" | awk -v n="$1" '$2 == n {{print $1}}')
    if [ -n "$ids" ]; then scancel $ids; break; fi
    sleep 1
  done
  wait "$2"
}}

for attempt in $(seq 0 {job.max_restarts}); do
  export MSCALE_ATTEMPT=$attempt
  step="{job.name}-attempt$attempt"
  {driver} &
  driver=$!
  srun --job-name="$step" --ntasks={job.num_processes} --ntasks-per-node={job.tasks_per_node} \\
      --kill-on-bad-exit=1 {worker} &
  workers=$!
  wait -n -p ended "$driver" "$workers"
  status=$?
  if [ "$ended" = "$workers" ]; then      # the worker step ended first
    kill "$driver" 2>/dev/null; wait "$driver"
    if [ "$status" -eq 0 ]; then echo "[job] completed in attempt $attempt"; exit 0; fi
    if [ "$status" -eq 2 ]; then echo "[job] bad configuration (a worker exited 2)" >&2; exit 2; fi
    echo "[job] attempt $attempt: the worker step exited with status $status" >&2
  elif [ "$status" -eq 0 ]; then          # every rank reported done: let the step finish
    wait "$workers"
    status=$?
    [ "$status" -ne 0 ] && echo "[job] every rank reported done; the step then exited" \\
        "with status $status (not rerun: training is complete)" >&2
    echo "[job] completed in attempt $attempt"
    exit 0
  else                                    # the driver detected a failure (or could not start)
    end_step "$step" "$workers"
    if [ "$status" -eq 2 ]; then echo "[job] bad driver configuration" >&2; exit 2; fi
    echo "[job] attempt $attempt: the driver detected a failure ({report}$attempt.json)" >&2
  fi
  [ "$attempt" -lt {job.max_restarts} ] && echo "[job] restarting from the latest checkpoint" >&2
done
echo "[job] restart budget ({job.max_restarts}) spent" >&2
exit 1
"""


def secret_name(job: ClusterJob) -> str:
  """The Kubernetes Secret (key 'token') holding the job's heartbeat token; created by hand, so
  that no secret is written into the manifest."""
  return f"{job.name}-heartbeat"


def pod_workdir(job: ClusterJob) -> str:
  """The workdir inside the pods: on the shared claim, under the local workdir's name."""
  return f"{job.mount.rstrip('/')}/{os.path.basename(job.workdir.rstrip('/'))}"


def check_name(job: ClusterJob) -> None:
  """ConfigError unless `job.name` makes valid pod host names (DNS-1123 labels, <= 63)."""
  longest = f"{job.name}-workers-0-{job.num_processes - 1}"
  if not _DNS_LABEL.fullmatch(job.name) or len(longest) > 63:
    raise ConfigError("config.name (the job name)", job.name, "lowercase letters, digits "
                      f"and '-', short enough that pod host names such as {longest!r} stay "
                      "within 63 characters")


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def jobset_manifest(job: ClusterJob) -> dict:
  """A JobSet (jobset.x-k8s.io/v1alpha2): a driver pod and an Indexed Job of worker pods.

  Every pod mounts the claim `job.pvc` at `job.mount` and runs in the image's checkout
  (workingDir); the workdir lives on the claim, so checkpoints survive a restart of the set
  and every pod sees the same ones. Worker 0 serves the coordinator, reached through the
  JobSet's headless service (pod host names `<jobset>-<replicated job>-<job index>-<pod
  index>.<subdomain>`). Any failed pod fails its Job (backoffLimit 0), which restarts the
  whole set (failurePolicy.maxRestarts); the set succeeds when every worker completes.
  """
  check_name(job)
  workdir = pod_workdir(job)
  coordinator = f"{job.name}-workers-0-0.{job.name}:{job.coordinator_port}"
  heartbeat_url = f"http://{job.name}-driver-0-0.{job.name}:{job.heartbeat_port}/heartbeat"
  index = {"valueFrom": {"fieldRef": {
      "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
  # JobSet labels each pod with its restart attempt; driver and workers must agree on it.
  attempt = {"name": "MSCALE_ATTEMPT", "valueFrom": {"fieldRef": {
      "fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}}}
  token = {"name": "MSCALE_HEARTBEAT_TOKEN", "valueFrom": {"secretKeyRef": {
      "name": secret_name(job), "key": "token"}}}
  worker_env = [{"name": "MSCALE_COORDINATOR", "value": coordinator},
                {"name": "MSCALE_NUM_PROCESSES", "value": str(job.num_processes)},
                {"name": "MSCALE_PROCESS_ID", **index},
                {"name": "MSCALE_HEARTBEAT_URL", "value": heartbeat_url}, attempt, token,
                {"name": "MSCALE_COMPILE_CACHE", "value": f"{workdir}/resilience/compile_cache"}]
  worker_env += [{"name": k, "value": v} for k, v in job.worker_env().items()]
  volume = {"name": "workdir", "persistentVolumeClaim": {"claimName": job.pvc}}
  mounts = [{"name": "workdir", "mountPath": job.mount}]

  def replicated(name, count, container):
    return {"name": name, "replicas": 1, "template": {"spec": {
        "parallelism": count, "completions": count, "completionMode": "Indexed",
        "backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "containers": [container], "volumes": [volume]}}}}}

  python = dataclasses.replace(job, python="python")
  driver = {"name": "driver", "image": job.image, "workingDir": job.image_repo,
            "command": python.driver_command("$(MSCALE_ATTEMPT)", workdir),   # expanded by k8s
            "env": [attempt, token], "volumeMounts": mounts,
            "ports": [{"containerPort": job.heartbeat_port, "name": "heartbeats"}]}
  worker = {"name": "worker", "image": job.image, "workingDir": job.image_repo,
            "command": python.worker_command(workdir), "env": worker_env, "volumeMounts": mounts,
            "ports": [{"containerPort": job.coordinator_port, "name": "coordinator"}]}
  if job.gpus:
    worker["resources"] = {"limits": {"nvidia.com/gpu": job.devices_per_process}}
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2",
      "kind": "JobSet",
      "metadata": {"name": job.name},
      "spec": {
          "network": {"enableDNSHostnames": True, "subdomain": job.name},
          # Any failed pod (a worker, or the driver on a detected failure) restarts the set.
          "failurePolicy": {"maxRestarts": job.max_restarts},
          "successPolicy": {"operator": "All", "targetReplicatedJobs": ["workers"]},
          "replicatedJobs": [replicated("driver", 1, driver),
                             replicated("workers", job.num_processes, worker)],
      },
  }


def write(job: ClusterJob, kind: str, directory: str) -> str:
  """Writes `<name>.slurm` or `<name>.jobset.json` (JSON is YAML: kubectl apply -f) to
  `directory`; returns its path."""
  if kind == "slurm":
    path, text = os.path.join(directory, f"{job.name}.slurm"), slurm_script(job)
  else:
    path = os.path.join(directory, f"{job.name}.jobset.json")
    text = json.dumps(jobset_manifest(job), indent=2) + "\n"
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  return path
