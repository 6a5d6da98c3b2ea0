"""The worker's heartbeat: what this process tells the driver about itself, every few seconds.

Environment (set by the driver or the cluster job files): MSCALE_HEARTBEAT_URL (where
heartbeats go; unset: none are sent), MSCALE_HEARTBEAT_S (seconds between them, default 2),
MSCALE_PROCESS_ID, MSCALE_ATTEMPT, MSCALE_SLOT (which rank, (re)start and slot this is),
MSCALE_HEARTBEAT_TOKEN (the job's secret, which the driver's endpoint requires).
The trainer feeds the client through the `Heartbeats` callback (mscale_jax/callbacks/worker.py).
"""
import collections
import json
import logging
import os
import resource
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np

from mscale_jax.resilience import events
from mscale_jax.resilience.worker import monitor

log = logging.getLogger("mscale_jax")

# A failure report is sent up to FAILURE_TRIES times, each waiting up to FAILURE_TIMEOUT_S for
# the driver (whose server thread may be starved on a loaded host) before the worker exits.
FAILURE_TRIES, FAILURE_TIMEOUT_S = 3, 5.0


class _Tail(logging.Handler):
  """The last few log lines of this process, for the heartbeat."""

  def __init__(self, lines: int = 20):
    super().__init__(logging.INFO)
    self.lines = collections.deque(maxlen=lines)

  def emit(self, record):
    self.lines.append(self.format(record)[:2000])


class HostProbe:
  """Host probes for the heartbeat: a small local matmul's time, this process's CPU share since
  the previous probe, resident memory."""

  def __init__(self):
    self._matrix = np.random.default_rng(0).standard_normal((160, 160), np.float32)
    self._at = (time.process_time(), time.perf_counter())

  def __call__(self) -> dict:
    best = float("inf")
    for _ in range(3):
      start = time.perf_counter()
      self._matrix @ self._matrix
      best = min(best, time.perf_counter() - start)
    cpu, wall = time.process_time(), time.perf_counter()
    cpu_frac = (cpu - self._at[0]) / max(wall - self._at[1], 1e-9)
    self._at = (cpu, wall)
    return {"probe_ms": round(1e3 * best, 4), "cpu_frac": round(cpu_frac, 3),
            "rss_mb": round(_rss_bytes() / 2**20, 1)}


def _rss_bytes() -> int:
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class HeartbeatClient:
  """Reports this worker's phase, step progress and failures to the driver.

  Heartbeats are posted by a background thread every `interval_s` (and at once on a phase
  change or failure), so the training loop only updates a few fields. Once `start` is given the
  loop's `PhaseMachine`, each heartbeat also carries its finished iterations' phase seconds,
  where the loop is now, and host probes. With no URL every call is a cheap no-op.
  """

  def __init__(self, *, rank: int = 0, heartbeat_url: str | None = None,
               interval_s: float = 2.0, attempt: int = 0, slot: int = 0, token: str = ""):
    self.rank = rank
    self.url = heartbeat_url
    self.token = token
    self._refused = False   # the driver turned a heartbeat away (logged once)
    self.interval_s = interval_s
    self.beat = events.Heartbeat(rank=rank, host=socket.gethostname(), pid=os.getpid(),
                                 attempt=attempt, slot=slot)
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._thread = None
    self._tail = None
    self._since = None   # (step, time) at the previous progress report
    self._phase_at = time.perf_counter()   # when the phase last changed
    self._phases = None   # the loop's PhaseMachine, once training
    self._probe = None
    self._sampler = None  # per-second monitoring samples (monitor.py), once training

  @classmethod
  def from_env(cls, env=None) -> "HeartbeatClient":
    """The client the driver's environment variables describe (no URL: a silent one)."""
    env = os.environ if env is None else env
    rank = int(env.get("MSCALE_PROCESS_ID", "0"))
    if env.get("MSCALE_COORDINATOR") == "auto":
      import jax
      rank = jax.process_index()
    return cls(rank=rank, heartbeat_url=env.get("MSCALE_HEARTBEAT_URL"),
               interval_s=float(env.get("MSCALE_HEARTBEAT_S", "2")),
               attempt=int(env.get("MSCALE_ATTEMPT", "0")), slot=int(env.get("MSCALE_SLOT", "0")),
               token=env.get("MSCALE_HEARTBEAT_TOKEN", ""))

  # -- lifecycle ---------------------------------------------------------------------------

  def start(self, phases=None) -> None:
    """Starts the heartbeats (once); `phases`: the training loop's PhaseMachine, if training."""
    if phases is not None:
      self._phases, self._probe = phases, HostProbe()
      self._sampler = monitor.MetricSampler(self._progress)
      if self.url:
        self._sampler.start()
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
      if self._sampler is not None:
        self._sampler.stop()
      self.post()
      log.removeHandler(self._tail)

  # -- reports -----------------------------------------------------------------------------

  def phase(self, name: str) -> None:
    """The worker now does `name` (one of events.PHASES); reported at once."""
    with self._lock:
      changed = self.beat.phase != name
      self.beat.phase = name
      if changed:
        self._phase_at = time.perf_counter()
    if changed:
      self._wake.set()

  def progress(self, step: int, loss: float, grad_norm: float, data_wait_s: float) -> None:
    """Step `step` finished with this loss; `data_wait_s`: time it waited for its batch."""
    now = time.perf_counter()
    with self._lock:
      b, first = self.beat, self._since is None
      if self._since is not None and step > self._since[0]:
        b.step_time_s = (now - self._since[1]) / (step - self._since[0])
      self._since = (step, now)
      b.step, b.loss, b.grad_norm, b.data_wait_s = step, loss, grad_norm, data_wait_s
    if first:   # the first step (of the run, or since a rollback) is reported at once
      self._wake.set()

  def rewind(self, step: int) -> None:
    """The run went back to `step` (a rollback): step times restart from there."""
    with self._lock:
      self.beat.step = step
      self._since = None

  def nonfinite(self, step: int) -> None:
    """Step `step` had a non-finite loss or gradient norm (counted in the heartbeat)."""
    with self._lock:
      self.beat.nonfinite_steps += 1

  def recovered(self, kind: str, detail: str, step: int | None = None) -> None:
    """This worker recovered from a failure in its process (events.RECOVERED_KINDS), e.g. a
    refused save; reported at once and in the heartbeats after."""
    with self._lock:
      seq = self.beat.recovered[-1]["seq"] + 1 if self.beat.recovered else 1
      self.beat.recovered = self.beat.recovered[-(events.MAX_RECOVERED - 1):] + [
          {"kind": kind, "step": step, "detail": detail[:1000], "time": time.time(), "seq": seq}]
    self._wake.set()

  def failure(self, kind: str, detail: str, step: int | None = None,
              at_fault: int | None = None) -> None:
    """Reports this worker's failure right away (it is about to exit); `at_fault`: the rank
    the failure is about when the worker knows it is another's (a replica divergence)."""
    rank = self.rank if at_fault is None else at_fault
    with self._lock:
      self.beat.failure = events.Failure(kind, rank, detail[:4000], step=step).to_json()
      self.beat.phase = events.FAILED
    # The one message the driver must not miss: on a loaded host a 2-s post can time out.
    for _ in range(FAILURE_TRIES):
      if self.post(timeout_s=FAILURE_TIMEOUT_S):
        return

  def post(self, timeout_s: float = 2.0) -> bool:
    """Sends the current heartbeat now; False if it did not arrive (best effort: a driver that
    is gone is not an error)."""
    if not self.url:
      return True
    host = self._probe() if self._probe is not None else None
    with self._lock:
      self.beat.time = time.time()
      since = self._since
      # From the step's check or the last phase change, whichever came later: a phase's own
      # beat may have been lost (best effort), and its time must not count against the step.
      self.beat.step_age_s = (None if since is None
                              else time.perf_counter() - max(since[1], self._phase_at))
      if self._tail is not None:
        self.beat.log_tail = list(self._tail.lines)
      if self._phases is not None:
        self.beat.step_phases = self._phases.drain()
        self.beat.where = self._phases.where()
        self.beat.host_metrics = host
      if self._sampler is not None:
        self.beat.monitor = self._sampler.drain()
      body = json.dumps(self.beat.to_json()).encode()
      while len(body) > events.MAX_HEARTBEAT_BYTES and self.beat.log_tail:   # oldest go first
        self.beat.log_tail = self.beat.log_tail[len(self.beat.log_tail) // 2 + 1:]
        body = json.dumps(self.beat.to_json()).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
    request = urllib.request.Request(self.url, data=body, method="POST", headers=headers)
    try:
      start = time.perf_counter()
      urllib.request.urlopen(request, timeout=timeout_s).close()
      if self._sampler is not None:
        self._sampler.record_rtt(time.perf_counter() - start)
      return True
    except urllib.error.HTTPError as e:   # the driver refused it: say so once, keep going
      if not self._refused:
        self._refused = True
        log.warning("the driver refused a heartbeat: %s %s", e.code, e.reason)
      return True   # it arrived; sending it again would be refused again
    except OSError:
      return False

  def _progress(self) -> tuple:
    with self._lock:
      return self.beat.step, self.beat.step_time_s, self.beat.data_wait_s

  def _run(self) -> None:
    while not self._stop.is_set():
      self.post()
      self._wake.wait(self.interval_s)
      self._wake.clear()
