"""Fused LAMB update as an `optax.GradientTransformation` (matches `optax.lamb`).

LAMB (You et al. 2020) is Adam plus a per-tensor trust ratio ||p|| / ||u||. `optax.lamb` is a
chain of four transformations; XLA fuses each, but the moments, the raw update and the two norms
still cost several passes over memory. Here, per parameter tensor:

  pass 1 (Pallas kernel): read g, m, v, p once; write new m, v, the raw update
      u = m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p, and per-block partial sums of
      p^2 and u^2;
  epilogue (jnp, a few scalars plus one elementwise op): trust ratio from the partial sums and
      update = -lr * trust * u, which XLA fuses with `optax.apply_updates` inside the jitted step.

A stacked tensor ([L, ...], the layers of a scanned model) gets one trust ratio per layer, as if
each slice were its own tensor: the kernel grid runs over (layer, row block), so the partial sums
are per layer.

Each tensor is viewed as rows of 128 lanes ([n/128, 128], free when 128 divides n; small tensors
are zero-padded, which adds nothing to either norm). Rows past the end of the last block are
masked. Backend: Triton on GPU, Mosaic on TPU, the Pallas interpreter on CPU (`interpret=True`
forces it, `interpret=False` refuses it). Usable without mscale_jax.
"""
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from pallas_kernels._platform import platform_of, resolve_interpret

LANES = 128
# Rows of 128 lanes per grid step: GPU programs are small (registers), TPU blocks fill VMEM.
_BLOCK_ROWS = {"gpu": 32, "tpu": 512, "interpret": 256}


class FusedLambState(NamedTuple):
  """Step count (int32 scalar) and the first and second moments (trees like the params)."""
  count: jax.Array
  mu: Any
  nu: Any


def _backend(x, interpret) -> str:
  """'gpu' | 'tpu' | 'interpret', from `interpret` and the platform of `x` (logged once)."""
  return resolve_interpret("fused_lamb", interpret, platform_of(x))[0]


def _as_rows(x, layers, rows):
  """[layers, rows, 128] fp32 view of `x`, each layer's slice zero-padded on its own."""
  flat = x.reshape(layers, -1)
  flat = flat.astype(jnp.float32) if flat.dtype != jnp.float32 else flat
  pad = rows * LANES - flat.shape[1]
  if pad:
    flat = jnp.pad(flat, ((0, 0), (0, pad)))
  return flat.reshape(layers, rows, LANES)


def _lamb_kernel(scalars_ref, g_ref, m_ref, v_ref, p_ref,
                 m_out, v_out, u_out, psq_out, usq_out, *,
                 b1, b2, eps, eps_root, rows, block_rows, masked_loads):
  # scalars_ref rows 0, 1, 2 (each broadcast over the 128 lanes): 1 - b1^t, 1 - b2^t, weight decay.
  row0 = pl.program_id(1) * block_rows
  row = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_rows, LANES), 0)
  valid = row < rows
  if masked_loads:
    from jax.experimental.pallas import triton as plgpu
    load = lambda ref: plgpu.load(ref, mask=valid, other=0.0)
  else:
    load = lambda ref: jnp.where(valid, ref[...], 0.0)
  bc1, bc2, wd = scalars_ref[0:1, :], scalars_ref[1:2, :], scalars_ref[2:3, :]
  g, m, v, p = load(g_ref), load(m_ref), load(v_ref), load(p_ref)
  m = (1.0 - b1) * g + b1 * m
  v = (1.0 - b2) * (g * g) + b2 * v
  u = (m / bc1) / (jnp.sqrt(v / bc2 + eps_root) + eps) + wd * p
  if masked_loads:
    plgpu.store(m_out, m, mask=valid)
    plgpu.store(v_out, v, mask=valid)
    plgpu.store(u_out, u, mask=valid)
  else:
    m_out[...] = m
    v_out[...] = v
    u_out[...] = u
  psq_out[...] = jnp.full(psq_out.shape, jnp.sum(p * p), jnp.float32)
  usq_out[...] = jnp.full(usq_out.shape, jnp.sum(u * u), jnp.float32)


def lamb_step(g, m, v, p, bias_correction1, bias_correction2, weight_decay, *,
              b1, b2, eps, eps_root, stacked=False, interpret=None, block_rows=None):
  """One fused LAMB pass over one tensor (any shape), or over each slice of a stacked one.

  Args:
    g, m, v, p: gradient, first and second moment, parameter; all the same shape.
    bias_correction1, bias_correction2: 1 - b1^t and 1 - b2^t (scalars, t = step count + 1).
    weight_decay: scalar (0 where the tensor is masked out of weight decay).
    stacked: `p` is L tensors stacked on axis 0; the squared norms are then per slice.

  Returns:
    (new_m, new_v, u, sum(p^2), sum(u^2)): moments and raw update u in p's shape and dtype
    (moments keep their own dtype), and the two fp32 squared norms: scalars, or [L] if stacked.
  """
  backend = _backend(p, interpret)
  shape = p.shape
  if stacked and not shape:
    raise ValueError("lamb_step: a stacked tensor needs a leading (layers) axis")
  layers = shape[0] if stacked else 1
  n = p.size // layers if layers else 0
  rows = max(1, -(-n // LANES))
  block = block_rows or _BLOCK_ROWS[backend]
  if backend == "tpu":
    block = rows if rows <= block else block     # full dim or a multiple of 8
  else:
    block = min(block, pl.next_power_of_2(rows))
  grid = -(-rows // block)
  scalars = jnp.zeros((8, LANES), jnp.float32)
  scalars = scalars.at[0].set(jnp.asarray(bias_correction1, jnp.float32))
  scalars = scalars.at[1].set(jnp.asarray(bias_correction2, jnp.float32))
  scalars = scalars.at[2].set(jnp.asarray(weight_decay, jnp.float32))
  tile = pl.BlockSpec((None, block, LANES), lambda l, i: (l, i, 0))
  # One partial sum per program: a (1, 1) block on GPU; on TPU an (8, 128) tile (Mosaic's unit).
  if backend == "tpu":
    part = pl.BlockSpec((None, None, 8, LANES), lambda l, i: (l, i, 0, 0))
    part_shape = (layers, grid, 8, LANES)
  else:
    part, part_shape = pl.BlockSpec((None, 1, 1), lambda l, i: (l, i, 0)), (layers, grid, 1)
  kwargs = {}
  if backend == "gpu":
    from jax.experimental.pallas import triton as plgpu
    kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=1)
  kernel = functools.partial(
      _lamb_kernel, b1=float(b1), b2=float(b2), eps=float(eps), eps_root=float(eps_root),
      rows=rows, block_rows=block, masked_loads=backend != "tpu")
  as_rows = lambda x: _as_rows(x, layers, rows)
  m2, v2, u2, psq, usq = pl.pallas_call(
      kernel,
      grid=(layers, grid),
      in_specs=[pl.BlockSpec((8, LANES), lambda l, i: (0, 0)), tile, tile, tile, tile],
      out_specs=[tile, tile, tile, part, part],
      out_shape=[jax.ShapeDtypeStruct((layers, rows, LANES), jnp.float32)] * 3
      + [jax.ShapeDtypeStruct(part_shape, jnp.float32)] * 2,
      input_output_aliases={2: 0, 3: 1},
      interpret=backend == "interpret",
      name="fused_lamb",
      **kwargs,
  )(scalars, as_rows(g), as_rows(m), as_rows(v), as_rows(p))
  psq = jnp.sum(psq.reshape(layers, grid, -1)[:, :, 0], axis=1)
  usq = jnp.sum(usq.reshape(layers, grid, -1)[:, :, 0], axis=1)
  if not stacked:
    psq, usq = psq[0], usq[0]
  unrows = lambda x, dtype: x.reshape(layers, -1)[:, :n].reshape(shape).astype(dtype)
  return (unrows(m2, m.dtype), unrows(v2, v.dtype), unrows(u2, p.dtype), psq, usq)


def _resolve_mask(mask, params, default=True):
  """Leaf flags like `params` from a tree of bools, a prefix tree or a callable on params."""
  if mask is None:
    return jax.tree.map(lambda _: default, params)
  tree = mask(params) if callable(mask) else mask
  # A mask may be a prefix of the params tree: broadcast each flag over its subtree.
  return jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub), tree, params)


def _mesh_axes(entries) -> tuple:
  return tuple(a for entry in entries if entry is not None
               for a in ((entry,) if isinstance(entry, str) else entry))


def _sharded_step(sharding, step, stacked=False):
  """`step` run per shard under `jax.shard_map`, the squared norms summed over the shards.

  Stacked: each device holds whole layer slices along the mesh axes of dimension 0, so the
  per-layer norms are summed over the other axes only and stay split like the layers.
  """
  spec = sharding.spec
  if not _mesh_axes(spec):
    return step
  scalar = P()
  norm_spec = P(spec[0] if len(spec) else None) if stacked else scalar
  axes = _mesh_axes(spec[1:] if stacked else spec)

  def local(g, m, v, p, bc1, bc2, wd):
    m2, v2, u, psq, usq = step(g, m, v, p, bc1, bc2, wd)
    if axes:
      psq, usq = jax.lax.psum(psq, axes), jax.lax.psum(usq, axes)
    return m2, v2, u, psq, usq

  return jax.shard_map(local, mesh=sharding.mesh, in_specs=(spec,) * 4 + (scalar,) * 3,
                       out_specs=(spec, spec, spec, norm_spec, norm_spec), check_vma=False)


def fused_lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0,
               mask=None, *, stacked=None, interpret=None, block_rows=None,
               shardings=None) -> optax.GradientTransformation:
  """LAMB as one Pallas pass per tensor plus a fused epilogue; same arguments as `optax.lamb`.

  `learning_rate` and `weight_decay` may be schedules (called with the step count before this
  update, as optax does). `mask` (tree of bools, prefix tree, or callable on the params) limits
  weight decay; the trust ratio applies to every tensor. The trust ratio is 1 where ||p|| or
  ||u|| is zero. `update(grads, state, params)` needs params and returns -lr * trust * u.

  `stacked` (same forms as `mask`; None: nothing stacked) marks tensors that stack layers on
  axis 0: each slice gets its own trust ratio, exactly as if it were a separate tensor.

  `shardings`: optional tree like the params of `NamedSharding`s (None leaves: not sharded).
  XLA cannot partition a Pallas call, so a sharded tensor's kernel runs per shard inside
  `jax.shard_map` and its squared norms are summed over the mesh axes it is sharded on; without
  this, a sharded parameter would be gathered onto every device.
  """
  def init_fn(params):
    zeros = lambda p: jnp.zeros_like(p)
    return FusedLambState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                          nu=jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("fused_lamb needs params: call update(grads, state, params)")
    count_inc = optax.safe_increment(state.count)
    t = count_inc.astype(jnp.float32)
    bc1 = 1.0 - jnp.asarray(b1, jnp.float32) ** t
    bc2 = 1.0 - jnp.asarray(b2, jnp.float32) ** t
    wd = weight_decay(state.count) if callable(weight_decay) else weight_decay
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    flags = jax.tree.leaves(_resolve_mask(mask, params))
    stacks = jax.tree.leaves(_resolve_mask(stacked, params, default=False))
    layouts = (jax.tree.leaves(shardings, is_leaf=lambda x: x is None)
               if shardings is not None else [None] * len(flags))
    g_leaves, treedef = jax.tree.flatten(updates)
    m_leaves, v_leaves = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
    p_leaves = jax.tree.leaves(params)
    new_m, new_v, out = [], [], []
    for g, m, v, p, flag, stack, layout in zip(g_leaves, m_leaves, v_leaves, p_leaves, flags,
                                               stacks, layouts):
      step = functools.partial(lamb_step, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                               stacked=stack, interpret=interpret, block_rows=block_rows)
      if layout is not None:
        step = _sharded_step(layout, step, stack)
      decay = jnp.asarray(wd if flag else 0.0, jnp.float32)
      m2, v2, u, psq, usq = step(g, m, v, p, bc1, bc2, decay)
      p_norm, u_norm = jnp.sqrt(psq), jnp.sqrt(usq)
      trust = jnp.where((p_norm == 0.0) | (u_norm == 0.0), 1.0, p_norm / u_norm)
      if stack:
        trust = trust.reshape(trust.shape + (1,) * (u.ndim - 1))     # one ratio per layer
      out.append(jnp.asarray(-lr, u.dtype) * (u * trust.astype(u.dtype)))
      new_m.append(m2)
      new_v.append(v2)
    unflat = lambda leaves: jax.tree.unflatten(treedef, leaves)
    return unflat(out), FusedLambState(count=count_inc, mu=unflat(new_m), nu=unflat(new_v))

  return optax.GradientTransformation(init_fn, update_fn)
