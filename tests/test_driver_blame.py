"""Who the driver blames (mscale_jax/resilience/driver/blame.py): coordination errors name the
lost peer, a killed rank before one that aborted over it, fatal lines read a poll at a time
without waiting, a hang filed on the rank the localiser names."""
import os
import signal
import subprocess
import sys

from mscale_jax.resilience import events
from mscale_jax.resilience.driver import blame
from mscale_jax.resilience.driver.blame import blamed_task

POLLED = ("E1126 05:41:49.222062 2118 coordination_service_agent.cc:289] Polled an error from "
          "coordination service (this can be an error from this or another task).\n")
NAMES_PEER_1 = ("F1126 05:41:49.222268 2118 client.h:80] Terminating process because the JAX "
                "distributed service detected fatal errors. UNAVAILABLE: The following tasks "
                "are unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed.\n")


def test_a_coordination_error_blames_the_peer_it_names():
  assert blamed_task(POLLED + NAMES_PEER_1, 0, 2) == 1
  assert blamed_task("Task /job:jax_worker/replica:0/task:0 heartbeat timeout", 1, 2) == 0
  assert blamed_task("Check failed: something", 0, 2) == 0
  assert blamed_task("/job:jax_worker/replica:0/task:7 gone", 1, 2) == 1   # not in the group


def test_an_abort_over_a_stopped_peer_blames_the_peer_even_before_its_line_is_read(tmp_path):
  """Rank 0 aborts (SIGABRT) on the coordination service's error about rank 1, which is stopped
  (SIGSTOP), and the driver sees the exit first: rank 1 is blamed, from rank 0's finished log.
  A rank killed by another signal is blamed before one that aborted; an abort that names no
  other peer is the aborting rank's own."""
  def aborted(log, text):
    with open(log, "w") as f:
      code = f"import os, sys; sys.stderr.write({text!r}); sys.stderr.flush(); os.abort()"
      return subprocess.run([sys.executable, "-c", code], stderr=f).returncode
  logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
  peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    os.kill(peer.pid, signal.SIGSTOP)
    failure = blame.killed_by_signal([aborted(logs[0], POLLED + NAMES_PEER_1), peer.poll()], logs)
    assert (failure.kind, failure.rank) == (events.FATAL_LOG, 1), failure
    assert "unhealthy" in failure.detail or "coordination service" in failure.detail
    peer.kill()
    assert peer.wait() == -signal.SIGKILL
    failure = blame.killed_by_signal([-signal.SIGABRT, peer.returncode], logs)
    assert (failure.kind, failure.rank, failure.detail) == (events.EXITED, 1, "killed by signal 9")
  finally:
    peer.kill()
    peer.wait()
  failure = blame.killed_by_signal([aborted(logs[0], "Check failed: x\n"), None], logs)
  assert (failure.kind, failure.rank) == (events.EXITED, 0), failure
  assert failure.detail == "killed by signal 6 after: Check failed: x"


def test_an_abort_after_a_reported_failure_leaves_the_report_to_decide(tmp_path):
  """Rank 0 reports a replica divergence at fault on rank 1, raises, and aborts on its way out
  (its peer is still mid-collective); the driver's poll sees the report and the abort at once.
  The report decides (rank 1's divergence), not 'rank 0 killed by signal 6'; a rank that
  reported nothing and aborted is still blamed for its abort, and a kill by another signal
  outranks any report."""
  logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
  for path in logs:
    open(path, "w").close()
  code = "import os; os.abort()"
  status = subprocess.run([sys.executable, "-c", code], stderr=subprocess.DEVNULL).returncode
  assert status == -signal.SIGABRT
  beat = events.Heartbeat(rank=0, host="h", pid=1, failure=events.Failure(
      events.REPLICA_DIVERGENCE, 1, "replicas disagree at step 8", step=8).to_json())
  beats = {0: (beat, 0.0), 1: (events.Heartbeat(rank=1, host="h", pid=2), 0.0)}
  reporting = blame.reporting_ranks(beats)
  assert reporting == {0}
  assert blame.killed_by_signal([status, None], logs, reporting) is None
  failure = blame.reported(beats, 2)
  assert (failure.kind, failure.rank, failure.step) == (events.REPLICA_DIVERGENCE, 1, 8)
  aborted = blame.killed_by_signal([None, status], logs, reporting)
  assert (aborted.kind, aborted.rank) == (events.EXITED, 1), aborted
  killed = blame.killed_by_signal([-signal.SIGKILL, None], logs, reporting)
  assert (killed.kind, killed.rank) == (events.EXITED, 0), killed


def test_a_coordination_line_is_held_until_the_lines_naming_the_peer_can_arrive(tmp_path):
  """Rank 0 logs the coordination error; the line naming rank 1 comes later. The first poll
  files nothing (and does not wait); a poll after `settle_s` blames rank 1."""
  logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
  for path in logs:
    open(path, "w").close()
  fatal = blame.FatalLogs(logs, settle_s=0.3)
  assert fatal.poll([None, None], now=10.0) is None
  with open(logs[0], "a") as f:
    f.write("I step 4\n" + POLLED)
  assert fatal.poll([None, None], now=10.1) is None   # held: the peer's name is not in yet
  with open(logs[0], "a") as f:
    f.write(NAMES_PEER_1)
  assert fatal.poll([None, None], now=10.2) is None
  failure = fatal.poll([None, None], now=10.5)
  assert (failure.kind, failure.rank) == (events.FATAL_LOG, 1), failure
  assert "coordination service" in failure.detail
  assert fatal.poll([None, None], now=11.0) is None   # filed once


def test_a_held_coordination_line_is_judged_at_once_when_its_rank_exits(tmp_path):
  logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
  open(logs[0], "w").close()
  with open(logs[1], "w") as f:
    f.write("E0 coordination service error: /job:jax_worker/replica:0/task:0 heartbeat timeout\n")
  fatal = blame.FatalLogs(logs, settle_s=60.0)
  assert fatal.poll([None, None], now=0.0) is None
  failure = fatal.poll([None, 1], now=0.01)
  assert (failure.kind, failure.rank) == (events.FATAL_LOG, 0)


def test_a_plain_fatal_line_fails_its_own_rank_at_once_and_finished_ranks_are_ignored(tmp_path):
  logs = [str(tmp_path / f"rank{r}.log") for r in range(3)]
  lines = ["I all good\n", "F0000 Check failed: x == y\n", "F0000 Check failed: z\n"]
  for path, line in zip(logs, lines):
    with open(path, "w") as f:
      f.write(line + "partial line without its newl")
  fatal = blame.FatalLogs(logs)
  failure = fatal.poll([None, 0, None], now=0.0)   # rank 1 finished: its shutdown noise is not
  assert (failure.kind, failure.rank, failure.detail) == (
      events.FATAL_LOG, 2, "F0000 Check failed: z")


def test_reported_failures_come_before_exits_and_exits_are_filed_by_status():
  beat = events.Heartbeat(rank=1, host="h", pid=1, failure=events.Failure(
      events.EXCEPTION, 1, "ValueError: v", step=7).to_json())
  healthy = events.Heartbeat(rank=0, host="h", pid=2)
  failure = blame.reported({0: (healthy, 0.0), 1: (beat, 0.0)}, 2)
  assert (failure.kind, failure.rank, failure.step) == (events.EXCEPTION, 1, 7)
  assert blame.exited([None, 0]) is None
  assert blame.exited([0, events.EXIT_NONFINITE]).kind == events.NONFINITE
  assert blame.exited([events.EXIT_SELF_CHECK_FAILED, None]).kind == events.SELF_CHECK_FAILED
  assert (blame.exited([None, 1]).kind, blame.exited([None, 1]).rank) == (events.EXITED, 1)


def test_a_hang_is_filed_on_the_localised_rank():
  failure = events.Failure(events.HANG, 1, "no step for 61 s", step=5)
  blame.localised_hang(failure, {"odd_ranks": [0]})
  assert failure.rank == 0 and "first seen on rank 1; localised to rank(s) [0]" in failure.detail
  kept = events.Failure(events.HANG, 1, "no step", step=5)
  blame.localised_hang(kept, None)   # nothing localised: the first-seen rank stays
  blame.localised_hang(kept, {"odd_ranks": [1, 0]})
  assert (kept.rank, kept.detail) == (1, "no step")


def test_a_reported_error_that_names_a_lost_peer_is_filed_on_that_peer():
  """Seen in the drill: rank 1 stopped (SIGSTOP); rank 0's checkpoint barrier failed on the
  coordination service's 'Task 1 heartbeat timeout' and rank 0 reported the exception."""
  detail = ("CheckpointWriteError: checkpoint step 690 could not be written (JaxRuntimeError: "
            "INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 "
            "heartbeat timeout. [type.googleapis.com/tensorflow.CoordinationServiceError=''])")
  beat = events.Heartbeat(rank=0, host="h", pid=1, failure=events.Failure(
      events.EXCEPTION, 0, detail, step=690).to_json())
  failure = blame.reported({0: (beat, 0.0)}, 2)
  assert (failure.kind, failure.rank, failure.step) == (events.FATAL_LOG, 1, 690)
  assert failure.detail.endswith("(rank 0 reported it)")
  own = events.Heartbeat(rank=0, host="h", pid=1, failure=events.Failure(
      events.EXCEPTION, 0, "ValueError: Task 1 heartbeat timeout in my own code", step=3).to_json())
  assert blame.reported({0: (own, 0.0)}, 2).rank == 0   # no coordination error: its own
  assert blamed_task("UNAVAILABLE: Task 3 heartbeat timeout", 0, 2) == 0   # not in the group


def test_the_three_readers_agree_on_what_is_a_coordination_error(tmp_path):
  """A coordination-service error as JAX prints it (POLLED, as in
  results/fault_drill-gpt_tiny-cpu-20261126T064248.json, then the line naming task 1) is filed
  on the peer it names whether the driver reads it from an aborted worker's log, from a live
  log, or from the worker's own report; a plain fatal line followed by the same tail stays its
  own rank's in all three. So is a barrier timeout (the form XLA's service raises), which only
  says 'Coordination' capitalised. A real barrier error a worker reported (fault_drill record of
  10:05:20) is the coordination service's too, in any case of the word."""
  barrier = ("RPC: /xla.coordination.CoordinationService/Barrier "
             "[type.googleapis.com/tensorflow.CoordinationServiceError='']")
  assert events.from_coordination_service(barrier)
  assert events.from_coordination_service("UNAVAILABLE: [tensorflow.CoordinationServiceError='']")
  assert not events.from_coordination_service(NAMES_PEER_1)
  timeout = ("jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED: Barrier timed out. Id: "
             "checkpoint_save. [type.googleapis.com/tensorflow.CoordinationServiceError='']\n")
  for text, blamed in ((POLLED + NAMES_PEER_1, 1), (timeout + NAMES_PEER_1, 1),
                       ("Check failed: x == y\n" + NAMES_PEER_1, 0)):
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    with open(logs[0], "w") as f:
      f.write(text)
    open(logs[1], "w").close()
    aborted = blame.killed_by_signal([-signal.SIGABRT, None], logs)
    fatal = blame.FatalLogs(logs, settle_s=0.0).poll([None, None], now=1.0)
    beat = events.Heartbeat(rank=0, host="h", pid=1, failure=events.Failure(
        events.EXCEPTION, 0, text, step=4).to_json())
    report = blame.reported({0: (beat, 0.0)}, 2)
    coordination = events.from_coordination_service(text)
    assert coordination == (blamed == 1)
    assert (fatal.kind, fatal.rank) == (events.FATAL_LOG, blamed), text
    assert report.rank == blamed and (report.kind == events.FATAL_LOG) == coordination, text
    assert aborted.rank == blamed and (aborted.kind == events.FATAL_LOG) == coordination, text
