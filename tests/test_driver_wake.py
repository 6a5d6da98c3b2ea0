"""The supervisor's wake-up (resilience/driver/wake.py): a worker's exit or reported failure
ends the wait between two polls at once; nothing else does."""
import os
import signal
import subprocess
import sys

import pytest

from mscale_jax.resilience import events
from mscale_jax.resilience.driver.server import HeartbeatServer
from mscale_jax.resilience.driver.wake import Wake
from test_driver_policy import drive, misbehave

# Far longer than the test may take: a wait that returns True was woken, not timed out.
NEVER_S = 120.0


def _process(code: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", code], process_group=0)


def test_an_exit_wakes_the_wait_and_its_status_is_polled_after():
  wake = Wake()
  proc = _process("import sys; sys.exit(3)")
  wake.watch(proc)
  assert wake.wait(NEVER_S)
  assert proc.poll() == 3


def test_a_killed_worker_wakes_the_wait_with_its_signal_in_the_status():
  wake = Wake()
  proc = _process("import time; time.sleep(600)")
  wake.watch(proc)
  assert not wake.wait(0.2)              # running: nothing wakes the wait
  assert proc.poll() is None
  os.killpg(proc.pid, signal.SIGKILL)    # as the OS-fault injector and the teardown kill
  assert wake.wait(NEVER_S)
  assert proc.poll() == -signal.SIGKILL
  proc.wait()                            # the teardown's reaping still returns


def test_a_reported_failure_wakes_the_wait_and_a_plain_heartbeat_does_not():
  wake = Wake()
  server = HeartbeatServer("127.0.0.1", 0, token="t")
  server.listeners.append(wake.on_heartbeat)
  try:
    server.receive(events.Heartbeat(rank=0, host="h", pid=1, phase=events.TRAINING, step=4))
    assert not wake.wait(0.0)
    server.receive(events.Heartbeat(rank=1, host="h", pid=2, phase=events.TRAINING, step=4,
                                    failure={"kind": events.EXCEPTION, "detail": "boom"}))
    assert wake.wait(NEVER_S)
  finally:
    server.close()


def test_a_wake_up_that_comes_while_the_group_is_looked_at_is_not_lost():
  """Set between two waits (during a poll): the next wait returns at once, then it is spent."""
  wake = Wake()
  wake.on_heartbeat(events.Heartbeat(rank=0, host="h", pid=1,
                                     failure={"kind": events.EXCEPTION, "detail": "boom"}), 0.0)
  assert wake.wait(NEVER_S)
  assert not wake.wait(0.0)


@pytest.mark.slow
def test_the_driver_restarts_and_finishes_on_wake_ups_alone(tmp_path):
  """The supervisor waits on its Wake: with a poll interval longer than the run's whole time
  limit, a worker's exit (then, after the restart, the workers' exits 0) is still seen, so a
  driver that slept out poll_s (or did not watch its processes) would time out here."""
  plan = {"misbehave": misbehave((0, 1, 3, "exit"))}
  status, report, output = drive(tmp_path, plan, timeout_s=60, poll_s=600.0, max_restarts=2)
  assert status == 0, output[-3000:]
  assert report["completed"]
  assert [(f["kind"], f["rank"]) for f in report["failures"]] == [("exited", 1)]
