"""The worker's side: joining the job (`jax.distributed`) and the hooks the trainer calls.

The driver (or Slurm / Kubernetes) starts each worker with environment variables:

  MSCALE_COORDINATOR      host:port of the coordination service (process 0 serves it), or
                          'auto': JAX detects the cluster (Slurm, Kubernetes, ...) itself
  MSCALE_NUM_PROCESSES    N, and MSCALE_PROCESS_ID: this process's index (explicit mode only)
  MSCALE_HEARTBEAT_URL    where heartbeats go (the driver's HTTP endpoint); unset: none sent
  MSCALE_HEARTBEAT_S      seconds between heartbeats (default 2)
  MSCALE_ATTEMPT, MSCALE_SLOT   which (re)start this is and which slot the process runs on
  MSCALE_FAULTS           JSON list of fault specs (see faults.py)
  MSCALE_COMPILE_CACHE    a folder for JAX's persistent compilation cache (restarts reuse it)
  MSCALE_SELF_CHECK       1: run the self-checks (selfcheck.py) before training (restarts)
  MSCALE_BAD_SLOT         1: this slot's self-check contribution is corrupt (the bad_slot fault)

Without them the trainer runs as one process with no heartbeats, as before.
"""
import collections
import json
import logging
import os
import socket
import threading
import time
import urllib.request

from mscale_jax.errors import ConfigError
from mscale_jax.resilience import events
from mscale_jax.resilience.faults import FaultInjector, parse_faults

log = logging.getLogger("mscale_jax")


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Returns once `address` (host:port) accepts TCP connections; ConfigError after `timeout_s`."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1.0):
        return
    except (OSError, ValueError) as e:
      if time.monotonic() > deadline:
        raise ConfigError("coordinator", address, f"a reachable host:port (nothing accepted "
                          f"connections for {timeout_s:g} s: {e})") from None
      time.sleep(0.2)


def initialize_distributed(env=None) -> bool:
  """Joins the multi-process job the environment describes; False if it describes none.

  Call before anything touches a JAX backend. Process 0 serves the coordination service; the
  others first wait (MSCALE_COORDINATOR_TIMEOUT_S, default 60 s) for it to accept connections,
  so a wrong address is a one-line ConfigError rather than a 5-minute stall. JAX's own
  heartbeat timeout is shortened (MSCALE_JAX_HEARTBEAT_S, default 10 s): a peer that dies
  takes the survivors down within seconds instead of ~100 s.
  """
  env = os.environ if env is None else env
  address = env.get("MSCALE_COORDINATOR")
  if not address:
    return False
  import jax
  if cache := env.get("MSCALE_COMPILE_CACHE"):
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  heartbeat_s = int(env.get("MSCALE_JAX_HEARTBEAT_S", "10"))
  if address == "auto":
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_s)
    return True
  num_processes = int(env["MSCALE_NUM_PROCESSES"])
  process_id = int(env["MSCALE_PROCESS_ID"])
  timeout_s = float(env.get("MSCALE_COORDINATOR_TIMEOUT_S", "60"))
  if process_id:
    wait_for_coordinator(address, timeout_s)
  jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id,
                             initialization_timeout=max(int(timeout_s), 1),
                             heartbeat_timeout_seconds=heartbeat_s)
  return True


def self_check_if_asked(hooks: "WorkerHooks", workdir: str, env=None) -> None:
  """Runs the group's self-checks when MSCALE_SELF_CHECK=1; exits if any slot fails them.

  Every process reaches the same verdict; on a failing slot each reports a
  `self_check_failed` failure and exits with EXIT_SELF_CHECK_FAILED, and the driver restarts
  the group without that slot (WORKDIR/resilience/selfcheck-<attempt>/verdict.json says why).
  """
  import sys
  from mscale_jax.resilience import selfcheck
  env = os.environ if env is None else env
  if env.get("MSCALE_SELF_CHECK") != "1":
    return
  hooks.start(workdir)
  hooks.phase(events.SELF_CHECK)
  start = time.perf_counter()
  verdict, _ = selfcheck.run_in_group(
      os.path.join(workdir, "resilience", f"selfcheck-{env.get('MSCALE_ATTEMPT', '0')}"),
      os.path.join(workdir, "checkpoints"), slot=int(env.get("MSCALE_SLOT", "0")),
      corrupt=env.get("MSCALE_BAD_SLOT") == "1")
  failed = {slot: why for slot, why in verdict.items() if why}
  if failed:
    detail = "; ".join(f"slot {slot}: {why}" for slot, why in sorted(failed.items()))
    log.error("self-check failed: %s", detail)
    hooks.failure(events.SELF_CHECK_FAILED, detail)
    sys.exit(events.EXIT_SELF_CHECK_FAILED)
  log.info("self-check passed on slots %s in %.1f s", sorted(verdict),
           time.perf_counter() - start)


class _Tail(logging.Handler):
  """The last few log lines of this process, for the heartbeat."""

  def __init__(self, lines: int = 20):
    super().__init__(logging.INFO)
    self.lines = collections.deque(maxlen=lines)

  def emit(self, record):
    self.lines.append(self.format(record))


class WorkerHooks:
  """What the trainer calls at its hook points: phases, step progress, failures, fault points.

  Heartbeats are posted by a background thread every `interval_s` (and at once on a phase
  change or failure), so the training loop only updates a few fields. With no heartbeat URL
  and no faults every hook is a no-op; `WorkerHooks()` is what a plain single-process run uses.
  """

  def __init__(self, *, rank: int = 0, faults=(), heartbeat_url: str | None = None,
               interval_s: float = 2.0, attempt: int = 0, slot: int = 0):
    self.rank = rank
    self.faults = list(faults)
    self.url = heartbeat_url
    self.interval_s = interval_s
    self.injector = FaultInjector(self.faults, rank, None)
    self.beat = events.Heartbeat(rank=rank, host=socket.gethostname(), pid=os.getpid(),
                                 attempt=attempt, slot=slot)
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._thread = None
    self._tail = None
    self._since = None   # (step, time) at the previous progress report
    self.timeline = None   # the trainer's Timeline: its phases ride on each heartbeat

  @classmethod
  def from_env(cls, extra_faults=(), env=None) -> "WorkerHooks":
    """Hooks as the driver's environment variables (or none) describe, plus `extra_faults`."""
    env = os.environ if env is None else env
    specs = json.loads(env.get("MSCALE_FAULTS", "[]")) + list(extra_faults)
    rank = int(env.get("MSCALE_PROCESS_ID", "0"))
    if env.get("MSCALE_COORDINATOR") == "auto":
      import jax
      rank = jax.process_index()
    return cls(rank=rank, faults=parse_faults(specs), heartbeat_url=env.get("MSCALE_HEARTBEAT_URL"),
               interval_s=float(env.get("MSCALE_HEARTBEAT_S", "2")),
               attempt=int(env.get("MSCALE_ATTEMPT", "0")), slot=int(env.get("MSCALE_SLOT", "0")))

  # -- lifecycle ---------------------------------------------------------------------------

  def start(self, workdir: str) -> None:
    """Called when training starts in `workdir`: fault markers live there; heartbeats begin."""
    self.injector.marker_dir = os.path.join(workdir, "resilience", "faults")
    if self.url and self._thread is None:
      self._tail = _Tail()
      self._tail.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
      log.addHandler(self._tail)
      self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
      self._thread.start()

  def close(self, phase: str = events.DONE) -> None:
    """Final heartbeat (phase 'done' or 'failed') and stop the reporter."""
    self.phase(phase)
    if self._thread is not None:
      self._stop.set()
      self._wake.set()
      self._thread.join(timeout=5)
      self._thread = None
      self.post()
      log.removeHandler(self._tail)

  # -- reports -----------------------------------------------------------------------------

  def phase(self, name: str) -> None:
    """The worker now does `name` (one of events.PHASES); reported at once."""
    with self._lock:
      changed = self.beat.phase != name
      self.beat.phase = name
    if changed:
      self._wake.set()

  def progress(self, step: int, loss: float, grad_norm: float, data_wait_s: float) -> None:
    """Step `step` finished with this loss; `data_wait_s`: time it waited for its batch."""
    now = time.perf_counter()
    with self._lock:
      b = self.beat
      if self._since is not None and step > self._since[0]:
        b.step_time_s = (now - self._since[1]) / (step - self._since[0])
      self._since = (step, now)
      b.step, b.loss, b.grad_norm, b.data_wait_s = step, loss, grad_norm, data_wait_s

  def rewind(self, step: int) -> None:
    """The run went back to `step` (a rollback): step times restart from there."""
    with self._lock:
      self.beat.step = step
      self._since = None

  def nonfinite(self, step: int) -> None:
    """Step `step` had a non-finite loss or gradient norm (counted in the heartbeat)."""
    with self._lock:
      self.beat.nonfinite_steps += 1

  def failure(self, kind: str, detail: str, step: int | None = None) -> None:
    """Reports this worker's own failure right away (it is about to exit)."""
    with self._lock:
      self.beat.failure = events.Failure(kind, self.rank, detail, step=step).to_json()
      self.beat.phase = events.FAILED
    self.post()

  def post(self) -> None:
    """Sends the current heartbeat now (best effort: a driver that is gone is not an error)."""
    if not self.url:
      return
    host = self.timeline.host_metrics() if self.timeline is not None else None
    with self._lock:
      self.beat.time = time.time()
      if self._tail is not None:
        self.beat.log_tail = list(self._tail.lines)
      if self.timeline is not None:
        self.beat.step_phases = self.timeline.drain()
        self.beat.where = self.timeline.where()
        self.beat.host_metrics = host
      body = json.dumps(self.beat.to_json()).encode()
    request = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
      urllib.request.urlopen(request, timeout=2).close()
    except OSError:
      pass

  def _run(self) -> None:
    while not self._stop.is_set():
      self.post()
      self._wake.wait(self.interval_s)
      self._wake.clear()
