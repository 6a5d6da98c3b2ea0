"""The per-process executable cache: a second compile of the same program loads, and agrees."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mscale_jax import compile_cache


class _EachCallAProcess(dict):
  """A `compile_cache._LIVE` that keeps nothing: every call plays a process of its own, so
  what a test exercises is the entries on disk."""

  def __setitem__(self, key, value):
    pass


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  """A cache folder, each call playing a new process (see `live_programs` for reuse within one)."""
  monkeypatch.setattr(compile_cache, "_LIVE", _EachCallAProcess())
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  yield tmp_path
  jax.config.update("jax_compilation_cache_dir", previous)


@pytest.fixture
def live_programs(cache_dir, monkeypatch, program_counts):
  """`cache_dir` with the process's own reuse on; returns the deserialisations (a list)."""
  monkeypatch.setattr(compile_cache, "_LIVE", {})
  return program_counts.loads


def _mesh(devices=None):
  return jax.make_mesh((2, 4), ("data", "tensor"), devices=devices)


def _lowered(scale: float, mesh=None):
  """A program sharded over every device, as the trainer's steps are."""
  mesh = mesh or _mesh()
  x = jax.device_put(jax.random.normal(jax.random.key(0), (16, 8)),
                     NamedSharding(mesh, P("data", "tensor")))
  f = jax.jit(lambda a, b: jnp.tanh(a * b + 1) * scale)
  return f.lower(x, x), x


def test_the_second_compile_is_loaded_and_computes_the_same(cache_dir):
  lowered, x = _lowered(3.0)
  fresh, loaded = compile_cache.compile_or_load(lowered, "f", _mesh())
  assert not loaded
  (entry,) = os.listdir(cache_dir / "per-process")
  assert entry.startswith("f-p0-") and entry.endswith(".pkl")
  again, loaded = compile_cache.compile_or_load(_lowered(3.0)[0], "f", _mesh())
  assert loaded
  np.testing.assert_array_equal(np.asarray(again(x, x)), np.asarray(fresh(x, x)))
  # Another program is another entry, not a stale hit.
  other, loaded = compile_cache.compile_or_load(_lowered(5.0)[0], "f", _mesh())
  assert not loaded and len(os.listdir(cache_dir / "per-process")) == 2
  np.testing.assert_allclose(np.asarray(other(x, x)), np.asarray(fresh(x, x)) * 5 / 3,
                             rtol=1e-6)


def test_the_same_program_on_the_devices_in_another_order_is_another_entry(cache_dir):
  # Two meshes of one shape lower to the same text; an executable compiled for one refuses
  # the other's arrays, so a shared entry would fail every call after a restart.
  compile_cache.compile_or_load(_lowered(3.0)[0], "f", _mesh())
  reversed_mesh = _mesh(jax.devices()[::-1])
  lowered, x = _lowered(3.0, reversed_mesh)
  executable, loaded = compile_cache.compile_or_load(lowered, "f", reversed_mesh)
  assert not loaded and len(os.listdir(cache_dir / "per-process")) == 2
  expected = np.tanh(np.asarray(x) ** 2 + 1) * 3
  np.testing.assert_allclose(np.asarray(executable(x, x)), expected, rtol=1e-5)


def test_a_torn_entry_is_a_miss_and_is_rewritten(cache_dir, caplog):
  lowered, x = _lowered(2.0)
  compile_cache.compile_or_load(lowered, "g", _mesh())
  (entry,) = (cache_dir / "per-process").iterdir()
  entry.write_bytes(entry.read_bytes()[:100])
  executable, loaded = compile_cache.compile_or_load(_lowered(2.0)[0], "g", _mesh())
  assert not loaded and "could not load" in caplog.text
  assert np.isfinite(np.asarray(executable(x, x))).all()
  assert compile_cache.compile_or_load(_lowered(2.0)[0], "g", _mesh())[1]   # rewritten whole


def test_without_a_cache_folder_it_only_compiles():
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    assert compile_cache.cache_folder() is None
    _, loaded = compile_cache.compile_or_load(_lowered(1.0)[0], "h", _mesh())
    _, loaded_again = compile_cache.compile_or_load(_lowered(1.0)[0], "h", _mesh())
  finally:
    jax.config.update("jax_compilation_cache_dir", previous)
  assert not loaded and not loaded_again


def test_a_program_on_fewer_devices_is_compiled_not_cached(cache_dir):
  x = jax.random.normal(jax.random.key(1), (4, 4))
  f = jax.jit(lambda a: a * 2)
  one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  executable, loaded = compile_cache.compile_or_load(f.lower(x), "one_device", one)
  again, loaded_again = compile_cache.compile_or_load(f.lower(x), "one_device", one)
  assert not loaded and not loaded_again and not (cache_dir / "per-process").exists()
  np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(x) * 2)


def test_a_program_that_calls_back_into_python_is_compiled_not_cached(cache_dir):
  from jax.experimental import io_callback
  mesh = _mesh()
  x = jax.device_put(jax.random.normal(jax.random.key(2), (8, 4)),
                     NamedSharding(mesh, P("data", "tensor")))
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  f = jax.jit(lambda a: io_callback(lambda b: np.asarray(b) * 2, shape, a) + 1)
  executable, loaded = compile_cache.compile_or_load(f.lower(x), "callback", mesh)
  assert not loaded and not (cache_dir / "per-process").exists()
  np.testing.assert_allclose(np.asarray(executable(x)), np.asarray(x) * 2 + 1, rtol=1e-6)


# -- the pre-key: found before tracing ---------------------------------------------------------

class _Program:
  """A program built from `scale`, whose tracing and lowering are counted."""

  def __init__(self, scale: float):
    self.traced = self.lowered = 0

    def f(a, b):
      self.traced += 1          # a trace-time side effect: runs only when JAX traces `f`
      return jnp.tanh(a * b * scale).sum(axis=1) + jnp.cos(a).mean()

    self.jitted = jax.jit(f)    # a new function each time: JAX's in-memory caches miss too

  def lower(self, *args):
    self.lowered += 1
    return self.jitted.lower(*args)


def _random(shape=(16, 8), mesh=None, spec=P("data", "tensor"), seed=0, dtype=jnp.float32):
  mesh = mesh or _mesh()
  x = jax.random.normal(jax.random.key(seed), shape, dtype)
  return jax.device_put(x, NamedSharding(mesh, spec))


def _pre_keyed(cache_dir):
  return sorted(f for f in os.listdir(cache_dir / "per-process") if f.endswith(".pre"))


def test_a_pre_key_hit_loads_without_tracing_or_lowering_and_computes_the_same_bits(cache_dir):
  a, b = _random(seed=1), _random(seed=2)
  first = _Program(3.0)
  fresh, served = compile_cache.load_or_lower(first.lower, (a, b), "f", _mesh(), "scale=3")
  assert served == "compiled" and (first.traced, first.lowered) == (1, 1)
  assert len(_pre_keyed(cache_dir)) == 1
  restarted = _Program(3.0)      # what a restarted process builds
  loaded, served = compile_cache.load_or_lower(restarted.lower, (a, b), "f", _mesh(), "scale=3")
  assert served == "loaded before lowering"
  assert (restarted.traced, restarted.lowered) == (0, 0)
  c, d = _random(seed=3), _random(seed=4)    # new random data through both executables
  np.testing.assert_array_equal(np.asarray(loaded(c, d)), np.asarray(fresh(c, d)))
  np.testing.assert_array_equal(np.asarray(loaded(a, b)), np.asarray(restarted.jitted(a, b)))


@pytest.mark.parametrize("change", ["recipe", "shape", "dtype", "sharding", "source",
                                    "device_order", "jax_setting"])
def test_each_ingredient_of_the_pre_key_changes_it(cache_dir, monkeypatch, request, tiny_config,
                                                  change):
  from mscale_jax.train import program_recipe
  args = (_random(seed=1), _random(seed=2))
  recipe = program_recipe(tiny_config())
  compile_cache.load_or_lower(_Program(2.0).lower, args, "f", _mesh(), recipe)
  mesh = _mesh()
  if change == "recipe":          # one config field
    recipe = program_recipe(tiny_config(optimizer=dict(warmup_steps=3)))
  elif change == "shape":
    args = (_random((24, 8), seed=1), _random((24, 8), seed=2))
  elif change == "dtype":
    args = (_random(seed=1, dtype=jnp.bfloat16), _random(seed=2, dtype=jnp.bfloat16))
  elif change == "sharding":
    args = (_random(seed=1, spec=P("data")), args[1])
  elif change == "source":        # an edited checkout
    monkeypatch.setattr(compile_cache, "source_digest", lambda: "edited")
  elif change == "device_order":
    mesh = _mesh(jax.devices()[::-1])
    args = tuple(jax.device_put(x, NamedSharding(mesh, P("data", "tensor"))) for x in args)
  elif change == "jax_setting":
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    request.addfinalizer(lambda: jax.config.update("jax_default_matmul_precision", previous))
  program = _Program(2.0)
  executable, served = compile_cache.load_or_lower(program.lower, args, "f", mesh, recipe)
  assert served != "loaded before lowering" and program.lowered == 1
  assert len(_pre_keyed(cache_dir)) == 2         # the new pre-key is recorded
  expected = _Program(2.0).jitted(*args)
  np.testing.assert_array_equal(np.asarray(executable(*args)), np.asarray(expected))


def test_a_pre_key_naming_a_torn_entry_is_a_miss_and_both_are_rewritten(cache_dir, caplog):
  args = (_random(seed=5), _random(seed=6))
  compile_cache.load_or_lower(_Program(1.0).lower, args, "g", _mesh(), "")
  (entry,) = (cache_dir / "per-process").glob("*.pkl")
  entry.write_bytes(entry.read_bytes()[:100])
  program = _Program(1.0)
  executable, served = compile_cache.load_or_lower(program.lower, args, "g", _mesh(), "")
  assert served == "compiled" and program.lowered == 1 and "could not load" in caplog.text
  np.testing.assert_array_equal(np.asarray(executable(*args)),
                                np.asarray(program.jitted(*args)))
  (index,) = (cache_dir / "per-process").glob("*.pre")
  index.write_text("../elsewhere.pkl")           # an index naming no entry of this folder
  assert compile_cache.load_or_lower(_Program(1.0).lower, args, "g", _mesh(), "")[1] == "loaded"
  again = _Program(1.0)
  assert compile_cache.load_or_lower(again.lower, args, "g", _mesh(), "")[1] == (
      "loaded before lowering") and again.lowered == 0


def test_programs_the_cache_refuses_get_no_pre_key(cache_dir):
  from jax.experimental import io_callback
  x = _random((8, 4), seed=7)
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  for _ in range(2):
    calls = _Program(1.0)
    calls.jitted = jax.jit(lambda a: io_callback(lambda b: np.asarray(b) * 2, shape, a) + 1)
    executable, served = compile_cache.load_or_lower(calls.lower, (x,), "cb", _mesh(), "")
    assert served == "compiled" and calls.lowered == 1
  one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  y = jax.random.normal(jax.random.key(8), (4, 4))
  for _ in range(2):
    few = _Program(1.0)
    executable, served = compile_cache.load_or_lower(few.lower, (y, y), "few", one, "")
    assert served == "compiled" and few.lowered == 1
  assert not (cache_dir / "per-process").exists()


def test_the_source_digest_covers_both_packages_and_changes_with_a_file(tmp_path, monkeypatch):
  import shutil
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for package in ("mscale_jax", "pallas_kernels"):
    shutil.copytree(os.path.join(repo, package), tmp_path / package,
                    ignore=shutil.ignore_patterns("__pycache__"))
  copied = str(tmp_path / "mscale_jax" / "compile_cache.py")
  monkeypatch.setattr(compile_cache, "__file__", copied)
  digests = []
  for edited in (None, "mscale_jax/step.py", "pallas_kernels/lamb.py"):
    if edited:
      with open(tmp_path / edited, "a") as f:
        f.write("\n# an edit\n")
    compile_cache.source_digest.cache_clear()
    digests.append(compile_cache.source_digest())
  compile_cache.source_digest.cache_clear()
  assert len(set(digests)) == 3


def test_a_second_trainer_in_the_process_reuses_its_program(live_programs, tiny_config,
                                                           tmp_path, caplog):
  """Two trainers of one config in one process (a notebook run twice): the second neither
  lowers its train step nor deserialises it (JAX 0.11's CPU backend cannot run a deserialised
  copy beside the program it compiled), and its first step's state is bitwise the first's."""
  from mscale_jax.train import Trainer
  config = tiny_config(train=dict(steps=3, log_every=1, eval_every=3, checkpoint_every=3))
  states, lowered = [], []
  for name in ("first", "second"):
    trainer = Trainer(config, str(tmp_path / name), show_progress=False)
    lower_step = trainer.lower_step
    trainer.lower_step = lambda *args, name=name, lower=lower_step: (
        lowered.append(name), lower(*args))[1]
    caplog.clear()
    with caplog.at_level("INFO", logger="mscale_jax"):
      trainer.train(stop_at=1)
    states.append(jax.device_get(trainer.final_state))
  assert lowered == ["first"] and "loaded before lowering the train step" in caplog.text
  assert live_programs == []
  _assert_bitwise(states[0], states[1])


def test_a_process_keeps_only_its_most_recently_used_programs(live_programs, cache_dir,
                                                              monkeypatch):
  monkeypatch.setattr(compile_cache, "_LIVE_MAX", 2)
  x = _lowered(1.0)[1]
  first = compile_cache.compile_or_load(_lowered(1.0)[0], "f", _mesh())[0]
  compile_cache.compile_or_load(_lowered(2.0)[0], "f", _mesh())
  again, loaded = compile_cache.compile_or_load(_lowered(1.0)[0], "f", _mesh())
  assert loaded and again is first and live_programs == []     # kept, and now the newest
  compile_cache.compile_or_load(_lowered(3.0)[0], "f", _mesh())   # 2.0 is let go
  assert len(compile_cache._LIVE) == 2
  reloaded, loaded = compile_cache.compile_or_load(_lowered(2.0)[0], "f", _mesh())
  assert loaded and live_programs == [1]                        # from disk again
  np.testing.assert_allclose(np.asarray(reloaded(x, x)), np.tanh(np.asarray(x) ** 2 + 1) * 2,
                             rtol=1e-5)


_PROCESS = """
import logging
import sys
import jax
import numpy as np
from mscale_jax.config import Config
from mscale_jax.train import Trainer
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
logging.getLogger("mscale_jax").addHandler(logging.StreamHandler())
logging.getLogger("mscale_jax").setLevel(logging.INFO)
config = Config(name="test").replace(
    model=dict(num_layers=2, hidden=32, num_heads=4, mlp_dim=64, seq_len=32, attention_window=8),
    mesh=dict(data=2, tensor=4), optimizer=dict(warmup_steps=2),
    data=dict(kind="stdlib", prefetch=0),
    train=dict(steps=3, global_batch=4, log_every=1, eval_every=3, eval_batches=1,
               checkpoint_every=3))
trainer = Trainer(config, sys.argv[2], show_progress=False)
if sys.argv[4] == "restarted":
  trainer.lower_step = None   # a lowering would fail the run
trainer.train(stop_at=1)
leaves = jax.tree.leaves(jax.device_get(trainer.final_state))
np.savez(sys.argv[3], *[np.asarray(a) for a in leaves])
"""


@pytest.mark.slow
def test_a_restarted_process_loads_the_train_step_before_lowering_and_steps_bitwise_alike(
    tmp_path):
  """The restart the cache is for, in two fresh processes (as the driver starts them): the
  second (same config, same cache folder) loads the train step the first wrote, never lowers
  it, and its first step's state is bitwise the first's."""
  import subprocess
  import sys
  script = tmp_path / "process.py"
  script.write_text(_PROCESS)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  runs = []
  for name in ("first", "restarted"):
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache"), str(tmp_path / name),
         str(tmp_path / f"{name}.npz"), name], cwd=repo, capture_output=True, text=True,
        timeout=300, env=dict(os.environ, PYTHONPATH=repo))
    assert result.returncode == 0, result.stderr[-3000:]
    runs.append(result.stderr)
  assert "compiled the train step" in runs[0]
  assert "loaded before lowering the train step" in runs[1]
  with np.load(tmp_path / "first.npz") as first, np.load(tmp_path / "restarted.npz") as again:
    _assert_bitwise([first[f"arr_{i}"] for i in range(len(first.files))],
                    [again[f"arr_{i}"] for i in range(len(again.files))])


def _assert_bitwise(state, other_leaves):
  """Every leaf of `state` (a pytree) bitwise equal to the same leaf of `other_leaves`."""
  leaves = jax.tree.leaves_with_path(state)
  other_leaves = jax.tree.leaves(other_leaves)
  assert len(leaves) == len(other_leaves) > 3
  for (path, a), b in zip(leaves, other_leaves):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=jax.tree_util.keystr(path))


def test_the_pre_key_can_be_switched_off(cache_dir, monkeypatch):
  args = (_random(seed=9), _random(seed=10))
  compile_cache.load_or_lower(_Program(1.5).lower, args, "s", _mesh(), "")
  monkeypatch.setenv(compile_cache.PRE_KEY_SWITCH, "0")
  program = _Program(1.5)
  assert compile_cache.load_or_lower(program.lower, args, "s", _mesh(), "")[1] == "loaded"
  assert program.lowered == 1


def test_a_restarted_process_loads_the_nan_faults_program_from_the_cache(cache_dir,
                                                                        program_counts):
  """The `nan` fault's fill program is made at every restart before the fault fires; JAX's
  own cache serves process 0 only, so without this every other process compiled it again."""
  from mscale_jax.resilience.worker.faults import nan_program
  mesh = _mesh()
  params = {"w": _random((16, 8), seed=5), "b": _random((8,), spec=P("tensor"), seed=6)}
  shardings = jax.tree.map(lambda x: x.sharding, params)
  compiles, loads = program_counts.compiles, program_counts.loads
  before = jax.tree.map(np.asarray, params)
  for run, expected in enumerate([(1, 0), (1, 1)]):      # the first run, then a restart
    fill = nan_program(params, shardings, mesh)
    assert (len(compiles), len(loads)) == expected, run
    out = fill(params)
    for name, x in out.items():
      assert x.sharding == shardings[name] and x.shape == params[name].shape
      assert np.isnan(np.asarray(x)).all()
  for name in params:                                     # the real parameters are untouched
    np.testing.assert_array_equal(np.asarray(params[name]), before[name])
