"""A resuming trainer loads its train step on a thread of its own while it restores
(`Trainer._start`, `compile_cache.Loading`): the same state bitwise, errors still surface."""
import shutil
import threading
import types

import jax
import numpy as np
import pytest

from mscale_jax import compile_cache
from mscale_jax.callbacks.base import Callback
from mscale_jax.train import OVERLAP_SWITCH, Trainer


def _resumable(tiny_config, tmp_path):
  """A config and a workdir holding its step-2 checkpoint."""
  config = tiny_config(train=dict(steps=4, log_every=1, eval_every=4, checkpoint_every=2,
                                  async_checkpoint=False))
  Trainer(config, str(tmp_path / "first"), show_progress=False).train(stop_at=2)
  return config, str(tmp_path / "first")


def _lowerings(trainer):
  """Records, per lowering of the train step, its thread and whether the state was abstract."""
  seen, lower = [], trainer.lower_step

  def recording(state, batch):
    seen.append((threading.current_thread() is threading.main_thread(),
                 all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))))
    return lower(state, batch)
  trainer.lower_step = recording
  return seen


@pytest.fixture
def no_cache():
  """No compile cache folder: every program is lowered and compiled (none is served)."""
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  yield
  jax.config.update("jax_compilation_cache_dir", previous)


def test_the_resumed_step_is_lowered_beside_the_restore_and_steps_bitwise_alike(
    tiny_config, tmp_path, monkeypatch, caplog, no_cache):
  """Resuming with the overlap lowers the step once, off the main thread, for the abstract
  state; the next step's state is bitwise what the one-after-the-other start gives."""
  config, workdir = _resumable(tiny_config, tmp_path)
  sequential_dir = str(tmp_path / "sequential")
  shutil.copytree(workdir, sequential_dir)
  states, lowerings = {}, {}
  for arm, folder in (("overlapped", workdir), ("sequential", sequential_dir)):
    monkeypatch.setenv(OVERLAP_SWITCH, "1" if arm == "overlapped" else "0")
    trainer = Trainer(config, folder, show_progress=False)
    lowerings[arm] = _lowerings(trainer)
    caplog.clear()
    with caplog.at_level("INFO", logger="mscale_jax"):
      summary = trainer.train(stop_at=3)
    assert summary["start_step"] == 2
    assert ("beside the restore" in caplog.text) == (arm == "overlapped")
    states[arm] = jax.device_get(trainer.final_state)
  assert lowerings == {"overlapped": [(False, True)], "sequential": [(True, False)]}
  leaves = jax.tree.leaves_with_path(states["overlapped"])
  assert len(leaves) > 3
  for (path, a), b in zip(leaves, jax.tree.leaves(states["sequential"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=jax.tree_util.keystr(path))


class _Errors(Callback):
  def __init__(self):
    self.seen = []

  def on_error(self, run, error):
    self.seen.append(error)


def test_an_error_in_the_background_load_reaches_the_loop_and_its_callbacks(
    tiny_config, tmp_path, monkeypatch, no_cache):
  """The load's thread fails (as a compilation that runs out of memory would): `train` raises
  that error, with its traceback, and the callbacks that tell the driver hear it."""
  monkeypatch.setenv(OVERLAP_SWITCH, "1")
  config, workdir = _resumable(tiny_config, tmp_path)
  errors = _Errors()
  trainer = Trainer(config, workdir, show_progress=False, callbacks=[errors])

  def failing_lowering(state, batch):
    raise RuntimeError("RESOURCE_EXHAUSTED while compiling the train step")
  trainer.lower_step = failing_lowering
  with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED") as raised:
    trainer.train(stop_at=3)
  assert errors.seen == [raised.value]
  assert raised.traceback[-1].name == "failing_lowering"   # where it was raised, on the thread


def test_a_load_started_for_other_arguments_is_not_used(tiny_config, tmp_path, caplog,
                                                        no_cache):
  """Arguments whose abstract values differ from those the load started for (here a state in
  another sharding) get their own program: a mismatched executable is never returned."""
  config, workdir = _resumable(tiny_config, tmp_path)
  trainer = Trainer(config, workdir, show_progress=False)
  batch = trainer.device_batch(next(trainer.train_iter))
  abstract = trainer.abstract_state()
  loading = compile_cache.Loading(trainer.lower_step, (abstract, batch), "train_step",
                                  trainer.mesh, trainer.program_recipe)
  replicated = jax.sharding.NamedSharding(trainer.mesh, jax.sharding.PartitionSpec())
  other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                       abstract)
  with caplog.at_level("WARNING", logger="mscale_jax"):
    program, _ = loading.result((other, batch))
  assert "differ from those its load was started for" in caplog.text
  assert jax.tree.leaves(program.input_shardings[0][0])[0] == replicated


def test_a_load_done_again_for_other_arguments_counts_in_its_seconds(monkeypatch):
  """`seconds` (the trainer's `compile_s`) holds every load `result` waited for: after a
  mismatch, the thread's load and the one done again (a clock each load moves by 3 s)."""
  clock = [100.0]
  monkeypatch.setattr(compile_cache, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

  def load(lower, args, name, mesh, built_from):
    clock[0] += 3.0
    return f"program for {args[0].shape}", "compiled"
  monkeypatch.setattr(compile_cache, "load_or_lower", load)
  started_for = (jax.ShapeDtypeStruct((4, 8), np.float32),)
  same = compile_cache.Loading(None, started_for, "train_step", None, "recipe")
  assert same.result(started_for) == ("program for (4, 8)", "compiled")
  assert same.seconds == 3.0
  other = compile_cache.Loading(None, started_for, "train_step", None, "recipe")
  assert other.result((jax.ShapeDtypeStruct((4, 16), np.float32),)) == \
      ("program for (4, 16)", "compiled")
  assert other.seconds == 6.0
