"""Per-second monitoring samples (resilience/worker/monitor.py) and their trip in heartbeats."""
import mmap
import os
import time


from mscale_jax.resilience import events
from mscale_jax.resilience.worker import monitor


def test_sample_has_every_field_and_sees_cpu_and_memory():
  sampler = monitor.MetricSampler(lambda: (7, 0.5, 0.01))
  time.sleep(0.05)
  idle = sampler.sample()
  assert set(idle) == set(monitor.FIELDS)
  start = time.perf_counter()
  while time.perf_counter() - start < 0.2:         # one core busy
    sum(range(1000))
  busy = sampler.sample()
  assert busy["cpu_frac"] > idle["cpu_frac"] + 0.1   # shared host: the busy loop gets a share
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
  sampler.start()
  time.sleep(0.5)
  sampler.stop()
  samples = sampler.drain()
  assert 5 <= len(samples) <= 11
  assert sampler.drain() == []
  times = [s["t"] for s in samples]
  assert all(b > a for a, b in zip(times, times[1:]))


def test_heartbeat_json_carries_monitor_samples():
  sampler = monitor.MetricSampler(lambda: (3, 0.2, 0.0))
  sampler.record_rtt(0.0012)
  beat = events.Heartbeat(rank=1, host="h", pid=1, monitor=[sampler.sample()])
  back = events.Heartbeat.from_json(beat.to_json())
  assert back.monitor[0]["step"] == 3 and abs(back.monitor[0]["hb_rtt_ms"] - 1.2) < 1e-9
