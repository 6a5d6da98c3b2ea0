"""Flash attention kernel vs the float32 XLA reference, in the Pallas interpreter on CPU.

Unwritten outputs cannot pass unnoticed: the generic interpreter (`interpret=True`) fills
pallas_call outputs with NaN before the kernel runs (checked by `test_interpreter_poisons_outputs`),
and one case runs the TPU simulator with `uninitialized_memory='nan'`. Window skipping is checked
twice: the loop bounds equal exactly the tiles the mask touches (and grow as seq * w), and
NaN-poisoned operands outside those bounds do not reach the outputs, which they would if the
kernels visited them (0 * NaN = NaN in the probability-times-value matmuls).
"""
import functools
import logging

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _flash_kernels
from pallas_kernels.flash_attention import (ConfigError, attention_mask, flash_attention,
                                            reference_attention, visited_blocks)


# The interpreter's programs are large; cheap XLA:CPU optimisation halves their compile time.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _run(fn, *args):
  """jit-compiles fn for args with cheap CPU optimisation, then calls it."""
  lowered = jax.jit(fn).lower(*args)
  try:
    compiled = lowered.compile(_FAST_COMPILE)
  except Exception:  # pylint: disable=broad-except  (option names differ across versions)
    compiled = lowered.compile()
  return compiled(*args)


def _inputs(shape, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]


def _fwd_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out,) + tuple(vjp(do))


def _check_against_reference(shape, block_q, block_k, causal, window, dtype=jnp.float32,
                             atol=2e-5, interpret=True):
  q, k, v, do = _inputs(shape, dtype)
  kernel = functools.partial(flash_attention, causal=causal, window=window, block_q=block_q,
                             block_k=block_k, interpret=interpret)
  ref = functools.partial(reference_attention, causal=causal, window=window)
  got = _run(functools.partial(_fwd_and_grads, kernel), q, k, v, do)
  # Reference in float32 on the same (possibly bf16-rounded) inputs.
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = _fwd_and_grads(ref, *f32)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == dtype, name
    g = np.asarray(g.astype(jnp.float32))
    w = np.asarray(w)
    assert np.all(np.isfinite(g)), f"{name} has non-finite values (unwritten block?)"
    scale = max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g, w, atol=atol * scale, rtol=0, err_msg=name)


# block 16 for queries and 32 for keys, so windows around both block sizes are covered.
@pytest.mark.parametrize("causal,window", [
    (True, None), (True, 17), (False, 1),
    *[pytest.param(*case, marks=pytest.mark.slow)
      for case in [(True, 1), (True, 15), (True, 16), (True, 1000), (False, None), (False, 17)]],
])
def test_matches_reference_seq64(causal, window):
  _check_against_reference((2, 64, 2, 16), 16, 32, causal, window)


@pytest.mark.parametrize("shape,block_q,block_k,causal,window", [
    ((1, 128, 1, 32), 32, 16, True, 33),      # key blocks smaller than query blocks
    ((1, 64, 1, 32), 32, 16, False, 20),
    ((1, 48, 1, 16), 16, 16, True, 20),       # seq not a power of two
    ((1, 32, 1, 16), 32, 32, True, None),     # a single block
])
@pytest.mark.slow
def test_matches_reference_other_shapes(shape, block_q, block_k, causal, window):
  _check_against_reference(shape, block_q, block_k, causal, window)


def test_tpu_simulator_with_nan_poisoned_memory():
  params = pltpu.InterpretParams(uninitialized_memory="nan")
  _check_against_reference((1, 32, 1, 16), 16, 16, True, 9, interpret=params)


@pytest.mark.slow
def test_bfloat16_keeps_dtype_within_tolerance():
  _check_against_reference((1, 64, 2, 32), 16, 16, True, 24, dtype=jnp.bfloat16, atol=3e-2)


def test_backward_blocks_differ_from_forward():
  q, k, v, do = _inputs((1, 64, 1, 16))
  kernel = functools.partial(flash_attention, window=20, block_q=32, block_k=16,
                             bwd_blocks=(16, 32))
  got = _run(functools.partial(_fwd_and_grads, kernel), q, k, v, do)
  want = _fwd_and_grads(functools.partial(reference_attention, window=20), q, k, v, do)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5)


def test_default_blocks_and_scale():
  q, k, v, _ = _inputs((1, 64, 1, 16))
  got = flash_attention(q, k, v, window=10, sm_scale=0.3)
  want = reference_attention(q, k, v, window=10, sm_scale=0.3)
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_interpreter_poisons_outputs():
  """The NaN-poisoning premise of these tests: an output block never written reads NaN."""
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = x_ref[...]
  x = jnp.ones((32, 8), jnp.float32)
  out = pl.pallas_call(kernel, grid=(2,), in_specs=[pl.BlockSpec((16, 8), lambda i: (i, 0))],
                       out_specs=pl.BlockSpec((16, 8), lambda i: (i, 0)),
                       out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
  assert np.all(np.asarray(out[:16]) == 1) and np.all(np.isnan(np.asarray(out[16:])))


def _tiles(seq_len, block_q, block_k, causal, window):
  """(tiles with any kept pair, tiles with every pair kept), by brute force over the mask."""
  mask = attention_mask(seq_len, causal=causal, window=window)
  nq, nk = seq_len // block_q, seq_len // block_k
  tiles = mask.reshape(nq, block_q, nk, block_k)
  return tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))


@pytest.mark.parametrize("seq_len,block_q,block_k", [(64, 16, 32), (128, 32, 16), (96, 32, 32)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 15, 16, 17, 31, 32, 33, 40, 64, 500])
def test_loop_bounds_visit_exactly_the_kept_tiles(seq_len, block_q, block_k, causal, window):
  touched, whole = _tiles(seq_len, block_q, block_k, causal, window)
  for backward in (False, True):
    got = visited_blocks(seq_len, block_q, block_k, causal=causal, window=window,
                         backward=backward)
    np.testing.assert_array_equal(got > 0, touched)   # no tile skipped that the mask keeps
    np.testing.assert_array_equal(got == 2, whole)    # mask-free exactly where nothing drops


def test_visited_tiles_grow_as_seq_times_window():
  def tiles(seq_len, window):
    return int((visited_blocks(seq_len, 128, 128, causal=True, window=window) > 0).sum())
  # Each query block visits at most ceil((w + block_q - 1) / block_k) + 1 key blocks.
  for seq_len in (2048, 8192, 32768):
    assert tiles(seq_len, 512) <= (seq_len // 128) * 6
  assert tiles(32768, 512) < 4.2 * tiles(8192, 512)         # linear in seq
  assert tiles(8192, None) > 6 * tiles(8192, 512)            # causal grows quadratically
  assert tiles(8192, 1024) < 2.1 * tiles(8192, 512)          # linear in window


@pytest.mark.parametrize("causal,window", [(True, 20), (False, 20)])
def test_forward_never_reads_keys_outside_the_window(causal, window):
  seq_len, block = 96, 16
  iq = 3
  lo, hi = _flash_kernels.kv_block_range(iq, block_q=block, block_k=block, seq_len=seq_len,
                                          causal=causal, window=window)
  lo, hi = int(lo) * block, int(hi) * block
  assert hi - lo < seq_len
  q, k, v, _ = _inputs((1, seq_len, 1, 16))
  outside = (jnp.arange(seq_len) < lo) | (jnp.arange(seq_len) >= hi)
  poison = lambda x: jnp.where(outside[None, :, None, None], jnp.nan, x)
  got = _run(functools.partial(flash_attention, causal=causal, window=window, block_q=block,
                                block_k=block), q, poison(k), poison(v))
  want = reference_attention(q, k, v, causal=causal, window=window)
  rows = slice(iq * block, (iq + 1) * block)
  np.testing.assert_allclose(got[:, rows], want[:, rows], atol=2e-5)


@pytest.mark.parametrize("causal,window", [(True, 20), (False, 20)])
def test_backward_never_reads_queries_outside_the_window(causal, window):
  seq_len, block = 96, 16
  jk = 2
  lo, hi = _flash_kernels.q_block_range(jk, block_q=block, block_k=block, seq_len=seq_len,
                                         causal=causal, window=window)
  lo, hi = int(lo) * block, int(hi) * block
  assert hi - lo < seq_len
  q, k, v, do = _inputs((1, seq_len, 1, 16))
  outside = ((jnp.arange(seq_len) < lo) | (jnp.arange(seq_len) >= hi))[None, :, None, None]
  kernel = functools.partial(flash_attention, causal=causal, window=window, block_q=block,
                             block_k=block)
  poison = lambda x: jnp.where(outside, jnp.nan, x)
  _, _, dk, dv = _run(functools.partial(_fwd_and_grads, kernel), poison(q), k, v, poison(do))
  _, want_dk, want_dv = _fwd_and_grads(
      functools.partial(reference_attention, causal=causal, window=window), q, k, v, do)[1:]
  rows = slice(jk * block, (jk + 1) * block)
  np.testing.assert_allclose(dk[:, rows], want_dk[:, rows], atol=2e-5)
  np.testing.assert_allclose(dv[:, rows], want_dv[:, rows], atol=2e-5)


@pytest.mark.slow
def test_inside_shard_map_jit_grad_bf16():
  """The model's use: local heads inside shard_map, bf16, under jit and grad."""
  mesh = jax.make_mesh((2,), ("tensor",))
  spec = jax.sharding.PartitionSpec(None, None, "tensor", None)
  q, k, v, _ = _inputs((1, 32, 4, 16), jnp.bfloat16)
  attn = lambda q, k, v: flash_attention(q, k, v, window=12, block_q=16, block_k=16)
  def loss(q, k, v, fn):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
  sharded = jax.shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  grads = _run(jax.grad(functools.partial(loss, fn=sharded), argnums=(0, 1, 2)),
               put(q), put(k), put(v))
  ref = functools.partial(reference_attention, window=12)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want = jax.grad(functools.partial(loss, fn=ref), argnums=(0, 1, 2))(*f32)
  for g, w in zip(grads, want):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), w,
                               atol=4e-2 * max(1.0, float(jnp.abs(w).max())))


def test_backend_is_chosen_from_platform_and_logged(caplog):
  q, k, v, _ = _inputs((1, 16, 1, 16))
  with caplog.at_level(logging.INFO, logger="pallas_kernels.flash_attention"):
    flash_attention(q, k, v)
  assert "backend=interpret" in caplog.text
  with pytest.raises(ConfigError, match="interpret"):
    flash_attention(q, k, v, interpret=False)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_q=24), "block_q"),          # 64 % 24 != 0
    (dict(block_k=128), "block_k"),         # larger than the sequence
    (dict(block_k=0), "block_k"),
    (dict(window=0), "window"),
    (dict(window=2.5), "window"),
    (dict(bwd_blocks=(16, 24)), "bwd_blocks[1]"),
    (dict(bwd_blocks=16), "bwd_blocks"),
])
def test_bad_options_raise_config_error(kwargs, field):
  q, k, v, _ = _inputs((1, 64, 1, 16))
  with pytest.raises(ConfigError) as info:
    flash_attention(q, k, v, **kwargs)
  assert info.value.field == field
  assert isinstance(info.value, ValueError)


def test_sequence_not_multiple_of_default_block_is_rejected():
  q, k, v, _ = _inputs((1, 200, 1, 16))
  with pytest.raises(ConfigError, match="must divide the sequence length 200"):
    flash_attention(q, k, v)


def test_bad_shapes_raise_config_error():
  q, k, v, _ = _inputs((1, 32, 2, 16))
  with pytest.raises(ConfigError, match="equal to q.shape"):
    flash_attention(q, k[:, :16], v[:, :16])
  with pytest.raises(ConfigError, match="4-D"):
    flash_attention(q[0], k[0], v[0])
  with pytest.raises(ConfigError, match="dtype"):
    flash_attention(q, k.astype(jnp.bfloat16), v)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 64), (False, 48)])
def test_lowers_to_triton_for_gpu(monkeypatch, cuda_target, causal, window):
  """Cross-lowers fwd+bwd for 'cuda' on this CPU machine: Triton IR is generated (not compiled).

  The backend choice is patched to Triton, so the GPU defaults (blocks, warps) are exercised.
  """
  from pallas_kernels import flash_attention as fa_module
  monkeypatch.setattr(fa_module, "_resolve_backend", lambda q, interpret: ("triton", True))
  spec = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  def loss(q, k, v):
    return flash_attention(q, k, v, causal=causal, window=window).astype(jnp.float32).sum()
  with cuda_target:
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(spec, spec, spec).lower(
        lowering_platforms=("cuda",))
  assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3   # fwd, dq, dk/dv kernels


@pytest.mark.parametrize("causal,window", [(True, 5), (False, 5), (True, None)])
def test_mask_convention_matches_jax_nn_local_window(causal, window):
  q, k, v, _ = _inputs((1, 32, 2, 16))
  local = None if window is None else ((window - 1, 0) if causal else window - 1)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=local,
                                      implementation="xla")
  np.testing.assert_allclose(reference_attention(q, k, v, causal=causal, window=window), want,
                             atol=1e-5)
