"""Per-rank monitoring metrics for Minder, sampled every second and shipped with heartbeats.

Minder (NSDI'25 §4.1) reads second-level monitoring metrics of every machine. Each training
process runs one `MetricSampler` thread that wakes once a second, reads a few counters (no
device synchronisation, no allocation on the training path), and keeps the samples until the
next heartbeat carries them to the driver (`Heartbeat.monitor`). docs/monitoring.md is the
table of the fields; experiments/minder_overhead.py measures what sampling costs.

One sample (a dict; absent values are None):
  t               wall-clock time of the sample
  step            the last step whose result the loop has checked
  step_time_s     mean seconds per step over the last progress report (the loop's own clock)
  data_wait_s     seconds the last step waited for its batch
  cpu_frac        this process's CPU time per wall second since the previous sample (all threads;
                  1.0 = one core busy)
  rss_mb          resident memory of this process
  hb_rtt_ms       round trip of the last heartbeat POST to the driver
  io_read_mb_s    this process's storage reads per second since the previous sample
  io_write_mb_s   its storage writes per second (checkpoints are most of them)
  device_mem_mb   device memory in use on the first local device (JAX memory_stats; GPU/TPU only)
"""
import collections
import os
import sys
import threading
import time

FIELDS = ("t", "step", "step_time_s", "data_wait_s", "cpu_frac", "rss_mb", "hb_rtt_ms",
          "io_read_mb_s", "io_write_mb_s", "device_mem_mb")


def _rss_mb() -> float | None:
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError, IndexError):
    return None


def _io_bytes() -> tuple[int, int] | None:
  """(read, write) bytes of this process at the storage layer (/proc/self/io), or the bytes
  it passed to read/write calls where the storage counters are not readable."""
  try:
    with open("/proc/self/io") as f:
      fields = dict(line.split(":") for line in f.read().splitlines() if ":" in line)
    read, write = fields.get("read_bytes"), fields.get("write_bytes")
    if read is None or write is None:
      read, write = fields["rchar"], fields["wchar"]
    return int(read), int(write)
  except (OSError, ValueError, KeyError):
    return None


def _device_mem_mb() -> float | None:
  jax = sys.modules.get("jax")          # only if the process already uses JAX
  if jax is None:
    return None
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:                     # noqa: BLE001 -- a backend without stats
    return None
  if not stats or "bytes_in_use" not in stats:
    return None
  return stats["bytes_in_use"] / 2**20


class MetricSampler:
  """Samples once per `period_s` on a daemon thread; `drain()` hands over the samples so far.

  Args:
    progress: a callable returning (step, step_time_s, data_wait_s) of the training loop (the
      heartbeat client's current values); read, never waited on.
    period_s: seconds between samples (Minder's granularity: 1).
    keep: at most this many samples are kept between drains (older ones are dropped), so a
      driver that stopped listening cannot grow a worker's memory.
  """

  def __init__(self, progress, *, period_s: float = 1.0, keep: int = 600):
    self.progress, self.period_s = progress, period_s
    self._samples = collections.deque(maxlen=keep)
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = None
    self._rtt_ms = None
    self._last = (time.process_time(), time.perf_counter(), _io_bytes())

  def record_rtt(self, seconds: float) -> None:
    """The heartbeat client's last POST round trip."""
    self._rtt_ms = 1e3 * seconds

  def sample(self) -> dict:
    """One sample now (also what the thread calls)."""
    cpu, wall, io = time.process_time(), time.perf_counter(), _io_bytes()
    cpu0, wall0, io0 = self._last
    self._last = (cpu, wall, io)
    dt = max(wall - wall0, 1e-9)
    step, step_time_s, data_wait_s = self.progress()
    rates = (None, None)
    if io is not None and io0 is not None:
      rates = tuple((b - a) / dt / 2**20 for a, b in zip(io0, io))
    return {"t": time.time(), "step": step, "step_time_s": step_time_s,
            "data_wait_s": data_wait_s, "cpu_frac": (cpu - cpu0) / dt, "rss_mb": _rss_mb(),
            "hb_rtt_ms": self._rtt_ms, "io_read_mb_s": rates[0], "io_write_mb_s": rates[1],
            "device_mem_mb": _device_mem_mb()}

  def drain(self) -> list[dict]:
    """The samples taken since the last drain, oldest first; the buffer is emptied."""
    with self._lock:
      out = list(self._samples)
      self._samples.clear()
    return out

  def start(self) -> None:
    """Starts the sampling thread (once)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="metric-sampler", daemon=True)
      self._thread.start()

  def stop(self) -> None:
    """Stops the sampling thread and waits for it briefly."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=2 * self.period_s + 1)
      self._thread = None

  def _run(self) -> None:
    while not self._stop.wait(self.period_s):
      s = self.sample()
      with self._lock:
        self._samples.append(s)
