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
  runq_wait_frac  seconds this process's threads spent runnable but waiting for a CPU, per wall
                  second (summed over threads; /proc/self/task/*/schedstat): the CPU the OS gave
                  to someone else. In synchronous training a slowed rank makes every rank's step
                  time rise alike, but only the rank whose CPU is taken waits on a run queue
                  (its peers block in the collective, off the run queue)
  runq_wait_share of the time this process's threads were runnable, the share spent waiting
                  for a CPU: runq wait / (runq wait + run time). A JAX process's thread pools
                  spin and yield, so the absolute wait is large on any busy host; the share
                  is what moved for the victim of a busy neighbour in our runs (docs/monitoring.md)
  nivcsw_per_s    involuntary context switches per second (getrusage): preemptions by the OS
  majflt_per_s    major page faults per second (getrusage): pages read back from storage, what
                  memory pressure costs a process
  sample_lag_ms   how late the sampling thread woke (ms past its period): a process stopped or
                  starved as a whole wakes late
"""
import collections
import os
import resource
import sys
import threading
import time

FIELDS = ("t", "step", "step_time_s", "data_wait_s", "cpu_frac", "rss_mb", "hb_rtt_ms",
          "io_read_mb_s", "io_write_mb_s", "device_mem_mb", "runq_wait_frac", "runq_wait_share",
          "nivcsw_per_s", "majflt_per_s", "sample_lag_ms")


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


def schedstat_ns() -> dict[int, tuple[int, int]]:
  """{thread id: (ns run on a CPU, ns waited on a run queue) so far} for this process's live
  threads (the first two fields of each thread's schedstat; an empty dict where the kernel does
  not keep them)."""
  out = {}
  try:
    tids = os.listdir("/proc/self/task")
  except OSError:
    return out
  for tid in tids:
    try:
      with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
        run, wait = f.read().split()[:2]
      out[int(tid)] = (int(run), int(wait))
    except (OSError, ValueError, IndexError):
      pass                              # the thread ended meanwhile
  return out


def _counters() -> tuple[float, dict[int, tuple[int, int]], int, int]:
  """(CPU seconds, (run, run-queue wait) per thread, involuntary switches, major faults) so
  far."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return time.process_time(), schedstat_ns(), usage.ru_nivcsw, usage.ru_majflt


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
    self._last = (_counters(), time.perf_counter(), _io_bytes())
    self._due = None                    # when the thread's next sample is due

  def record_rtt(self, seconds: float) -> None:
    """The heartbeat client's last POST round trip."""
    self._rtt_ms = 1e3 * seconds

  def sample(self) -> dict:
    """One sample now (also what the thread calls)."""
    now, wall, io = _counters(), time.perf_counter(), _io_bytes()
    then, wall0, io0 = self._last
    self._last = (now, wall, io)
    dt = max(wall - wall0, 1e-9)
    step, step_time_s, data_wait_s = self.progress()
    rates = (None, None)
    if io is not None and io0 is not None:
      rates = tuple((b - a) / dt / 2**20 for a, b in zip(io0, io))
    (cpu, sched, nivcsw, majflt), (cpu0, sched0, nivcsw0, majflt0) = now, then
    # Threads alive at both samples (one that ended took its counts with it).
    both = [(sched0[t], sched[t]) for t in sched if t in sched0]
    run = sum(max(b[0] - a[0], 0) for a, b in both) / 1e9
    runq = sum(max(b[1] - a[1], 0) for a, b in both) / 1e9
    lag = None if self._due is None else 1e3 * max(wall - self._due, 0.0)
    return {"t": time.time(), "step": step, "step_time_s": step_time_s,
            "data_wait_s": data_wait_s, "cpu_frac": (cpu - cpu0) / dt, "rss_mb": _rss_mb(),
            "hb_rtt_ms": self._rtt_ms, "io_read_mb_s": rates[0], "io_write_mb_s": rates[1],
            "device_mem_mb": _device_mem_mb(),
            "runq_wait_frac": runq / dt if sched else None,
            "runq_wait_share": runq / (runq + run) if sched and runq + run > 0 else None,
            "nivcsw_per_s": (nivcsw - nivcsw0) / dt, "majflt_per_s": (majflt - majflt0) / dt,
            "sample_lag_ms": lag}

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
    self._due = time.perf_counter() + self.period_s
    while not self._stop.wait(max(self._due - time.perf_counter(), 0.0)):
      s = self.sample()
      self._due += self.period_s * (1 + (time.perf_counter() - self._due) // self.period_s)
      with self._lock:
        self._samples.append(s)
