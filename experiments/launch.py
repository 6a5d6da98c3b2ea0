r"""Multi-process training under MegaScale's robust-training driver, or its cluster job files.

  python -m experiments.launch --num_processes=2 --devices_per_process=4 -- \
      --config=experiments/configs/gpt_tiny.py --config.train.steps=100
  python -m experiments.launch --num_processes=2 --fault=kill:rank=1:step=37 \
      --fault=hang:rank=0:step=60 --hang_timeout_s=20 -- --config.train.checkpoint_every=20
  python -m experiments.launch --emit=slurm --num_processes=16 --devices_per_process=8 -- ...
  python -m experiments.launch --emit=kubernetes --pvc=CLAIM --image=REGISTRY/mscale-jax -- ...

Flags before `--` are the launcher's; those after it are experiments.train's, passed to every
worker. Locally the driver starts the workers (one JAX process each, with its own simulated CPU
devices or accelerators), watches their heartbeats, and restarts the group from the latest
checkpoint after a failure (mscale_jax/resilience/driver/); its report is
WORKDIR/resilience/report.json and worker logs are in WORKDIR/logs/. With --emit=slurm or
--emit=kubernetes it writes a batch script / JobSet manifest to WORKDIR instead, for the
scheduler to start the workers (JAX's cluster auto-detection joins them); those files run
this launcher beside the workers with --watch (heartbeats only; exit 1 at the first failure).

If the driver itself dies (kill -9, a lost login node), running the same command again resumes
the job from its workdir: the new driver ends the workers the dead one left running and carries
its report on (WORKDIR/resilience/driver.json); while that driver still runs, the command
refuses to start a second job in the same workdir.
The driver's heartbeat endpoint takes requests only with the job's secret token (the local
driver makes one, or takes MSCALE_HEARTBEAT_TOKEN from the environment, which --watch
requires); it is in WORKDIR/resilience/heartbeat_token for `curl .../status`.

Bad input (an unknown --fault, a process count the mesh cannot use, a port in use, a
coordinator host this machine cannot serve) prints one line and exits with status 2 before
anything is started or written.
"""
import datetime
import os
import signal
import socket
import sys

from absl import app, flags

from mscale_jax.errors import ConfigError

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Worker processes (JAX processes).")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "Devices per process (simulated "
                                "CPU devices locally; accelerators per host on a cluster).")
_SPARES = flags.DEFINE_integer("spare_slots", 0, "Extra slots that replace ones failing "
                               "their self-check (without spares the job shrinks).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder (default runs/<config>-<time>).")
_HOST = flags.DEFINE_string("coordinator_host", "127.0.0.1", "Address of process 0's "
                            "coordination service (and of the driver's heartbeat endpoint).")
_PORT = flags.DEFINE_integer("coordinator_port", 0, "Coordinator port; 0 picks a free one "
                             "for each (re)start.")
_HEARTBEAT_PORT = flags.DEFINE_integer("heartbeat_port", 0, "Driver's heartbeat port (0: any).")
_HEARTBEAT_S = flags.DEFINE_float("heartbeat_s", 2.0, "Seconds between worker heartbeats.")
_HANG = flags.DEFINE_float("hang_timeout_s", 60.0, "Until the job's step time is known (its "
                           "first 20 heartbeats in training), a worker with no new step for "
                           "max(this, hang_step_factor x median step time) is hung.")
_HANG_FLOOR = flags.DEFINE_float("hang_floor_s", 10.0, "Once the step time is known: hung after "
                                 "max(this, hang_step_factor x the median step time) (never "
                                 "more than --hang_timeout_s's floor; why the median: "
                                 "resilience/driver/hang_limit.py).")
_HANG_FACTOR = flags.DEFINE_float("hang_step_factor", 20.0, "See --hang_timeout_s.")
_STARTUP = flags.DEFINE_float("startup_timeout_s", 600.0, "Allowed time to start, restore "
                              "and compile.")
_IO_TIMEOUT = flags.DEFINE_float("io_timeout_s", 120.0, "Allowed time for one checkpoint "
                                 "save or evaluation (the first save sets orbax up).")
_RESTARTS = flags.DEFINE_integer("max_restarts", 5, "Restart budget.")
_SELF_CHECK = flags.DEFINE_bool("self_check", True, "After a failure, the restarted group runs "
                                "the self-check diagnostics before it trains; slots that fail "
                                "them are excluded.")
_STANDBY = flags.DEFINE_bool("standby", True, "Keep warm standby worker processes (libraries "
                             "imported) so that a restart skips Python's start-up.")
_COMPILE_CACHE = flags.DEFINE_string("compile_cache_dir", "", "Compilation cache folder shared "
                                     "by the workers and their restarts (default "
                                     "WORKDIR/resilience/compile_cache).")
_FAULTS = flags.DEFINE_multi_string("fault", [], "Inject a fault (repeatable): kill:rank=R:"
                                    "step=N[:at=save], hang:rank=R:step=N, nan:step=N, "
                                    "exception:rank=R:step=N, slow:rank=R:factor=F, "
                                    "bad_slot:slot=S[:step=N]; from outside the workers: "
                                    "stop, contend, corrupt_checkpoint, io_error, kill_driver, "
                                    "kill_coordinator (mscale_jax/resilience/faults.py).")
_XLA_FLAGS = flags.DEFINE_string("xla_flags", "", "Extra XLA_FLAGS for the workers.")
_EMIT = flags.DEFINE_enum("emit", "local", ["local", "slurm", "kubernetes"], "Run locally, or "
                          "write a Slurm batch script / Kubernetes JobSet manifest.")
_WATCH = flags.DEFINE_bool("watch", False, "Cluster mode (used by the generated job files): "
                           "the scheduler starts the workers; only watch their heartbeats, "
                           "and exit 1 at the first failure detected.")
_ATTEMPT = flags.DEFINE_integer("attempt", 0, "With --watch: which (re)start this is.")
_IMAGE = flags.DEFINE_string("image", "mscale-jax:latest", "Container image (kubernetes).")
_IMAGE_REPO = flags.DEFINE_string("image_repo", "/workspace/mscale-jax", "The checkout inside "
                                  "the image: the pods' working directory (kubernetes).")
_PVC = flags.DEFINE_string("pvc", "", "PersistentVolumeClaim (ReadWriteMany) that holds the "
                           "workdir, mounted in every pod at --mount (kubernetes; required: "
                           "without it checkpoints neither survive a restart nor are shared).")
_MOUNT = flags.DEFINE_string("mount", "/mnt/mscale", "Where pods mount --pvc; the workdir is "
                             "MOUNT/<the workdir's name> (kubernetes).")
_TASKS_PER_NODE = flags.DEFINE_integer("tasks_per_node", 1, "Worker processes per node "
                                       "(slurm).")
_CLUSTER_GPUS = flags.DEFINE_bool("cluster_gpus", True, "Ask the scheduler for "
                                  "devices_per_process GPUs per process; --nocluster_gpus: "
                                  "workers use that many simulated CPU devices (slurm, "
                                  "kubernetes).")
_STRAGGLER_POLICY = flags.DEFINE_enum("straggler_policy", "warn", ["warn", "evict"],
                                      "On a straggler: print and record it (warn), or also "
                                      "restart without its slot (evict).")
_STRAGGLER_THRESHOLD = flags.DEFINE_float("straggler_threshold", 0.1, "A rank is abnormal when "
                                          "a phase of its own work exceeds the others' median "
                                          "by this fraction of a step.")
_STRAGGLER_WINDOW = flags.DEFINE_integer("straggler_window", 10, "Consecutive abnormal steps "
                                         "before a straggler is flagged.")
_DETECTOR = flags.DEFINE_enum("straggler_detector", "threshold", ["threshold", "minder"],
                              "Which detector flags a faulty rank: 'threshold' (each step's "
                              "own-phase seconds against the others' median) or 'minder' "
                              "(Minder, NSDI'25, on the per-second monitoring samples; needs "
                              ">= 3 processes; docs/monitoring.md).")
_MINDER_FIT = flags.DEFINE_integer("minder_fit_s", 120, "With --straggler_detector=minder: "
                                   "seconds of the job's own healthy samples it trains on "
                                   "before flagging.")
_HOST_PROBES = flags.DEFINE_bool("straggler_host_probes", False, "Also flag ranks whose host "
                                  "probes (a small matmul's time, memory) stand out; meaningful "
                                  "when each worker has its own cores.")
_STATUS_EVERY = flags.DEFINE_float("status_every_s", 30.0, "Seconds between the driver's "
                                   "status screens (0: none).")


# The driver's policy flags an emitted job file passes on to the driver in watch mode (the
# rest are local-only: spares, standbys, the compile cache, the self-check's slots).
DRIVER_FLAGS = ("hang_floor_s", "hang_step_factor", "startup_timeout_s", "io_timeout_s",
                "straggler_policy", "straggler_threshold", "straggler_window",
                "straggler_detector", "straggler_host_probes", "minder_fit_s", "status_every_s")


def driver_flags() -> list[str]:
  """DRIVER_FLAGS as command-line flags with this run's values."""
  return [flags.FLAGS[name].serialize() for name in DRIVER_FLAGS]


def parse_train_args(args: list[str]):
  """The Config experiments.train would build from `args` (its flags after `--`)."""
  from ml_collections import config_flags
  from mscale_jax.config import Config
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", "experiments/configs/gpt_tiny.py",
                                  flag_values=values, lock_config=True)
  try:
    values(["train"] + list(args), known_only=True)
  except flags.Error as e:
    raise ConfigError("train flags", " ".join(args), str(e)) from None
  return Config.from_dict(values.config.to_dict())


def check_port_free(host: str, port: int, field: str) -> None:
  """ConfigError unless this machine can listen on host:port (port 0: any port)."""
  try:
    with socket.socket() as s:
      # As the servers do: a port whose old connections linger in TIME_WAIT (the previous
      # attempt's heartbeats) is free to listen on.
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind((host, port))
  except OSError as e:
    what = "a free port" if port else f"an address of this machine ({e.strerror})"
    raise ConfigError(field, f"{host}:{port}" if port else host,
                      f"{what}; the local launcher serves it here ({e.strerror})") from None


def check_inputs(train_args: list[str]):
  """Everything that can be wrong before anything starts; returns (config, faults)."""
  from mscale_jax.config import validate
  from mscale_jax.resilience.faults import parse_faults
  faults = parse_faults(_FAULTS.value)
  n, k = _NUM_PROCESSES.value, _DEVICES.value
  if n < 1:
    raise ConfigError("--num_processes", n, "a positive integer")
  if k < 1:
    raise ConfigError("--devices_per_process", k, "a positive integer")
  if not _STRAGGLER_THRESHOLD.value > 0:
    raise ConfigError("--straggler_threshold", _STRAGGLER_THRESHOLD.value,
                      "a positive fraction of a step, e.g. 0.1")
  if _STRAGGLER_WINDOW.value < 1:
    raise ConfigError("--straggler_window", _STRAGGLER_WINDOW.value, "a positive number of steps")
  if _DETECTOR.value == "minder" and n < 3:
    raise ConfigError("--straggler_detector", "minder", "--num_processes >= 3 (Minder compares "
                      f"each rank with its peers; got {n})")
  if _MINDER_FIT.value < 60:
    raise ConfigError("--minder_fit_s", _MINDER_FIT.value, "at least 60 seconds of samples")
  if any(a.startswith("--workdir") for a in train_args):
    raise ConfigError("--workdir", train_args, "give --workdir before '--' (the launcher's)")
  config = parse_train_args(train_args)
  try:
    validate(config, n * k)
  except ConfigError as e:
    if not e.field.startswith("mesh"):
      raise
    raise ConfigError("--num_processes", n, f"{n} processes x {k} devices do not suit the "
                      f"configured mesh: {e}") from None
  slots = n + _SPARES.value
  for f in faults:
    limit, name = (slots, "slot") if f.kind == "bad_slot" else (n, "rank")
    if getattr(f, name) >= limit:
      raise ConfigError("--fault", f.spec, f"a {name} below {limit}")
  if _EMIT.value == "local" and not _WATCH.value:
    check_port_free(_HOST.value, _PORT.value, "--coordinator_port" if _PORT.value
                    else "--coordinator_host")
  if _EMIT.value == "local":
    check_port_free(_HOST.value, _HEARTBEAT_PORT.value, "--heartbeat_port")
  if _EMIT.value == "local" and not _WATCH.value and _WORKDIR.value:
    from mscale_jax.resilience.driver import claim
    pid = claim.live_driver(os.path.join(os.path.abspath(_WORKDIR.value), "resilience"))
    if pid is not None:
      raise ConfigError("--workdir", _WORKDIR.value, f"a folder no running driver uses: driver "
                        f"pid {pid} runs this job (running the command again resumes a job "
                        f"only once its driver is gone)")
  if _EMIT.value == "kubernetes" and not _PVC.value:
    raise ConfigError("--pvc", "(unset)", "the name of a PersistentVolumeClaim (ReadWriteMany) "
                      "for the workdir: checkpoints must outlive a pod and be shared")
  if _TASKS_PER_NODE.value < 1:
    raise ConfigError("--tasks_per_node", _TASKS_PER_NODE.value, "a positive integer")
  if _WATCH.value and not os.environ.get("MSCALE_HEARTBEAT_TOKEN"):
    raise ConfigError("MSCALE_HEARTBEAT_TOKEN", "(unset)", "the job's heartbeat secret, which "
                      "the job file exports to the driver and the workers alike")
  return config, faults


def main(argv):
  train_args = argv[1:]
  try:
    config, faults = check_inputs(train_args)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
  workdir = os.path.abspath(_WORKDIR.value or os.path.join("runs", f"{config.name}-{stamp}"))
  worker = [sys.executable, "-m", "experiments.train", *train_args]
  if _EMIT.value != "local":
    from mscale_jax.resilience.driver import cluster
    spec = cluster.ClusterJob(
        name=config.name.replace("_", "-"), num_processes=_NUM_PROCESSES.value,
        devices_per_process=_DEVICES.value, coordinator_port=_PORT.value or 1234,
        heartbeat_port=_HEARTBEAT_PORT.value or 8470, train_args=train_args,
        workdir=workdir, image=_IMAGE.value, faults=[f.spec for f in faults],
        heartbeat_s=_HEARTBEAT_S.value, hang_timeout_s=_HANG.value,
        driver_flags=driver_flags(),
        max_restarts=_RESTARTS.value, repo=os.getcwd(), python=sys.executable,
        tasks_per_node=_TASKS_PER_NODE.value, gpus=_CLUSTER_GPUS.value,
        xla_flags=_XLA_FLAGS.value, pvc=_PVC.value, mount=_MOUNT.value,
        image_repo=_IMAGE_REPO.value)
    try:
      path = cluster.write(spec, _EMIT.value, workdir)
    except ConfigError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    print(f"[launch] wrote {path}")
    if _EMIT.value == "kubernetes":
      print(f"[launch] first: kubectl create secret generic {cluster.secret_name(spec)} "
            f"--from-literal=token=$(openssl rand -hex 24)")
    return
  from mscale_jax.resilience.driver.supervisor import Driver, DriverOptions
  options = DriverOptions(
      worker_command=worker, workdir=workdir, num_processes=_NUM_PROCESSES.value,
      devices_per_process=_DEVICES.value, spare_slots=_SPARES.value,
      coordinator_host=_HOST.value, coordinator_port=_PORT.value,
      heartbeat_port=_HEARTBEAT_PORT.value, heartbeat_s=_HEARTBEAT_S.value,
      heartbeat_token=os.environ.get("MSCALE_HEARTBEAT_TOKEN", ""),
      hang_timeout_s=_HANG.value, hang_floor_s=_HANG_FLOOR.value,
      hang_step_factor=_HANG_FACTOR.value,
      startup_timeout_s=_STARTUP.value, io_timeout_s=_IO_TIMEOUT.value,
      max_restarts=_RESTARTS.value,
      self_check=_SELF_CHECK.value, standby=_STANDBY.value, faults=tuple(faults),
      xla_flags=_XLA_FLAGS.value,
      compile_cache_dir=_COMPILE_CACHE.value and os.path.abspath(_COMPILE_CACHE.value),
      straggler_policy=_STRAGGLER_POLICY.value, straggler_threshold=_STRAGGLER_THRESHOLD.value,
      straggler_window=_STRAGGLER_WINDOW.value, status_every_s=_STATUS_EVERY.value,
      tokens_per_step=config.train.global_batch * config.model.seq_len,
      straggler_host_probes=_HOST_PROBES.value, straggler_detector=_DETECTOR.value,
      minder_fit_s=_MINDER_FIT.value)
  if _WATCH.value:
    report = Driver(options).watch(_ATTEMPT.value)
    sys.exit(0 if report["completed"] else 1)
  print(f"[launch] {config.name}: {_NUM_PROCESSES.value} processes x {_DEVICES.value} devices, "
        f"workdir {workdir}", flush=True)
  # A scheduler's SIGTERM ends the driver like Ctrl-C does: the worker group is killed first.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  report = Driver(options).run()
  sys.exit(0 if report["completed"] else 1)


if __name__ == "__main__":
  app.run(main)
