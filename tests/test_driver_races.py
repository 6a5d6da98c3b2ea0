"""Races between a worker's last words and its exit, as the driver sees them.

A worker that fails reports the failure in a heartbeat and then exits. Two things could lose
that report (seen as a flaky tests/test_driver_policy.py under load: the failure was filed as
a bare `exited`, so "the same failure twice at a step" never matched and the job went on):
its periodic heartbeat, stamped earlier, arriving after it; or the driver reading the
heartbeats before the exit status, with the report landing in between.
"""
import os

from mscale_jax.resilience import events
from mscale_jax.resilience.driver.server import HeartbeatServer
from mscale_jax.resilience.driver.supervisor import Driver, DriverOptions, _Group


def beat(rank=1, pid=4242, attempt=0, time=100.0, failure=None, step=5):
  return events.Heartbeat(rank=rank, host="h", pid=pid, attempt=attempt, step=step, time=time,
                          phase=events.FAILED if failure else events.TRAINING, failure=failure)


FAILURE = events.Failure(events.EXCEPTION, 1, "RuntimeError: boom", step=5).to_json()


def test_an_earlier_heartbeat_arriving_late_does_not_erase_a_reported_failure():
  server = HeartbeatServer(token=None)
  heard = []
  server.listeners.append(lambda b, t: heard.append(b.time))
  try:
    server.receive(beat(time=100.5, failure=FAILURE))
    server.receive(beat(time=100.2, step=4))   # the periodic one, stamped before the failure
    held, _ = server.latest()[1]
    assert held.failure == FAILURE and held.step == 5
    assert heard == [100.5, 100.2]   # the observer still gets its step phases
    server.receive(beat(time=100.7, failure=FAILURE, step=6))   # newer: replaces
    assert server.latest()[1][0].step == 6
    # A restarted worker (another process, another clock) always replaces the old one's.
    server.receive(beat(pid=5151, attempt=1, time=3.0, step=0))
    assert server.latest()[1][0].pid == 5151
  finally:
    server.close()


class _ExitsAfterReporting:
  """A worker process whose failure heartbeat lands just as the driver looks at it exiting."""

  def __init__(self, server):
    self.server, self.pid, self.returncode = server, 4242, None

  def poll(self):
    if self.returncode is None:
      self.server.receive(beat(time=101.0, failure=FAILURE))
      self.returncode = 1
    return self.returncode


class _Running:
  pid, returncode = 4243, None

  def poll(self):
    return None


def test_an_exit_is_read_with_the_failure_the_worker_reported_before_it(tmp_path):
  driver = Driver(DriverOptions(worker_command=["true"], workdir=str(tmp_path), standby=False,
                                status_every_s=0), out=open(os.devnull, "w"))
  driver._serve_heartbeats()
  try:
    group = _Group(0, [0, 1])
    driver.observer.start_group(group)
    driver.server.receive(beat(rank=0, pid=4243, time=100.0, step=4))
    group.procs = [_Running(), _ExitsAfterReporting(driver.server)]
    group.logs = [str(tmp_path / "rank0.log"), str(tmp_path / "rank1.log")]
    failure = driver._poll(group)
    assert (failure.kind, failure.rank, failure.step) == (events.EXCEPTION, 1, 5), failure
    assert failure.detail == "RuntimeError: boom"
  finally:
    driver.server.close()
