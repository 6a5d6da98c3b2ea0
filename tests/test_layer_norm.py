"""pallas_kernels.layer_norm: fused LayerNorm / RMSNorm against the jnp references (interpreter).

Forward values and all gradients (x, residual, scale, bias) through `jax.vjp`, with random
cotangents, fp32 tight and bf16 loose, ragged row counts and hidden sizes that are not powers
of two. A last test lowers the kernels for CUDA (Triton) and TPU (Mosaic) without running them.
"""
import contextlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import layer_norm as ln


def _inputs(shape, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  hidden = shape[-1]
  x = (2.0 + 3.0 * jax.random.normal(keys[0], shape)).astype(dtype)
  residual = jax.random.normal(keys[1], shape).astype(dtype)
  scale = 1.0 + 0.2 * jax.random.normal(keys[2], (hidden,))
  bias = 0.2 * jax.random.normal(keys[3], (hidden,))
  dy = jax.random.normal(keys[4], shape).astype(dtype)
  dh = jax.random.normal(keys[5], shape).astype(dtype)
  return x, residual, scale, bias, dy, dh


def _values_and_grads(fn, args, cotangent):
  def run(args, cotangent):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(cotangent)
  return jax.jit(run)(args, cotangent)


def _assert_close(ours, expected, tol):
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(expected)):
    assert a.shape == b.shape and a.dtype == b.dtype
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = np.max(np.abs(a - b)) / np.max(np.abs(b))
    assert err < tol, err


CASES = [
    # kind, shape, dtype, with residual, block_rows, tolerance
    ("layer", (3, 37, 96), jnp.float32, False, 16, 2e-6),
    ("layer", (130, 64), jnp.float32, True, 16, 2e-6),
    ("rms", (5, 27, 160), jnp.float32, True, None, 2e-6),
    ("rms", (130, 64), jnp.float32, False, 8, 2e-6),
    ("layer", (3, 37, 96), jnp.bfloat16, True, 16, 2e-2),
    ("rms", (77, 128), jnp.bfloat16, False, 16, 2e-2),
]


@pytest.mark.parametrize("kind,shape,dtype,with_residual,block_rows,tol", CASES)
def test_matches_reference(kind, shape, dtype, with_residual, block_rows, tol):
  x, residual, scale, bias, dy, dh = _inputs(shape, dtype)
  params = (scale, bias) if kind == "layer" else (scale,)
  kernel = ln.layer_norm if kind == "layer" else ln.rms_norm
  reference = ln.reference_layer_norm if kind == "layer" else ln.reference_rms_norm
  eps = 1e-5 if kind == "layer" else 1e-6

  def wrap(norm, **kwargs):
    if with_residual:
      return lambda x, r, *p: norm(x, *p, eps=eps, residual=r, **kwargs)
    return lambda x, *p: norm(x, *p, eps=eps, **kwargs)

  args = (x, residual) + params if with_residual else (x,) + params
  cotangent = (dy, dh) if with_residual else dy
  ours = _values_and_grads(wrap(kernel, interpret=True, block_rows=block_rows), args, cotangent)
  expected = _values_and_grads(wrap(reference), args, cotangent)
  _assert_close(ours, expected, tol)


def test_residual_sum_is_returned_in_the_residual_dtype():
  x, residual, scale, bias, _, _ = _inputs((9, 32), jnp.bfloat16)
  residual = residual.astype(jnp.float32)
  y, h = ln.layer_norm(x, scale, bias, residual=residual, interpret=True)
  assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
  np.testing.assert_allclose(h, x.astype(jnp.float32) + residual, rtol=1e-6)


def test_bad_shapes_raise():
  x, residual, scale, bias, _, _ = _inputs((4, 32), jnp.float32)
  with pytest.raises(ValueError, match="scale"):
    ln.layer_norm(x, scale[:16], bias, interpret=True)
  with pytest.raises(ValueError, match="residual"):
    ln.rms_norm(x, scale, residual=residual[:2], interpret=True)


@pytest.mark.parametrize("platform,backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_lowers_for_accelerators(monkeypatch, cuda_target, platform, backend):
  # Lowering (not compiling) checks block shapes, power-of-two sizes and primitive support.
  monkeypatch.setattr(ln, "_backend", lambda x, interpret: backend)
  x = jax.ShapeDtypeStruct((300, 96), jnp.bfloat16)
  vec = jax.ShapeDtypeStruct((96,), jnp.float32)

  def loss(x, r, scale, bias):
    y, h = ln.layer_norm(x, scale, bias, residual=r)
    z = ln.rms_norm(h, scale)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(z.astype(jnp.float32) ** 2)

  checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
            export.DisabledSafetyCheck.custom_call("tpu_custom_call")]
  with cuda_target if platform == "cuda" else contextlib.nullcontext():
    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
                             platforms=[platform], disabled_checks=checks)(x, x, vec, vec)
  assert "custom_call" in exported.mlir_module()
