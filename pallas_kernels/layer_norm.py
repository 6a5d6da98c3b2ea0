"""Fused LayerNorm and RMSNorm over the last axis, optionally fused with the residual add.

  y = layer_norm(x, scale, bias)                       # normalise x
  y, h = layer_norm(x, scale, bias, residual=r)        # h = x + r; y = LN(h); one pass over HBM

(`rms_norm` likewise, without mean and bias). Statistics are fp32 whatever the input dtype; y
has x's dtype, h has the residual's dtype and is normalised after rounding to it, exactly as the
unfused `LN(x + r)` would be.

Kernels: the forward reads x (and r) once and writes y (and h). The backward recomputes the row
statistics from the saved input instead of storing them, writes dx, and reduces d scale and
d bias over the rows it owns into one fp32 partial per program; the few partials are summed
outside the kernel. Any leading shape (rows are flattened); ragged last row blocks and hidden
sizes that are not a power of two are masked.

Backend from the input's platform: Triton on GPU, Mosaic on TPU, the Pallas interpreter on CPU
(`interpret=True` forces it; the interpreter runs the GPU flavour: masked loads and stores).
The `reference_*` functions are the plain-jnp definitions the kernels are tested against.
"""
import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._platform import platform_of, resolve_interpret

logger = logging.getLogger(__name__)

_GPU_BLOCK_ELEMS = 4096        # elements one Triton program normalises at a time
_GPU_PROGRAMS = 256            # backward: at most this many programs, hence fp32 partials
_TPU_BLOCK_BYTES = 1 << 20     # one fp32 (rows, hidden) block in VMEM (several live at once)
_INTERPRET_BLOCK_ELEMS = 1 << 16
_INTERPRET_PROGRAMS = 2        # the interpreter also runs several programs and partials


# ------------------------------------------------------------------------------------------
# References.

def reference_layer_norm(x, scale, bias, *, eps=1e-5, residual=None):
  """Plain-jnp LayerNorm over the last axis (fp32 statistics); see `layer_norm`."""
  return _reference(x, scale, bias, eps, residual, center=True)


def reference_rms_norm(x, scale, *, eps=1e-6, residual=None):
  """Plain-jnp RMSNorm over the last axis (fp32 statistics); see `rms_norm`."""
  return _reference(x, scale, None, eps, residual, center=False)


def _reference(x, scale, bias, eps, residual, center):
  h = x if residual is None else (x.astype(jnp.float32) + residual.astype(jnp.float32)
                                  ).astype(residual.dtype)
  s = h.astype(jnp.float32)
  if center:
    s = s - jnp.mean(s, axis=-1, keepdims=True)
  y = s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)
  if center:
    y = y + bias.astype(jnp.float32)
  y = y.astype(x.dtype)
  return y if residual is None else (y, h)


# ------------------------------------------------------------------------------------------
# Block choice and memory access per backend.

class _Plan(NamedTuple):
  center: bool          # LayerNorm (mean and bias) or RMSNorm
  eps: float
  backend: str          # 'gpu' | 'tpu' | 'interpret'
  rows: int
  hidden: int
  block_hidden: int     # hidden padded to a power of two on GPU / interpreter
  block_rows: int       # rows per load
  sub_blocks: int       # backward: row blocks one program walks through
  num_warps: int
  x_dtype: str
  residual_dtype: str | None


def _backend(x, interpret) -> str:
  """'gpu' | 'tpu' | 'interpret' (logged once)."""
  return resolve_interpret("layer_norm", interpret, platform_of(x))[0]


def _plan(center, eps, backend, rows, hidden, dtypes, block_rows=None) -> _Plan:
  if backend == "tpu":
    block_hidden = hidden
    fit = max(16, (_TPU_BLOCK_BYTES // (4 * hidden)) // 16 * 16)
    block = block_rows or fit
    block = rows if rows <= block else block
    return _Plan(center, eps, backend, rows, hidden, block_hidden, block, 1, 4, *dtypes)
  block_hidden = pl.next_power_of_2(hidden)
  elems = _GPU_BLOCK_ELEMS if backend == "gpu" else _INTERPRET_BLOCK_ELEMS
  block = block_rows or max(1, elems // block_hidden)
  block = min(pl.next_power_of_2(block), pl.next_power_of_2(rows))
  row_blocks = -(-rows // block)
  programs = _GPU_PROGRAMS if backend == "gpu" else _INTERPRET_PROGRAMS
  sub_blocks = -(-row_blocks // programs)
  num_warps = int(min(16, max(4, block * block_hidden // 512)))
  return _Plan(center, eps, backend, rows, hidden, block_hidden, block, sub_blocks, num_warps,
               *dtypes)


def _masks(plan, row0):
  shape = (plan.block_rows, plan.block_hidden)
  row_ok = row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0) < plan.rows
  col_ok = jax.lax.broadcasted_iota(jnp.int32, shape, 1) < plan.hidden
  return row_ok & col_ok, col_ok


def _load(plan, ref, mask):
  if plan.backend == "tpu":
    return jnp.where(mask, ref[...].astype(jnp.float32), 0.0)
  from jax.experimental.pallas import triton as plgpu
  return plgpu.load(ref, mask=mask, other=0.0).astype(jnp.float32)


def _load_vector(plan, ref):
  """A (1, hidden) parameter row as fp32, zero in the padded columns."""
  if plan.backend == "tpu":
    return ref[...].astype(jnp.float32)
  from jax.experimental.pallas import triton as plgpu
  col_ok = jax.lax.broadcasted_iota(jnp.int32, (1, plan.block_hidden), 1) < plan.hidden
  return plgpu.load(ref, mask=col_ok, other=0.0).astype(jnp.float32)


def _store(plan, ref, value, mask):
  if plan.backend == "tpu":
    ref[...] = value.astype(ref.dtype)
  else:
    from jax.experimental.pallas import triton as plgpu
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def _stats(plan, s, col_ok):
  """Centred input (zero in padded columns) and 1/std per row, both fp32."""
  if plan.center:
    s = jnp.where(col_ok, s - jnp.sum(s, axis=1, keepdims=True) / plan.hidden, 0.0)
  var = jnp.sum(s * s, axis=1, keepdims=True) / plan.hidden
  return s, jax.lax.rsqrt(var + plan.eps)


def _call(plan, kernel, grid, in_specs, out_specs, out_shape, *args):
  kwargs = {}
  if plan.backend == "gpu":
    from jax.experimental.pallas import triton as plgpu
    kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=1)
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=plan.backend == "interpret",
                        **kwargs)(*args)


# ------------------------------------------------------------------------------------------
# Kernels.

def _forward_kernel(*refs, plan, has_residual):
  refs = list(refs)
  x_ref = refs.pop(0)
  r_ref = refs.pop(0) if has_residual else None
  scale_ref = refs.pop(0)
  bias_ref = refs.pop(0) if plan.center else None
  y_ref = refs.pop(0)
  h_ref = refs.pop(0) if has_residual else None
  mask, col_ok = _masks(plan, pl.program_id(0) * plan.block_rows)
  s = _load(plan, x_ref, mask)
  if has_residual:
    s = (s + _load(plan, r_ref, mask)).astype(h_ref.dtype)
    _store(plan, h_ref, s, mask)
    s = s.astype(jnp.float32)
  xc, rstd = _stats(plan, s, col_ok)
  y = xc * rstd * _load_vector(plan, scale_ref)
  if plan.center:
    y = y + _load_vector(plan, bias_ref)
  _store(plan, y_ref, y, mask)


def _backward_kernel(*refs, plan, has_dh):
  refs = list(refs)
  s_ref, dy_ref = refs.pop(0), refs.pop(0)
  dh_ref = refs.pop(0) if has_dh else None
  scale_ref = refs.pop(0)
  dx_ref, dscale_ref = refs.pop(0), refs.pop(0)
  dbias_ref = refs.pop(0) if plan.center else None
  scale = _load_vector(plan, scale_ref)
  rows_per_program = plan.block_rows * plan.sub_blocks
  base = pl.program_id(0) * rows_per_program

  def body(j, acc):
    dscale, dbias = acc
    start = j * plan.block_rows
    window = lambda ref: ref.at[pl.ds(start, plan.block_rows), :]
    mask, col_ok = _masks(plan, base + start)
    s = _load(plan, window(s_ref), mask)
    dy = _load(plan, window(dy_ref), mask)
    xc, rstd = _stats(plan, s, col_ok)
    xhat = xc * rstd
    g = dy * scale
    c1 = jnp.sum(xhat * g, axis=1, keepdims=True) / plan.hidden
    dx = g - xhat * c1
    if plan.center:
      dx = dx - jnp.sum(g, axis=1, keepdims=True) / plan.hidden
    dx = dx * rstd
    if has_dh:
      dx = dx + _load(plan, window(dh_ref), mask)
    _store(plan, window(dx_ref), dx, mask)
    dscale = dscale + jnp.sum(dy * xhat, axis=0, keepdims=True)
    dbias = dbias + jnp.sum(dy, axis=0, keepdims=True)
    return dscale, dbias

  zeros = jnp.zeros((1, plan.block_hidden), jnp.float32)
  dscale, dbias = jax.lax.fori_loop(0, plan.sub_blocks, body, (zeros, zeros))
  dscale_ref[...] = dscale.reshape(dscale_ref.shape)
  if plan.center:
    dbias_ref[...] = dbias.reshape(dbias_ref.shape)


def _forward(plan, x, residual, scale, bias):
  rows_spec = pl.BlockSpec((plan.block_rows, plan.block_hidden), lambda i: (i, 0))
  vec_spec = pl.BlockSpec((1, plan.block_hidden), lambda i: (0, 0))
  has_residual = residual is not None
  args = [x] + ([residual] if has_residual else []) + [scale.reshape(1, -1)]
  args += [bias.reshape(1, -1)] if plan.center else []
  in_specs = [rows_spec] * (1 + has_residual) + [vec_spec] * (1 + plan.center)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  out_shape += [jax.ShapeDtypeStruct(x.shape, residual.dtype)] if has_residual else []
  outs = _call(plan, functools.partial(_forward_kernel, plan=plan, has_residual=has_residual),
               (-(-plan.rows // plan.block_rows),), in_specs, [rows_spec] * len(out_shape),
               out_shape, *args)
  return outs[0], (outs[1] if has_residual else None)


def _backward(plan, s, dy, dh, scale, dx_dtype):
  rows_per_program = plan.block_rows * plan.sub_blocks
  programs = -(-plan.rows // rows_per_program)
  rows_spec = pl.BlockSpec((rows_per_program, plan.block_hidden), lambda i: (i, 0))
  vec_spec = pl.BlockSpec((1, plan.block_hidden), lambda i: (0, 0))
  part_spec = pl.BlockSpec((1, 1, plan.block_hidden), lambda i: (i, 0, 0))
  args = [s, dy] + ([dh] if dh is not None else []) + [scale.reshape(1, -1)]
  in_specs = [rows_spec] * (len(args) - 1) + [vec_spec]
  part = jax.ShapeDtypeStruct((programs, 1, plan.block_hidden), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct(s.shape, dx_dtype), part] + ([part] if plan.center else [])
  outs = _call(plan, functools.partial(_backward_kernel, plan=plan, has_dh=dh is not None),
               (programs,), in_specs, [rows_spec] + [part_spec] * (len(out_shape) - 1),
               out_shape, *args)
  reduce = lambda p: jnp.sum(p[:, 0, :plan.hidden], axis=0)
  return outs[0], reduce(outs[1]), (reduce(outs[2]) if plan.center else None)


# ------------------------------------------------------------------------------------------
# custom_vjp wrapper over flattened rows.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan, x, residual, scale, bias):
  return _forward(plan, x, residual, scale, bias)


def _fused_fwd(plan, x, residual, scale, bias):
  y, h = _forward(plan, x, residual, scale, bias)
  return (y, h), (x if residual is None else h, scale, bias)


def _fused_bwd(plan, saved, cotangents):
  s, scale, bias = saved
  dy, dh = cotangents
  dx, dscale, dbias = _backward(plan, s, dy, dh, scale, plan.x_dtype)
  dscale = dscale.astype(scale.dtype)
  dbias = dbias.astype(bias.dtype) if plan.center else None
  dresidual = None if plan.residual_dtype is None else dx.astype(plan.residual_dtype)
  return dx, dresidual, dscale, dbias


_fused.defvjp(_fused_fwd, _fused_bwd)


def _norm(x, scale, bias, eps, residual, interpret, block_rows, center):
  hidden = x.shape[-1]
  if scale.shape != (hidden,) or (center and bias.shape != (hidden,)):
    raise ValueError(f"scale/bias must have shape ({hidden},) to match x {x.shape}; got "
                     f"{scale.shape} and {None if bias is None else bias.shape}")
  if residual is not None and residual.shape != x.shape:
    raise ValueError(f"residual shape {residual.shape} differs from x shape {x.shape}")
  backend = _backend(x, interpret)
  rows = max(1, x.size // hidden)
  dtypes = (jnp.dtype(x.dtype).name, None if residual is None else jnp.dtype(residual.dtype).name)
  plan = _plan(center, float(eps), backend, rows, hidden, dtypes, block_rows)
  name = "layer_norm" if center else "rms_norm"
  logger.debug("%s plan: %s", name, plan)
  flat = lambda a: None if a is None else a.reshape(rows, hidden)
  y, h = _fused(plan, flat(x), flat(residual), scale, bias)
  y = y.reshape(x.shape)
  return y if residual is None else (y, h.reshape(x.shape))


def layer_norm(x, scale, bias, *, eps=1e-5, residual=None, interpret=None, block_rows=None):
  """Fused LayerNorm over the last axis; differentiable (custom VJP with Pallas backward).

  Args:
    x: [..., hidden], any float dtype; statistics are computed in fp32.
    scale, bias: [hidden].
    residual: optional [..., hidden]; then h = x + residual is formed in the same pass.
    interpret: None picks the backend from x's platform; True forces the Pallas interpreter;
      False refuses it (ConfigError on CPU).
    block_rows: rows per block (default: chosen per backend).

  Returns:
    y ([..., hidden], x.dtype), or (y, h) with h in residual's dtype when `residual` is given.
  """
  return _norm(x, scale, bias, eps, residual, interpret, block_rows, center=True)


def rms_norm(x, scale, *, eps=1e-6, residual=None, interpret=None, block_rows=None):
  """Fused RMSNorm (x / rms(x) * scale) over the last axis; arguments as `layer_norm`."""
  return _norm(x, scale, None, eps, residual, interpret, block_rows, center=False)
