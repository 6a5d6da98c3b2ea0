"""The per-process executable cache: a second compile of the same program loads, and agrees."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mscale_jax import compile_cache


@pytest.fixture
def cache_dir(tmp_path):
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  yield tmp_path
  jax.config.update("jax_compilation_cache_dir", previous)


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
