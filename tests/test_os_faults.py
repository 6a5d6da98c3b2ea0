"""Faults from outside the training code, piece by piece in one process: the grammar, the
checkpoint checksum manifest and the fallback past a corrupt checkpoint, a checkpoint directory
that refuses writes, the driver's injector acting on real processes, the driver's claim on a
workdir, and a bad slot's corruption of what training uses."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from mscale_jax.errors import ConfigError
from mscale_jax.files import checkpoint_steps, verify_manifest, write_manifest
from mscale_jax.resilience.driver import claim, injector
from mscale_jax.resilience.driver.claim import latest_checkpoint
from mscale_jax.resilience.events import Heartbeat
from mscale_jax.resilience.faults import DRIVER, parse_fault, parse_faults
from mscale_jax.resilience.worker import selfcheck
from mscale_jax.resilience.worker.faults import corrupt_received


# -- the grammar -------------------------------------------------------------------------------

def test_os_fault_specs_parse_with_defaults():
  stop, contend, corrupt, io, driver, coordinator = parse_faults([
      "stop:step=5", "contend:step=9", "corrupt_checkpoint:step=20", "io_error:step=30",
      "kill_driver:step=40", "kill_coordinator:step=50"])
  assert (stop.rank, stop.step) == (1, 5)
  assert (contend.rank, contend.seconds) == (1, 30.0)
  assert (corrupt.rank, io.seconds, coordinator.step, driver.index) == (0, 0.0, 50, 4)
  assert all(f.injected_by == DRIVER for f in (stop, contend, corrupt, io, driver, coordinator))
  assert parse_fault("contend:rank=0:step=3:seconds=2.5").spec == \
      "contend:rank=0:step=3:seconds=2.5"
  assert parse_fault("bad_slot:slot=1").step == 1
  assert parse_fault("bad_slot:slot=1:step=35").spec == "bad_slot:slot=1:step=35"


@pytest.mark.parametrize("spec,why", [
    ("stop:rank=1", "needs step"), ("contend:step=3:seconds=0", "seconds > 0"),
    ("io_error:step=3:seconds=-1", "seconds"), ("kill_driver:step=2:rank=1", "keys of"),
    ("corrupt_checkpoint:step=x", "integer"),
])
def test_bad_os_fault_specs_name_what_is_valid(spec, why):
  with pytest.raises(ConfigError, match=why):
    parse_fault(spec)


# -- checksum manifests ------------------------------------------------------------------------

def _folder(path, rng):
  os.makedirs(path / "state" / "d", exist_ok=True)
  for name in ("state/d/a", "state/d/b", "meta"):
    (path / name).write_bytes(rng.bytes(int(rng.integers(100, 5000))))


def test_a_manifest_notices_a_flipped_byte_a_truncation_and_a_missing_file(tmp_path):
  rng = np.random.default_rng(0)
  _folder(tmp_path / "7", rng)
  assert verify_manifest(str(tmp_path / "7")) is None   # no manifest: an older checkpoint
  files = write_manifest(str(tmp_path / "7"))
  assert sorted(files) == ["meta", "state/d/a", "state/d/b"]
  assert verify_manifest(str(tmp_path / "7")) is None
  changed = injector.flip_bytes(str(tmp_path / "7"))
  assert changed.startswith("state/") and "checksum" in verify_manifest(str(tmp_path / "7"))
  write_manifest(str(tmp_path / "7"))
  with open(tmp_path / "7" / "meta", "r+b") as f:
    f.truncate(10)
  assert "bytes" in verify_manifest(str(tmp_path / "7"))
  os.remove(tmp_path / "7" / "meta")
  assert "missing" in verify_manifest(str(tmp_path / "7"))


def test_checkpoint_steps_lists_complete_and_corrupt_checkpoints_not_half_written_ones(tmp_path):
  rng = np.random.default_rng(1)
  directory = tmp_path / "checkpoints"
  assert checkpoint_steps(str(directory)) == []                  # no folder yet
  for step in (5, 10, 20):
    _folder(directory / str(step), rng)
  for step in (10, 20):
    write_manifest(str(directory / str(step)))
  _folder(directory / "30.orbax-checkpoint-tmp-1764150000123456", rng)   # orbax, mid-write
  injector.flip_bytes(str(directory / "20"))                     # corrupt after its manifest
  (directory / "notes.txt").write_text("not a checkpoint")
  assert checkpoint_steps(str(directory)) == [20, 10, 5]         # numeric, newest first
  # What each caller makes of the list: the driver skips the corrupt one; the injector wants
  # a manifest as well; the worker sets the corrupt newest aside and keeps the rest.
  assert latest_checkpoint(str(tmp_path)) == 10
  assert injector.newest_verified_checkpoint(str(directory)) == str(directory / "10")
  from mscale_jax.checkpoint import set_aside_corrupt
  assert [m["step"] for m in set_aside_corrupt(str(directory))] == [20]
  assert checkpoint_steps(str(directory)) == [10, 5]


def _state(seed):
  rng = np.random.default_rng(seed)
  return {"step": jax.numpy.asarray(seed), "w": jax.numpy.asarray(rng.normal(size=(64, 32)),
                                                                   jax.numpy.float32)}


def _save(checkpointer, step, state, tiny_config):
  checkpointer.save(step, state, {"position": step}, tiny_config())


def test_restore_falls_back_past_a_corrupt_checkpoint_and_says_so(tmp_path, tiny_config, caplog):
  from mscale_jax.checkpoint import Checkpointer, abstract_like
  directory = str(tmp_path / "checkpoints")
  first = Checkpointer(directory, keep=3, async_save=True)
  for step in (10, 20):
    _save(first, step, _state(step), tiny_config)
  first.close()
  for step in (10, 20):   # the async save's manifest, written once orbax committed it
    assert os.path.exists(os.path.join(directory, str(step), "manifest.json"))
  assert latest_checkpoint(str(tmp_path)) == 20
  assert injector.newest_verified_checkpoint(directory).endswith("/20")
  injector.flip_bytes(os.path.join(directory, "20"))
  assert latest_checkpoint(str(tmp_path)) == 10   # what the driver expects to be restored

  second = Checkpointer(directory, keep=3)
  assert [m["step"] for m in second.set_aside] == [20]
  assert "checksum" in second.set_aside[0]["problem"]
  assert "step 20 is corrupt" in caplog.text and "previous complete" in caplog.text
  assert second.latest_step() == 10
  assert os.listdir(tmp_path / "checkpoints_corrupt")[0].startswith("20-")   # kept, not lost
  restored = second.restore(10, abstract_like(_state(10), jax.tree.map(lambda x: x.sharding,
                                                                         _state(10))))
  np.testing.assert_array_equal(restored["w"], _state(10)["w"])
  _save(second, 20, _state(21), tiny_config)   # step 20 can be written again
  second.close()
  assert second.all_steps() == [10, 20] and verify_manifest(os.path.join(directory, "20")) is None


def test_a_checkpoint_directory_that_refuses_writes_is_a_clear_error(tmp_path, tiny_config):
  from mscale_jax.checkpoint import Checkpointer, CheckpointWriteError
  directory = str(tmp_path / "checkpoints")
  checkpointer = Checkpointer(directory, keep=2, async_save=True)
  _save(checkpointer, 4, _state(4), tiny_config)
  checkpointer.wait()
  how = injector.make_read_only(directory)
  try:
    with pytest.raises(CheckpointWriteError) as error:
      _save(checkpointer, 8, _state(8), tiny_config)
  finally:
    injector.make_writable(directory)
  message = str(error.value)
  assert "step 8" in message and directory in message, how
  assert "latest complete checkpoint is still step 4" in message
  assert sorted(d for d in os.listdir(directory) if d.isdigit()) == ["4"]
  assert verify_manifest(os.path.join(directory, "4")) is None


def test_a_write_refused_in_the_background_is_raised_by_the_next_check(tmp_path, tiny_config,
                                                                      monkeypatch):
  """The directory turns read-only while a save is being written behind the loop (where a fault
  from outside lands when it comes a moment late), so orbax's final rename fails: its
  finalizing thread only logs the error, and the next step's check must notice the missing
  checkpoint itself."""
  from mscale_jax.checkpoint import Checkpointer, CheckpointWriteError
  directory = str(tmp_path / "checkpoints")
  checkpointer = Checkpointer(directory, keep=2, async_save=True)
  _save(checkpointer, 4, _state(4), tiny_config)
  checkpointer.wait()
  manifest = checkpointer._manifest

  def manifest_then_refuse(step):   # runs in orbax's thread, just before the rename
    manifest(step)
    injector.make_read_only(directory)
  monkeypatch.setattr(checkpointer, "_manifest", manifest_then_refuse)
  try:
    _save(checkpointer, 8, _state(8), tiny_config)   # returns; the write goes on behind
    checkpointer.launched()
    try:
      checkpointer._manager.wait_until_finished()
    except Exception:   # orbax may surface it itself; check must report it either way
      pass
    with pytest.raises(CheckpointWriteError) as error:
      checkpointer.check()
  finally:
    injector.make_writable(directory)
  assert "checkpoint step 8 could not be written" in str(error.value)
  assert "latest complete checkpoint is still step 4" in str(error.value)
  assert checkpoint_steps(directory) == [4]
  checkpointer.check()   # reported once
  monkeypatch.undo()
  _save(checkpointer, 12, _state(12), tiny_config)   # writable again: saves resume
  checkpointer.close()
  assert checkpoint_steps(directory) == [12, 4]


# -- the injector on real processes ------------------------------------------------------------

class _Workers:
  """Stand-in worker processes (sleepers, each leading its own process group)."""

  def __init__(self, count):
    self.procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                   process_group=0) for _ in range(count)]

  def close(self):
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.wait()


@pytest.fixture
def workers():
  w = _Workers(2)
  yield w
  w.close()


def _state_of(pid):
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rsplit(")", 1)[1].split()[0]


def test_faults_fire_on_the_step_every_rank_reached_not_on_a_rank_running_ahead():
  def beats(*steps):
    return {rank: (Heartbeat(rank=rank, host="h", pid=1, step=step), 0.0)
            for rank, step in enumerate(steps)}
  assert injector.group_step(beats(7, 4), ranks=2) == 4   # rank 1 stopped at 4, rank 0 ran on
  assert injector.group_step(beats(9, 9), ranks=2) == 9
  assert injector.group_step(beats(9), ranks=2) == 0      # rank 1 has not reported yet


def test_stop_and_kill_coordinator_act_on_the_worker_processes(tmp_path, workers):
  said = []
  inject = injector.OsInjector(parse_faults(["stop:rank=1:step=3", "kill_coordinator:step=5"]),
                               str(tmp_path / "resilience"), said.append)
  inject.poll(workers.procs, 2)
  assert said == [] and _state_of(workers.procs[1].pid) != "T"
  inject.poll(workers.procs, 3)
  time.sleep(0.2)
  assert _state_of(workers.procs[1].pid) == "T" and workers.procs[0].poll() is None
  inject.poll(workers.procs, 6)
  assert workers.procs[0].wait(timeout=10) == -signal.SIGKILL
  markers = sorted(os.listdir(tmp_path / "resilience" / "faults"))
  assert markers == ["0-stop-driver.json", "1-kill_coordinator-driver.json"]
  marker = json.loads((tmp_path / "resilience" / "faults" / markers[0]).read_text())
  assert (marker["step"], marker["pid"]) == (3, workers.procs[1].pid)
  inject.poll(workers.procs, 7)   # fired once per job: a marker is there
  assert len(said) == 2


def test_a_fault_for_a_rank_the_shrunk_group_lacks_is_recorded_not_fired(tmp_path, workers):
  """After a slot is excluded with no spare left, the group has fewer ranks than a fault names:
  the driver records the fault as skipped (seen in a drill: an IndexError ended the driver)."""
  said = []
  inject = injector.OsInjector(parse_faults(["stop:rank=1:step=3", "corrupt_checkpoint:rank=1:"
                                             "step=3"]), str(tmp_path / "resilience"), said.append)
  inject.poll(workers.procs[:1], 3)
  time.sleep(0.2)
  assert "T" not in [_state_of(p.pid) for p in workers.procs]
  assert all(p.poll() is None for p in workers.procs)
  markers = sorted((tmp_path / "resilience" / "faults").iterdir())
  assert [json.loads(m.read_text())["skipped"] for m in markers] == \
      ["rank 1 is not in the 1-process group"] * 2
  assert len(said) == 2 and all("skipped" in line for line in said)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="contend needs 2 cores")
def test_contend_pins_the_workers_and_runs_a_busy_process_on_one_core(tmp_path, workers):
  before = os.sched_getaffinity(workers.procs[0].pid)
  inject = injector.OsInjector(parse_faults(["contend:rank=1:step=1:seconds=1"]),
                               str(tmp_path / "resilience"), lambda _: None)
  inject.poll(workers.procs, 1)
  marker = json.loads(next((tmp_path / "resilience" / "faults").iterdir()).read_text())
  cores = sorted(before)
  assert os.sched_getaffinity(workers.procs[1].pid) == {cores[1]} == {marker["core"]}
  assert os.sched_getaffinity(workers.procs[0].pid) == {cores[0]}
  assert os.sched_getaffinity(marker["busy_pid"]) == {cores[1]}
  inject.poll(workers.procs, 2, now=time.time() + 2)   # its time is up: all undone
  assert os.sched_getaffinity(workers.procs[1].pid) == before
  assert not os.path.exists(f"/proc/{marker['busy_pid']}") or \
      _state_of(marker["busy_pid"]) == "Z"


def test_corrupt_checkpoint_waits_for_a_committed_checkpoint_then_kills(tmp_path, workers):
  inject = injector.OsInjector(parse_faults(["corrupt_checkpoint:rank=1:step=2"]),
                               str(tmp_path / "resilience"), lambda _: None)
  inject.poll(workers.procs, 5)
  assert workers.procs[1].poll() is None   # no checkpoint with a manifest yet
  rng = np.random.default_rng(1)
  for step in (4, 8):
    _folder(tmp_path / "checkpoints" / str(step), rng)
  write_manifest(str(tmp_path / "checkpoints" / "4"))   # 8: committed, manifest not yet written
  inject.poll(workers.procs, 9)
  assert workers.procs[1].wait(timeout=10) == -signal.SIGKILL
  assert "checksum" in verify_manifest(str(tmp_path / "checkpoints" / "4"))
  assert latest_checkpoint(str(tmp_path)) == 8   # no manifest: trusted, as before manifests


def test_io_error_lasts_until_the_failure_is_detected(tmp_path, workers):
  inject = injector.OsInjector(parse_faults(["io_error:step=1"]),
                               str(tmp_path / "resilience"), lambda _: None)
  inject.poll(workers.procs, 1)
  with pytest.raises(OSError):
    (tmp_path / "checkpoints" / "x").mkdir()
  inject.failure_detected()
  (tmp_path / "checkpoints" / "x").mkdir()


# -- the driver's claim on a workdir, and whom a coordination error blames ----------------------

def test_a_claim_names_a_live_driver_and_ends_a_dead_ones_workers(tmp_path, workers):
  state = str(tmp_path / "resilience")
  driver = workers.procs[0]
  claim.write(state, [workers.procs[1].pid], {"started": 1.0})
  record = claim.read(state)
  record["driver"] = {"pid": driver.pid, "start": claim.start_time(driver.pid)}
  (tmp_path / "resilience" / claim.NAME).write_text(json.dumps(record))
  assert claim.live_driver(state) == driver.pid
  os.killpg(driver.pid, signal.SIGKILL)
  driver.wait()
  assert claim.live_driver(state) is None
  stale = dict(record, workers=[{"pid": workers.procs[1].pid, "start": 1}])   # a recycled pid
  assert claim.end_leftover_workers(stale) == [] and workers.procs[1].poll() is None
  assert claim.end_leftover_workers(record) == [workers.procs[1].pid]
  assert workers.procs[1].wait(timeout=10) == -signal.SIGKILL


# -- a bad slot --------------------------------------------------------------------------------

def test_corrupt_received_changes_every_97th_element():
  x = np.random.default_rng(2).normal(size=(3, 100)).astype(np.float32)
  bad = np.asarray(corrupt_received(x))
  changed = np.flatnonzero(bad.ravel() != x.ravel())
  np.testing.assert_array_equal(changed, np.arange(0, x.size, 97))


def test_the_self_check_blames_a_slot_that_receives_corrupt_results():
  probe = lambda rank, wrong: {"rank": rank, "matmul_gflops": 50.0, "write": {"ok": True},  # noqa
                               "allgather": {"wrong_ranks": wrong}}
  verdict = selfcheck.judge({0: probe(0, []), 2: probe(1, [0, 1])})
  assert verdict[0] is None and "received were corrupt" in verdict[2]


@pytest.mark.slow
def test_a_bad_slot_hurts_training(tiny_config, tmp_path):
  from mscale_jax.callbacks.worker import BadSlot
  from mscale_jax.train import Trainer
  config = tiny_config(train=dict(steps=6, log_every=1, eval_every=6, checkpoint_every=6))
  losses = {}
  for name, callbacks in (("clean", []), ("bad", [BadSlot(3, slot=0)])):
    trainer = Trainer(config, str(tmp_path / name), show_progress=False, callbacks=callbacks)
    trainer.train()
    with open(tmp_path / name / "metrics.jsonl") as f:
      losses[name] = {r["step"]: r["loss"] for r in map(json.loads, f)}
  assert [losses["bad"][s] for s in (1, 2, 3)] == [losses["clean"][s] for s in (1, 2, 3)]
  assert all(losses["bad"][s] != losses["clean"][s] for s in (4, 5, 6))
  assert os.path.exists(tmp_path / "bad" / "resilience" / "bad_slots" / "slot0.json")


# -- traces of a restarted run -----------------------------------------------------------------

def test_a_replayed_step_counts_once_in_the_merged_timeline(tmp_path):
  from mscale_jax.observability import timeline
  rng = np.random.default_rng(3)
  lines, want = [], {}
  for attempt, steps in ((0, range(1, 7)), (1, range(5, 9))):   # steps 5 and 6 replayed
    lines.append({"meta": {"rank": 0, "attempt": attempt}})
    for step in steps:
      for name in ("dispatch", "sync"):
        seconds = float(rng.uniform(0.01, 0.2))
        start = float(rng.uniform(0, 100))
        lines.append({"name": name, "track": "loop", "step": step, "start": start,
                      "end": start + seconds})
        want.setdefault(attempt, {}).setdefault(step, {})[name] = seconds
  path = tmp_path / "rank0.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  _, spans = timeline.read_rank_file(str(path))
  got = timeline.per_iteration(spans)
  assert sorted(got) == list(range(1, 9))
  for step in range(1, 9):
    last = want[1] if step >= 5 else want[0]
    assert got[step] == pytest.approx(last[step])


def test_a_second_launch_into_a_workdir_whose_driver_lives_is_refused(tmp_path, workers):
  driver = workers.procs[0]   # stands in for a running driver
  claim.write(str(tmp_path / "resilience"), [], {"started": 1.0})
  record = claim.read(str(tmp_path / "resilience"))
  record["driver"] = {"pid": driver.pid, "start": claim.start_time(driver.pid)}
  (tmp_path / "resilience" / claim.NAME).write_text(json.dumps(record))
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
      [sys.executable, "-m", "experiments.launch", f"--workdir={tmp_path}"], cwd=repo,
      capture_output=True, text=True, timeout=120,
      env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo))
  assert result.returncode == 2, result.stderr[-2000:]
  [line] = [x for x in result.stderr.splitlines() if x.startswith("error:")]
  assert f"driver pid {driver.pid} runs this job" in line and "Traceback" not in result.stderr
  assert sorted(os.listdir(tmp_path)) == ["resilience"]   # nothing started or written


def test_a_resumed_driver_files_the_dead_ones_failure_and_its_last_self_check(tmp_path):
  from mscale_jax.files import write_json
  from mscale_jax.resilience.driver.supervisor import Driver, DriverOptions
  state = tmp_path / "resilience"
  io = {"kind": "exception", "rank": 0, "detail": "CheckpointWriteError", "step": 370,
        "detected_at": 5.0, "happened_at": 4.0, "attempt": 3, "injected": "io_error:step=365"}
  claim.write(str(state), [], {
      "group": {"attempt": 4, "slots": [0, 2], "started": 6.0}, "started": 1.0,
      "outcome": None, "restarts": 3, "attempts": [{"attempt": a, "ended": 2.0 + a}
                                                   for a in range(4)],
      "failures": [io], "excluded": {"1": "corrupt"},
      "straggler_flags": [{"attempt": 2, "rank": 1, "step": 200, "metric": "host"}],
      "hang_localisations": [{"attempt": 1, "odd_ranks": [0]}]})
  write_json(str(state / "selfcheck-4" / "verdict.json"),
             {"seconds": 0.7, "results": {}, "excluded": {}})
  write_json(str(state / "faults" / "9-kill_driver-driver.json"),
             {"fault": "kill_driver:step=410", "rank": 0, "step": 410, "time": 8.0})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n"
                                                  for s in range(1, 413)))
  os.makedirs(tmp_path / "checkpoints" / "410")
  driver = Driver(DriverOptions(worker_command=["true"], workdir=str(tmp_path)),
                  out=open(os.devnull, "w"))
  started, first_attempt = driver._resume()
  assert (started, first_attempt, driver.excluded) == (1.0, 5, {1: "corrupt"})
  assert driver.failures[0]["diagnosis"]["seconds"] == 0.7   # the io_error's restart checked
  lost = driver.failures[1]
  assert (lost["kind"], lost["injected"], lost["happened_at"]) == \
      ("driver_lost", "kill_driver:step=410", 8.0)
  assert (lost["last_step"], lost["restore_step"], lost["steps_lost"]) == (412, 410, 2)
  assert driver.attempts[-1]["slots"] == [0, 2] and driver.attempts[-1]["started"] == 6.0
  # The dead driver's straggler flags and hang localisations reach the new driver's report.
  summary = driver.observer.summary()
  assert summary["straggler_flags"][0]["step"] == 200
  assert summary["hang_localisations"] == [{"attempt": 1, "odd_ranks": [0]}]
  driver._claim([])
  assert claim.read(str(state))["straggler_flags"] == summary["straggler_flags"]
