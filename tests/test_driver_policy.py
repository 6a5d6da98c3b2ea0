"""The driver's policy, driven end to end on workers without JAX (tests/fake_worker.py: the real
heartbeat protocol, real processes, misbehaviour on cue). Each scenario runs the real Driver in
a process session of its own with a hard timeout; whatever it leaves is killed and reported."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import job

# Real driver and worker processes per scenario: the full suite's, not the fast tier's.
pytestmark = pytest.mark.slow

FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_worker.py")
REPO = os.path.dirname(os.path.dirname(FAKE))


def drive(tmp_path, plan: dict, timeout_s: float = 60, **options):
  """Runs the driver over fake workers; returns (exit status, report, driver output)."""
  options = {"worker_command": [sys.executable, FAKE], "workdir": str(tmp_path),
             "num_processes": 2, "devices_per_process": 1, "heartbeat_s": 0.2,
             "hang_timeout_s": 3.0, "hang_step_factor": 1.0, "startup_timeout_s": 30.0,
             "standby": False, "self_check": False, "status_every_s": 0, "poll_s": 0.05,
             **options}
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join([os.path.dirname(FAKE), REPO]),   # python -m fake_worker
             FAKE_PLAN=json.dumps({"steps": 8, "step_s": 0.05, "checkpoint_every": 2, **plan}))
  proc = subprocess.Popen([sys.executable, FAKE, "driver", json.dumps(options)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    output, _ = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    output = proc.communicate()[0]
  left = [p for p in job.session_processes(proc.pid) if p != proc.pid]
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  assert proc.returncode is not None and proc.returncode >= 0, f"timed out:\n{output[-3000:]}"
  assert not left, f"processes left behind: {left}\n{output[-3000:]}"
  with open(tmp_path / "resilience" / "report.json") as f:
    return proc.returncode, json.load(f), output


def misbehave(*entries):
  return [dict(zip(("attempt", "rank", "step", "do"), e)) for e in entries]


def checkpoints(tmp_path):
  return sorted(int(d) for d in os.listdir(tmp_path / "checkpoints"))


def test_a_spent_restart_budget_is_a_named_stop_that_keeps_everything(tmp_path):
  plan = {"misbehave": misbehave((0, 1, 3, "exit"), (1, 0, 5, "exit"), (2, 1, 7, "exit"))}
  status, report, output = drive(tmp_path, plan, max_restarts=2)
  assert status != 0 and not report["completed"]
  assert report["outcome"] == "restart budget (2) spent", report["outcome"]
  assert "restart budget (2) spent" in output
  assert [(f["kind"], f["rank"]) for f in report["failures"]] == [
      ("exited", 1), ("exited", 0), ("exited", 1)]
  assert [f.get("restore_step") for f in report["failures"]] == [2, 4, None]
  assert [a["attempt"] for a in report["attempts"]] == [0, 1, 2]
  assert checkpoints(tmp_path) == [2, 4, 6]   # nothing the job wrote was removed


def test_the_same_failure_twice_at_one_step_stops_the_job(tmp_path):
  plan = {"misbehave": misbehave((0, 1, 5, "failure"), (1, 1, 5, "failure"))}
  status, report, output = drive(tmp_path, plan, max_restarts=5)
  assert status != 0, (report["failures"], output[-2000:])
  assert report["outcome"] == "the same failure twice at step 5: not transient"
  assert [(f["kind"], f["step"]) for f in report["failures"]] == [("exception", 5)] * 2
  assert report["restarts"] == 1   # one restart, not the whole budget


def test_failures_at_different_steps_are_transient_and_the_job_completes(tmp_path):
  plan = {"misbehave": misbehave((0, 1, 5, "failure"), (1, 0, 6, "failure"))}
  status, report, output = drive(tmp_path, plan, max_restarts=5)
  assert status == 0 and report["completed"], output[-2000:]
  assert [(f["kind"], f["rank"], f["step"]) for f in report["failures"]] == [
      ("exception", 1, 5), ("exception", 0, 6)]
  assert [f["restore_step"] for f in report["failures"]] == [4, 4]


def test_a_fatal_log_line_fails_a_live_worker(tmp_path):
  plan = {"misbehave": misbehave((0, 0, 4, "fatal"))}
  status, report, output = drive(tmp_path, plan)
  assert status == 0 and report["completed"], output[-2000:]
  (failure,) = report["failures"]
  assert (failure["kind"], failure["rank"]) == ("fatal_log", 0)
  assert "Check failed: the plan says so" in failure["detail"]


def test_evict_restarts_without_the_straggler_slot(tmp_path):
  plan = {"steps": 30, "step_s": 0.1,
          "misbehave": misbehave((0, 1, "every", "straggle"))}
  status, report, output = drive(tmp_path, plan, spare_slots=1, straggler_policy="evict",
                                 straggler_window=3, timeout_s=90)
  assert status == 0 and report["completed"], output[-2000:]
  (failure,) = report["failures"]
  assert (failure["kind"], failure["rank"], failure["slot"]) == ("straggler", 1, 1)
  assert list(report["excluded_slots"]) == ["1"]
  assert [a["slots"] for a in report["attempts"]] == [[0, 1], [0, 2]]


def test_a_refused_save_costs_no_restart_and_ends_the_io_error(tmp_path):
  """The checkpoint folder turns read-only (the io_error fault, from the driver): the next
  save is refused, the worker reports it and goes on; the driver records it, links it to the
  fault and makes the folder writable again, so the saves after it go through. (A save due
  before the driver undid the fault, on a loaded machine, is refused too: recorded, not linked.)"""
  plan = {"steps": 24, "step_s": 0.15, "checkpoint_every": 4}
  status, report, output = drive(tmp_path, plan, faults=["io_error:step=2"])
  assert status == 0 and report["completed"] and report["restarts"] == 0, output[-2000:]
  assert report["failures"] == []
  refused, *later = report["recovered_in_process"]
  assert all(r["kind"] == "save_refused" and r["ranks"] == [0] for r in [refused, *later])
  assert refused["injected"] == "io_error:rank=0:step=2:seconds=0.0"
  assert [r["injected"] for r in later] == [None] * len(later)   # linked once
  assert refused["step"] < 24 and refused["detection_latency_s"] > 0
  steps_refused = [r["step"] for r in [refused, *later]]
  assert steps_refused == sorted(set(steps_refused))
  assert checkpoints(tmp_path) == [s for s in range(4, 25, 4) if s not in steps_refused]
  assert 24 in checkpoints(tmp_path)   # the fault was undone: the saves after it go through
  assert f"recovered in the process: save_refused at step {refused['step']}" in output


def test_a_refused_save_is_in_the_drivers_state_at_once(tmp_path):
  """A record of a save recovered in the process reaches the driver's state file
  (resilience/driver.json) as soon as the driver hears of it, not at the next restart: a driver
  killed later (kill_driver) is resumed from that file, and its report must still list it
  (a fault drill lost its io_error row this way)."""
  options = {"worker_command": [sys.executable, FAKE], "workdir": str(tmp_path),
             "num_processes": 2, "devices_per_process": 1, "heartbeat_s": 0.2,
             "hang_timeout_s": 5.0, "hang_step_factor": 1.0, "startup_timeout_s": 30.0,
             "standby": False, "self_check": False, "status_every_s": 0, "poll_s": 0.05,
             "faults": ["io_error:step=2"]}
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", FAKE_PLAN=json.dumps(
      {"steps": 60, "step_s": 0.15, "checkpoint_every": 4}))
  proc = subprocess.Popen([sys.executable, FAKE, "driver", json.dumps(options)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  lines = []
  try:
    for line in proc.stdout:   # the driver's lines, until it says it recorded the refusal
      lines.append(line)
      if line.startswith("[driver] recovered in the process"):
        break
    assert lines and lines[-1].startswith("[driver] recovered"), "".join(lines)[-2000:]
    from mscale_jax.resilience.driver import claim
    # The driver writes its state right after the poll that printed the line: read until the
    # record is there or the group has ended (only then did the state hold it before the fix).
    while not (state := claim.read(str(tmp_path / "resilience")))["recovered_in_process"] \
        and state["workers"]:
      time.sleep(0.05)
    assert state["workers"] and state["outcome"] is None   # the group is still running
    (refused,) = state["recovered_in_process"]
    assert refused["kind"] == "save_refused" and refused["injected"].startswith("io_error")
  finally:
    for pid in job.session_processes(proc.pid):   # the driver and its workers' groups
      os.kill(pid, signal.SIGKILL)
    proc.communicate()


def test_malformed_heartbeats_from_a_worker_cost_nothing(tmp_path):
  plan = {"misbehave": misbehave((0, 1, "every", "malformed"))}
  status, report, output = drive(tmp_path, plan)
  assert status == 0 and report["completed"] and report["restarts"] == 0, output[-2000:]
  assert report["final_step"] == 8 and report["failures"] == []
  rejected = report["rejected_requests"]
  assert rejected["400 rank"] == rejected["400 failure"] == rejected["400 not JSON"] == 8
  assert "rejected a request from 127.0.0.1: 400 'rank' must be a rank" in output
  # The job's token (the workers had it: their heartbeats got through) is for its owner only.
  token = tmp_path / "resilience" / "heartbeat_token"
  assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) >= 32


def test_a_hang_is_blamed_on_the_rank_the_localiser_names(tmp_path):
  """Rank 0 hangs in its host phase at step 5 while rank 1 waits in 'sync' for that step's
  result. Rank 1 reported step 4 first, so the rank that advanced least recently is rank 1:
  the localiser (stack dumps, loop phases) names rank 0, and the record must too."""
  plan = {"misbehave": misbehave((0, 0, 5, "hang"))}
  status, report, output = drive(tmp_path, plan, timeout_s=90)
  assert status == 0 and report["completed"], output[-2000:]
  (failure,) = report["failures"]
  assert (failure["kind"], failure["rank"]) == ("hang", 0), failure
  assert "localised to rank(s) [0]" in failure["detail"]
  (located,) = report["observability"]["hang_localisations"]
  assert located["odd_ranks"] == [0]
  codes = {r["rank"]: r["code"] for r in located["ranks"]}
  assert codes == {0: "fake_worker.py:host_work", 1: "fake_worker.py:wait_for_result"}


def test_once_the_step_time_is_known_a_hang_is_caught_far_inside_the_long_floor(tmp_path):
  """hang_timeout_s (here 120 s, past the test's own timeout) holds only until the job has
  reported its step time; the hang at step 150 is then caught after max(hang_floor_s, 20 x the
  median step time) and the job completes."""
  plan = {"steps": 200, "misbehave": misbehave((0, 0, 150, "hang"))}
  status, report, output = drive(tmp_path, plan, hang_timeout_s=120.0, hang_floor_s=4.0,
                                 hang_step_factor=20.0, timeout_s=90)
  assert status == 0 and report["completed"], output[-2000:]
  (failure,) = report["failures"]
  assert (failure["kind"], failure["rank"], failure["step"]) == ("hang", 0, 149), failure
  limit = float(failure["detail"].split("(limit ")[1].split(" s)")[0])
  assert 4.0 <= limit < 60.0, failure["detail"]


def test_slow_saves_evaluations_and_steps_are_no_hang_but_a_hang_is_caught_near_the_steady_step(
    tmp_path):
  """A healthy job's slow moments: each save (steps 20 and 40) takes 4.5 s ('checkpointing')
  and is followed by an evaluation as long ('evaluating'), both past the limit (4 s here, a
  floor with room for a loaded CI box's scheduling delays); every 7th step is
  10 x slower in the training phase (a loaded box: 14% of the step times, they set a 95th
  percentile); and the first steps after a restart. None is called a hang: the one failure is
  the injected one at step 33, and its limit follows the steady step, not the slow ones
  (20 x the 0.6-s steps would be 12 s)."""
  plan = {"steps": 40, "step_s": 0.05, "checkpoint_every": 20, "save_s": 4.5,
          "eval_every": 20, "eval_s": 4.5, "slow_every": 7, "slow_s": 0.6,
          "misbehave": misbehave((0, 0, 33, "hang"))}
  status, report, output = drive(tmp_path, plan, hang_timeout_s=30.0, hang_floor_s=4.0,
                                 hang_step_factor=20.0, io_timeout_s=20.0, timeout_s=150)
  assert status == 0 and report["completed"], output[-2000:]
  (failure,) = report["failures"]
  assert (failure["kind"], failure["rank"], failure["step"]) == ("hang", 0, 32), failure
  limit = float(failure["detail"].split("(limit ")[1].split(" s)")[0])
  assert 4.0 <= limit < 20 * 0.6, failure["detail"]
  assert report["final_step"] == 40


def test_the_group_after_a_failed_self_check_starts_from_warm_standbys_too(tmp_path):
  """Rank 1 exits at step 5; the restarted group (warm standbys) self-checks and fails slot 1,
  so it exits before training; the next group, on slots [0, 2], must start warm as well: the
  pool is refilled only once a group trains, so it held two groups' processes."""
  plan = {"misbehave": misbehave((0, 1, 5, "exit")), "bad_slots": [1]}
  status, report, output = drive(tmp_path, plan, worker_command=[sys.executable, "-m",
                                                                 "fake_worker"],
                                 standby=True, self_check=True, spare_slots=1, timeout_s=150)
  assert status == 0 and report["completed"], output[-2000:]
  assert [(a["slots"], a["failure"], a["warm_processes"]) for a in report["attempts"]] == [
      ([0, 1], "exited", 0), ([0, 1], "self_check_failed", 2), ([0, 2], None, 2)], output[-2000:]
  assert list(report["excluded_slots"]) == ["1"]
  (failure,) = report["failures"]
  assert list(failure["diagnosis"]["excluded"]) == ["1"]
