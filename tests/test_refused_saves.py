"""A checkpoint save the operating system refuses (callbacks/checkpointing.py): the directory
turns read-only under a real training run (the immutable attribute as root, as the io_error
fault does; no write permission otherwise), in the save itself or while its background write is
being committed. The refused save is dropped whole, training goes on as it would have and the
next save tries again; `train.max_refused_saves` refusals in a row stop the run."""
import glob
import json
import os
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from mscale_jax.callbacks import Callback
from mscale_jax.checkpoint import TMP_MARK, Checkpointer, CheckpointWriteError
from mscale_jax.config import Config
from mscale_jax.files import checkpoint_steps, verify_manifest
from mscale_jax.resilience.driver import injector
from mscale_jax.train import Trainer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "refused_save_worker.py")


class ReadOnly(Callback):
  """Makes the checkpoint folder read-only before the steps `read_only_at` and writable again
  before the steps `writable_at`; `refuse_commit`: step whose background write is refused just
  before orbax renames it (the folder turns read-only from orbax's own thread, and writable
  again once the refusal is reported, as the driver's io_error fault does). Records each
  refused save and what was the latest checkpoint then."""

  def __init__(self, read_only_at=(), writable_at=(), refuse_commit=None):
    self.read_only_at, self.writable_at = read_only_at, writable_at
    self.refuse_commit = refuse_commit
    self.refused = []

  def on_loop_start(self, run):
    self.directory = run.trainer.checkpointer.directory
    if self.refuse_commit is not None:
      checkpointer = run.trainer.checkpointer
      manifest = checkpointer._manifest

      def manifest_then_refuse(step):   # orbax's thread, just before the commit's rename
        manifest(step)
        if step == self.refuse_commit:
          injector.make_read_only(self.directory)
      checkpointer._manifest = manifest_then_refuse

  def on_step_start(self, run, step):
    if self.refuse_commit is not None and step == self.refuse_commit + 1:
      run.trainer.checkpointer.launched()
      while run.trainer.checkpointer._manager.is_saving_in_progress():
        time.sleep(0.01)   # the refused write ends before the loop looks (found by `check`)
    if step in self.read_only_at:   # between saves: the one before is committed first
      run.trainer.checkpointer.launched()
      run.trainer.checkpointer._manager.wait_until_finished()
      injector.make_read_only(self.directory)
    if step in self.writable_at:
      injector.make_writable(self.directory)

  def on_save_refused(self, run, step, error):
    self.refused.append((step, run.trainer.checkpointer.latest_step(), str(error)))
    if step == self.refuse_commit:
      injector.make_writable(self.directory)


def _refuse_commit(checkpointer, refused_step):
  """The folder turns read-only from orbax's thread just before it renames `refused_step`."""
  manifest = checkpointer._manifest

  def manifest_then_refuse(step):
    manifest(step)
    if step == refused_step:
      injector.make_read_only(checkpointer.directory)
  checkpointer._manifest = manifest_then_refuse


def _state(seed):
  return {"w": jnp.asarray(np.random.default_rng(seed).normal(size=(8, 4)), jnp.float32)}


@pytest.mark.parametrize("first", ["check", "wait"])
def test_a_refused_background_write_is_reported_once(tmp_path, first):
  """Step 4's commit is refused and its background write ends before the loop looks: the
  first of `check` (the next step) and `wait` (the next save) reports it, the other does not
  report it again."""
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), keep=3)
  checkpointer.save(2, _state(2), {"position": 2}, Config())
  checkpointer.wait()
  _refuse_commit(checkpointer, 4)
  checkpointer.save(4, _state(4), {"position": 4}, Config())
  try:
    checkpointer.launched()
    while checkpointer._manager.is_saving_in_progress():   # the write ends first
      time.sleep(0.01)
    with pytest.raises(CheckpointWriteError, match="checkpoint step 4 could not") as error:
      getattr(checkpointer, first)()
    assert error.value.step == 4
    assert checkpointer.latest_step() == 2 and checkpointer.all_steps() == [2]
  finally:
    injector.make_writable(checkpointer.directory)
  checkpointer.check()   # neither reports it again
  checkpointer.wait()
  checkpointer.discard(4)
  checkpointer.save(6, _state(6), {"position": 6}, Config())
  checkpointer.close()
  assert checkpoint_steps(checkpointer.directory) == [6, 2]
  assert sorted(os.listdir(checkpointer.directory)) == ["2", "6"]


def _config(tiny_config, **train):
  return tiny_config(train=dict(dict(steps=12, global_batch=4, log_every=1, eval_every=12,
                                     checkpoint_every=2), **train))


def _losses(workdir) -> list[tuple[int, float]]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f)]


@pytest.mark.slow   # real training runs
def test_refused_saves_are_dropped_and_training_goes_on(tiny_config, tmp_path):
  clean = Trainer(_config(tiny_config), str(tmp_path / "clean"), show_progress=False)
  clean.train()
  # Step 6's save is refused at once (read-only for steps 5-6); step 8's is refused while its
  # background write commits, which ends before step 9 (found by the check after a step, and
  # not again by the next save's wait).
  faulty = ReadOnly(read_only_at=(5,), writable_at=(7,), refuse_commit=8)
  trainer = Trainer(_config(tiny_config), str(tmp_path / "faulty"), show_progress=False,
                    callbacks=[faulty])
  try:
    summary = trainer.train()
  finally:
    injector.make_writable(str(tmp_path / "faulty" / "checkpoints"))
  assert [(step, latest) for step, latest, _ in faulty.refused] == [(6, 4), (8, 4)]
  (_, _, at_once), (_, _, behind) = faulty.refused
  assert "checkpoint step 6 could not be written" in at_once and "write-probe" in at_once
  assert "checkpoint step 8 could not be written" in behind and "write-probe" not in behind
  assert [r["step"] for r in summary["refused_saves"]] == [6, 8]
  # The saves after them went through; no half checkpoint was left behind (orbax may keep an
  # old one it could not delete while the folder refused changes: complete, never the latest).
  directory = str(tmp_path / "faulty" / "checkpoints")
  assert checkpoint_steps(directory)[:2] == [12, 10]
  assert set(checkpoint_steps(directory)) <= {12, 10, 4, 2}
  assert all(verify_manifest(os.path.join(directory, str(s))) is None
             for s in checkpoint_steps(directory))
  assert glob.glob(os.path.join(directory, f"*{TMP_MARK}*")) == []
  # Every step logged once, with the loss of the run that met no refusal.
  assert _losses(tmp_path / "faulty") == _losses(tmp_path / "clean")
  assert [s for s, _ in _losses(tmp_path / "faulty")] == list(range(1, 13))


@pytest.mark.slow   # real training runs
def test_max_refused_saves_in_a_row_stop_the_run(tiny_config, tmp_path):
  faulty = ReadOnly(read_only_at=(3,))
  trainer = Trainer(_config(tiny_config, max_refused_saves=2), str(tmp_path),
                    show_progress=False, callbacks=[faulty])
  directory = str(tmp_path / "checkpoints")
  try:
    with pytest.raises(CheckpointWriteError, match="checkpoint step 6 could not be written"):
      trainer.train()
  finally:
    injector.make_writable(directory)
  assert [(step, latest) for step, latest, _ in faulty.refused] == [(4, 2)]
  assert checkpoint_steps(directory) == [2]
  assert [s for s, _ in _losses(tmp_path)] == list(range(1, 7))


@pytest.mark.slow   # real training runs
def test_two_processes_both_drop_a_save_whose_commit_process_0_could_not_make(tmp_path):
  """Two JAX processes (jax.distributed) save into one folder; it turns read-only just before
  process 0 renames step 8's folder (tests/refused_save_worker.py). Process 1, waiting for that
  commit at orbax's barrier, is let go instead of waiting minutes; both report step 8 refused
  (and no longer list it) and save step 8 again. Step 12, whose write fails on process 1 alone,
  is not committed by process 0 either: both report it refused. A second Checkpointer of the
  folder saves 16."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", MSCALE_NUM_PROCESSES="2",
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             MSCALE_COORDINATOR=f"127.0.0.1:{port}", DUMP_AFTER="150")
  directory = str(tmp_path / "checkpoints")
  procs = [subprocess.Popen([sys.executable, WORKER, directory], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(env, MSCALE_PROCESS_ID=str(rank)))
           for rank in range(2)]
  try:
    outputs = [p.communicate(timeout=180)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
    injector.make_writable(directory)
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
  seen = [json.loads(o.strip().splitlines()[-1]) for o in outputs]
  assert [s["refused"] for s in seen] == [[8, 12], [8, 12]], seen
  assert [s["latest_after_refusal"] for s in seen] == [4, 4], seen
  assert checkpoint_steps(directory) == [16, 8, 4], "\n".join(o[-4000:] for o in outputs)
  assert sorted(os.listdir(directory)) == ["16", "4", "8"]   # no temporary folder left


@pytest.mark.parametrize("where", ["orbax", "verify"])
def test_check_after_a_save_reports_its_launch_failure_at_once(tmp_path, where):
  """The launch thread of save 4 is still running when the next step's `check` comes (orbax's
  synchronous part, or the replica verdict, fails after a while): `check` waits for it and
  raises its error then, on every process at the same step, not at some later step."""
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
  save, verify = checkpointer._save, None

  def fail_late(*args):
    time.sleep(0.3)
    raise OSError(28, "No space left on device (injected)")
  if where == "orbax":
    checkpointer._save = lambda step, *a: fail_late() if step == 4 else save(step, *a)
  else:
    verify = fail_late
  checkpointer.save(2, _state(2), {"position": 2}, Config())
  checkpointer.wait()
  checkpointer.save(4, _state(4), {"position": 4}, Config(), verify=verify)
  with pytest.raises(CheckpointWriteError if where == "orbax" else OSError,
                     match="No space left") as error:
    checkpointer.check()
  if where == "orbax":
    assert error.value.step == 4
  checkpointer.discard(4)
  checkpointer.close()
  assert checkpointer.all_steps() == [2]


class _Hears(Callback):
  """Listed after Checkpointing: the errors it hears, and whether its on_loop_end ran."""

  def __init__(self):
    self.errors, self.ended = [], False

  def on_error(self, run, error):
    self.errors.append(error)

  def on_loop_end(self, run):
    self.ended = True


@pytest.mark.slow   # a real training run
def test_the_last_saves_refusal_is_raised_in_the_loop(tiny_config, tmp_path):
  """Orbax refuses the last save (step 4) in its synchronous part, on the launch thread: the
  run fails with it inside the loop, so the callbacks hear on_error (the driver's report) and
  every one still gets on_loop_end (it was raised by close() in the loop's cleanup)."""
  hears = _Hears()
  trainer = Trainer(_config(tiny_config, steps=4), str(tmp_path), show_progress=False,
                    callbacks=[hears])
  save = trainer.checkpointer._save

  def refuse_last(step, *args):
    if step == 4:
      raise OSError(28, "No space left on device (injected)")
    return save(step, *args)
  trainer.checkpointer._save = refuse_last
  with pytest.raises(CheckpointWriteError, match="checkpoint step 4 could not be written"):
    trainer.train()
  assert [type(e) for e in hears.errors] == [CheckpointWriteError]
  assert hears.errors[0].step == 4 and hears.ended
  assert checkpoint_steps(str(tmp_path / "checkpoints")) == [2]


@pytest.mark.slow   # a real training run
def test_the_last_saves_refused_background_write_is_raised_in_the_loop(tiny_config, tmp_path):
  """The folder turns read-only just before orbax renames the last save's folder (its
  background write, after the launch): that refusal too is raised inside the loop, heard by
  on_error, and every callback still gets on_loop_end."""
  hears, read_only = _Hears(), ReadOnly(refuse_commit=4)
  trainer = Trainer(_config(tiny_config, steps=4), str(tmp_path), show_progress=False,
                    callbacks=[read_only, hears])
  try:
    with pytest.raises(CheckpointWriteError, match="checkpoint step 4 could not be written"):
      trainer.train()
  finally:
    injector.make_writable(str(tmp_path / "checkpoints"))
  assert [type(e) for e in hears.errors] == [CheckpointWriteError]
  assert hears.errors[0].step == 4 and hears.ended
  assert checkpoint_steps(str(tmp_path / "checkpoints")) == [2]


def test_closing_the_checkpointer_does_not_raise_over_a_failing_run():
  """A save's failure found by the final close() is raised if the run was going well, and only
  logged while another error is already unwinding (it would replace that error)."""
  from types import SimpleNamespace

  from mscale_jax.callbacks.checkpointing import Checkpointing

  def close():
    raise CheckpointWriteError("checkpoint step 8 could not be written (injected)", 8)
  run = SimpleNamespace(trainer=SimpleNamespace(checkpointer=SimpleNamespace(close=close)),
                        phase=lambda name, step=None: None)
  checkpointing = Checkpointing()
  with pytest.raises(CheckpointWriteError):
    checkpointing.on_loop_end(run)
  checkpointing.on_error(run, RuntimeError("the step failed"))
  checkpointing.on_loop_end(run)   # logged, not raised
