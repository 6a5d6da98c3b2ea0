"""Per-second monitoring samples (resilience/worker/monitor.py) and their trip in heartbeats."""
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mscale_jax.resilience import events
from mscale_jax.resilience.worker import monitor


def test_sample_has_every_field_and_sees_cpu_and_memory():
  sampler = monitor.MetricSampler(lambda: (7, 0.5, 0.01))
  time.sleep(0.2)
  idle = sampler.sample()
  assert set(idle) == set(monitor.FIELDS)
  # Spin until this thread alone has used 0.1 CPU-s, however long a loaded host makes that take:
  # the sample must then show more CPU per wall second than the idle one did.
  start = time.thread_time()
  while time.thread_time() - start < 0.1:
    sum(range(1000))
  busy = sampler.sample()
  assert busy["cpu_frac"] > idle["cpu_frac"] + 0.02
  assert (busy["step"], busy["step_time_s"], busy["data_wait_s"]) == (7, 0.5, 0.01)
  before = busy["rss_mb"]
  # 64 MiB of fresh anonymous pages, every page written: a heap allocation could reuse pages
  # the process already holds (a long-lived test worker has freed many) and add nothing.
  block = mmap.mmap(-1, 64 * 2**20)
  block.write(b"\x01" * len(block))
  assert sampler.sample()["rss_mb"] > before + 50
  block.close()


def test_io_rate_counts_this_process_writes(tmp_path):
  sampler = monitor.MetricSampler(lambda: (0, None, None))
  path = tmp_path / "blob"
  with open(path, "wb") as f:
    f.write(os.urandom(8 * 2**20))
    f.flush()
    os.fsync(f.fileno())
  s = sampler.sample()
  assert s["io_write_mb_s"] is None or s["io_write_mb_s"] > 0


def test_thread_samples_once_per_period_and_drains():
  sampler = monitor.MetricSampler(lambda: (1, None, None), period_s=0.05)
  start = time.perf_counter()
  sampler.start()
  time.sleep(0.5)
  sampler.stop()
  elapsed = time.perf_counter() - start
  samples = sampler.drain()
  # A loaded host may run the thread late (fewer samples), never early (more than one a period).
  assert 1 <= len(samples) <= elapsed / 0.05 + 1
  assert sampler.drain() == []
  times = [s["t"] for s in samples]
  assert all(b > a for a, b in zip(times, times[1:]))


def test_heartbeat_json_carries_monitor_samples():
  sampler = monitor.MetricSampler(lambda: (3, 0.2, 0.0))
  sampler.record_rtt(0.0012)
  beat = events.Heartbeat(rank=1, host="h", pid=1, monitor=[sampler.sample()])
  back = events.Heartbeat.from_json(beat.to_json())
  assert back.monitor[0]["step"] == 3 and abs(back.monitor[0]["hb_rtt_ms"] - 1.2) < 1e-9


# A process that keeps one core busy and prints a monitoring sample every 0.25 s.
_VICTIM = """
import json, sys, time
from mscale_jax.resilience.worker import monitor
sampler = monitor.MetricSampler(lambda: (0, None, None))
due = time.perf_counter() + 0.25
while True:
  while time.perf_counter() < due:
    pass
  due += 0.25
  print(json.dumps(sampler.sample()), flush=True)
"""


def _can_raise_priority() -> bool:
  try:
    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0))
    return os.geteuid() == 0
  except OSError:
    return False


def _set_autogroup_nice(pid: int, nice: int) -> None:
  """With autogroups on, the kernel shares CPU fairly between sessions first, so a process's
  own nice value counts only inside its session; a session's weight is its autogroup's nice."""
  try:
    with open(f"/proc/{pid}/autogroup", "w") as f:
      f.write(str(nice))
  except OSError:
    pass                                # no autogroups: the process's nice value is enough


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.exists(
    "/proc/self/task"), reason="needs Linux (CPU affinity, /proc schedstat)")
@pytest.mark.skipif(not _can_raise_priority(), reason="needs root to lift the two processes "
                    "above the host's other load (nice -10)")
def test_runq_wait_sees_a_busy_process_on_the_same_core():
  """A real busy process pinned to the victim's core, switched on and off (SIGSTOP/SIGCONT of
  the busy process, never of the victim) in alternate 0.75 s phases: the victim's run-queue wait
  is higher while its neighbour runs. Each runs in a session of its own at nice -10, so that
  the host's other load (at nice >= 0) does not drown the neighbour's share."""
  core = sorted(os.sched_getaffinity(0))[0]
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  victim = subprocess.Popen([sys.executable, "-c", _VICTIM], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
  hog = subprocess.Popen([sys.executable, "-c", "while True:\n  pass\n"],
                         start_new_session=True)
  samples, phases = [], []
  reader = threading.Thread(target=lambda: samples.extend(
      json.loads(line) for line in victim.stdout), daemon=True)
  try:
    for p in (victim, hog):
      os.sched_setaffinity(p.pid, {core})
      os.setpriority(os.PRIO_PROCESS, p.pid, -10)
      _set_autogroup_nice(p.pid, -10)
    reader.start()
    for on in (False, True) * 4:
      os.kill(hog.pid, signal.SIGCONT if on else signal.SIGSTOP)
      start = time.time()
      time.sleep(0.75)
      phases.append((on, start, time.time()))
  finally:
    for p in (victim, hog):
      p.kill()
      p.wait()
  reader.join(timeout=5)

  def inside(on):   # samples whose whole 0.25 s lies in a phase with the neighbour on / off
    return [s for s in samples for o, a, b in phases if o == on and a <= s["t"] - 0.25
            and s["t"] <= b]
  busy, quiet = inside(True), inside(False)
  assert len(busy) >= 3 and len(quiet) >= 3, (len(busy), len(quiet))
  share = lambda xs: float(np.mean([s["runq_wait_share"] for s in xs]))
  frac = lambda xs: float(np.mean([s["runq_wait_frac"] for s in xs]))
  # Fair share with one equal neighbour: the victim waits about half the time it could run.
  assert share(busy) > share(quiet) + 0.2, (share(busy), share(quiet))
  assert frac(busy) > frac(quiet) + 0.2, (frac(busy), frac(quiet))
  assert 0.0 <= share(quiet) <= 1.0 and 0.0 <= share(busy) <= 1.0
