"""Collective matmuls for tensor/sequence parallelism: all-gather-matmul and matmul-reduce-scatter.

Both functions are called inside `jax.shard_map` over one mesh axis of size P (`axis_name`),
on 2-D local operands:

  all_gather_matmul(x [m, k], w [k, n])      == all_gather(x, tiled=True) @ w      -> [P*m, n]
  matmul_reduce_scatter(x [M, k], w [k, n])  == psum_scatter(x @ w, tiled=True)    -> [M/P, n]

Three implementations give the same numbers:

  'xla'       the baseline: one all-gather, then one dot (or one dot, then one reduce-scatter);
              nothing overlaps unless XLA's own collective-matmul passes kick in.
  'ppermute'  a ring of P steps in plain JAX. All-gather: in step s the ppermute that carries
              chunk s+1 to the next device is issued before the dot of chunk s and the dot does
              not read it. Reduce-scatter: the dot of block s runs while the partial sum of step
              s-1 travels; only the add after the dot waits for it. On GPU/TPU XLA turns each
              ppermute into an async collective-permute-start/-done pair, so the transfer runs
              under the dot. On CPU collective-permutes are synchronous: the tests prove the
              dependency structure and order on CPU, not the overlap itself.
  'pallas'    one Pallas TPU kernel per call with the same ring: remote DMAs
              (`pltpu.make_async_remote_copy`) into double-buffered VMEM, a barrier-semaphore
              handshake before each DMA so no device overwrites a buffer its neighbour is still
              reading, and in every step the DMA of the next chunk is started before the matmul
              of the current chunk and waited on after it (see `_collective_ring_kernels.py`).
              Native on TPU; on CPU it runs under the TPU interpreter (`pltpu.InterpretParams()`)
              which simulates the DMAs and semaphores (and can detect races), so CPU runs prove
              correctness and absence of races, not speed.

`bidirectional=True` (ppermute and pallas) sends half of every chunk each way round the ring,
so both links of a device are busy. Gradients go through `jax.custom_vjp`: the backward of an
all-gather-matmul is a matmul-reduce-scatter (dx) plus a dot with the gathered x (dw), and the
backward of a matmul-reduce-scatter is an all-gather-matmul (dx) whose gathered cotangent is
reused for dw; the same `impl` runs in both directions.

Evidence (tests/test_collective_matmul.py, CPU): 'ppermute': in the compiled HLO each
collective-permute has a dot that neither feeds it nor reads it, the all-gather ring's
schedule alternates permute and dot, and a TP layer's forward+backward has no all-gather or
reduce-scatter left. 'pallas': the kernel's program order is, per step, handshake, DMA start,
matmul, DMA wait; the TPU interpreter's race detector finds no race (and does find one when the
handshake is removed). Actual overlap needs GPU/TPU: XLA:CPU has no async collective-permute.

Limits: the Pallas kernels hold their operands in VMEM (no grid), so a real TPU takes only
shapes that fit there; natively k and n must be multiples of 128. The TPU interpreter needs
every mesh axis manual (a clear error otherwise). Call these from a shard_map in which the axes
that shard the rows (batch: 'data', 'fsdp') are manual too: left automatic, XLA's partitioner
all-gathers over them around the ring's dynamic slices (16 such all-gathers in a
forward+backward TP layer with 'ppermute' vs 0 with 'data' manual).
"""
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _collective_ppermute as ring_jax
from pallas_kernels import _collective_ring_kernels as ring_pallas
from pallas_kernels._platform import platform_of, resolve_interpret, varying_axes

IMPLS = ("xla", "ppermute", "pallas")


class _Static(NamedTuple):
  axis_name: Any
  num_devices: int
  impl: str
  bidirectional: bool
  interpret: Any


# ---------------------------------------------------------------- checks and platform choice


def _axis_size(fn_name, axis_name):
  try:
    return jax.lax.axis_size(axis_name)
  except (NameError, KeyError, ValueError) as e:
    raise ValueError(
        f"{fn_name}: axis_name={axis_name!r} is not a bound mesh axis here; call {fn_name} "
        f"inside jax.shard_map over a mesh that has this axis (manual, e.g. "
        f"axis_names={{{axis_name!r}}})") from e


def _sublane_tile(dtype):
  """Rows in one TPU (sublane) tile for `dtype`: 8 for 32-bit, 16 for bf16."""
  return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _check(fn_name, x, w, p, impl, bidirectional, interpret):
  """Raises ValueError naming the argument and the shapes for anything that cannot work."""
  if impl not in IMPLS:
    raise ValueError(f"{fn_name}: impl={impl!r} is invalid; valid: {IMPLS}")
  if x.ndim != 2 or w.ndim != 2:
    raise ValueError(f"{fn_name}: x and w must be 2-D (reshape first); got x {x.shape}, "
                     f"w {w.shape}")
  if x.shape[1] != w.shape[0]:
    raise ValueError(f"{fn_name}: contracting dims differ: x {x.shape} [.., k] vs w {w.shape} "
                     f"[k, ..]")
  if x.dtype != w.dtype:
    raise ValueError(f"{fn_name}: x and w dtypes differ: x {x.dtype}, w {w.dtype}; cast one")
  if bidirectional and impl == "xla":
    raise ValueError(f"{fn_name}: bidirectional=True needs impl='ppermute' or 'pallas', "
                     f"not 'xla'")
  if fn_name == "all_gather_matmul":
    rows, what = x.shape[0], f"x rows m={x.shape[0]} (x {x.shape})"
  else:
    if x.shape[0] % p:
      raise ValueError(f"{fn_name}: x rows M={x.shape[0]} (x {x.shape}) must be divisible "
                       f"by the axis size P={p}")
    rows, what = x.shape[0] // p, f"x rows per device M/P={x.shape[0] // p} (x {x.shape}, P={p})"
  if bidirectional and rows % 2:
    raise ValueError(f"{fn_name}: bidirectional=True sends half the rows each way: {what} "
                     f"must be even")
  if impl == "pallas":
    tile = _sublane_tile(x.dtype)
    msg_rows = rows // 2 if bidirectional else rows
    if msg_rows % tile:
      raise ValueError(
          f"{fn_name}: the pallas kernel moves row tiles of {tile} ({x.dtype}): {what} "
          f"{'halved ' if bidirectional else ''}= {msg_rows} rows per message is not a "
          f"multiple of {tile}")
    if interpret is False and (w.shape[0] % 128 or w.shape[1] % 128):
      raise ValueError(f"{fn_name}: on TPU the pallas kernel needs k and n multiples of the "
                       f"128-lane tile; got w {w.shape}")


def _resolve_interpret(fn_name, impl, interpret, x):
  """False (native Mosaic) on TPU, TPU interpreter on CPU; `interpret` overrides.

  The kernel is TPU-only: GPU is refused, and so is interpret=True (the generic interpreter
  cannot simulate remote DMAs). interpret=False asks for Mosaic on any platform, so the
  kernel can be lowered for TPU from another machine.
  """
  if impl != "pallas":
    return None
  if interpret is True:
    raise ValueError(
        f"{fn_name}: interpret=True is the generic Pallas interpreter, which cannot simulate "
        f"remote DMAs; pass interpret=pltpu.InterpretParams() (the TPU interpreter)")
  platform = "tpu" if interpret is False else platform_of(x)
  backend, interpret = resolve_interpret(fn_name, interpret, platform, tpu_style=True)
  if backend == "gpu":
    raise ValueError(
        f"{fn_name}: impl='pallas' is a TPU kernel and the backend is {platform!r}; use "
        f"impl='ppermute' (or 'xla') here, or pass interpret=pltpu.InterpretParams() to "
        f"simulate it")
  return interpret


def _like(grad, primal):
  """Gives a cotangent the varying-axes type of its primal, as shard_map's transpose would.

  A gradient that varies over axes its primal does not (w replicated over 'tensor', or over
  'data' while x is batch-sharded there) is summed over them; one that varies over fewer is
  marked varying. With check_vma=False nothing is tracked and nothing changes.
  """
  extra = tuple(sorted(varying_axes(grad) - varying_axes(primal), key=str))
  if extra:
    grad = jax.lax.psum(grad, extra)
  missing = tuple(sorted(varying_axes(primal) - varying_axes(grad), key=str))
  if missing:
    grad = jax.lax.pcast(grad, missing, to="varying")
  return grad


def _check_interpretable(fn_name, interpret):
  """The TPU interpreter needs every mesh axis manual; say so instead of crashing.

  It simulates DMAs with io_callbacks, which JAX allows only when all mesh axes are manual.
  Running the kernel in a nested shard_map over the remaining (auto) axes works eagerly but
  aborts XLA:CPU under jit (`Check failed: buffer != nullptr`, JAX 0.10.2), so a shard_map
  that leaves axes automatic (a TP layer with only 'tensor' manual) gets a clear error.
  """
  if interpret is False:
    return
  mesh = jax.sharding.get_abstract_mesh()
  auto = [name for name, kind in zip(mesh.axis_names, mesh.axis_types)
          if kind != jax.sharding.AxisType.Manual]
  if auto:
    raise ValueError(
        f"{fn_name}: impl='pallas' under the TPU interpreter needs every mesh axis manual, but "
        f"axes {auto} are automatic here; use jax.shard_map without axis_names (all axes "
        f"manual), or impl='ppermute' on CPU (native TPU kernels have no such limit)")


# ---------------------------------------------------------------- forward implementations


def _ag_forward(st: _Static, x, w, save_gathered):
  if st.num_devices == 1:
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype), x
  if st.impl == "xla":
    xg = jax.lax.all_gather(x, st.axis_name, tiled=True)
    return jnp.dot(xg, w, preferred_element_type=jnp.float32).astype(x.dtype), xg
  if st.impl == "ppermute":
    return ring_jax.all_gather_matmul_ppermute(
        x, w, axis_name=st.axis_name, num_devices=st.num_devices,
        bidirectional=st.bidirectional, save_gathered=save_gathered)
  return ring_pallas.all_gather_matmul_pallas(
      x, w, axis_name=st.axis_name, num_devices=st.num_devices, bidirectional=st.bidirectional,
      save_gathered=save_gathered, interpret=st.interpret)


def _rs_forward(st: _Static, x, w):
  if st.num_devices == 1:
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
  if st.impl == "xla":
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return jax.lax.psum_scatter(y, st.axis_name, scatter_dimension=0, tiled=True)
  if st.impl == "ppermute":
    return ring_jax.matmul_reduce_scatter_ppermute(
        x, w, axis_name=st.axis_name, num_devices=st.num_devices,
        bidirectional=st.bidirectional)
  return ring_pallas.matmul_reduce_scatter_pallas(
      x, w, axis_name=st.axis_name, num_devices=st.num_devices, bidirectional=st.bidirectional,
      interpret=st.interpret)


def _dot_t(a, b, dtype):
  """a^T @ b without materialising the transpose, accumulated in float32."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32).astype(dtype)


# ---------------------------------------------------------------- custom_vjp wiring


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ag_matmul(st, x, w):
  return _ag_forward(st, x, w, save_gathered=False)[0]


def _ag_matmul_fwd(st, x, w):
  y, xg = _ag_forward(st, x, w, save_gathered=True)
  return y, (xg, x, w)


def _ag_matmul_bwd(st, res, dy):
  xg, x, w = res
  dy = dy.astype(x.dtype)
  dx = _rs_forward(st, dy, w.T)                       # psum_scatter(dy @ w^T)
  dw = _dot_t(xg, dy, w.dtype)
  return _like(dx, x), _like(dw, w)


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul_rs(st, x, w):
  return _rs_forward(st, x, w)


def _matmul_rs_fwd(st, x, w):
  return _rs_forward(st, x, w), (x, w)


def _matmul_rs_bwd(st, res, dy):
  x, w = res
  dy = dy.astype(x.dtype)
  dx, dyg = _ag_forward(st, dy, w.T, save_gathered=True)   # all_gather(dy) @ w^T
  dw = _dot_t(x, dyg, w.dtype)
  return _like(dx, x), _like(dw, w)


_matmul_rs.defvjp(_matmul_rs_fwd, _matmul_rs_bwd)


# ---------------------------------------------------------------- public API


def all_gather_matmul(x: jax.Array, w: jax.Array, *, axis_name, impl: str = "pallas",
                      bidirectional: bool = False, interpret: Any = None) -> jax.Array:
  """`all_gather(x, axis_name, tiled=True) @ w`, with the gather overlapped with the GEMM.

  Call inside `jax.shard_map` with `axis_name` manual. Shapes (local): x [m, k] (rows sharded
  over the axis), w [k, n]; returns [P*m, n], row blocks in device order. `impl` is 'xla',
  'ppermute' or 'pallas'; `bidirectional` splits every chunk over both ring directions;
  `interpret` (pallas only) overrides the platform choice: False = native Mosaic,
  `pltpu.InterpretParams(...)` = TPU interpreter (the CPU default). Differentiable.
  """
  p = _axis_size("all_gather_matmul", axis_name)
  interpret = _resolve_interpret("all_gather_matmul", impl, interpret, x) if impl == "pallas" \
      else None
  _check("all_gather_matmul", x, w, p, impl, bidirectional, interpret)
  if impl == "pallas":
    _check_interpretable("all_gather_matmul", interpret)
  st = _Static(axis_name, p, impl, bool(bidirectional), interpret)
  return _ag_matmul(st, x, w)


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, *, axis_name, impl: str = "pallas",
                          bidirectional: bool = False, interpret: Any = None) -> jax.Array:
  """`psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)`, overlapped.

  Call inside `jax.shard_map` with `axis_name` manual. Shapes (local): x [M, k] (k sharded
  over the axis), w [k, n]; returns [M/P, n], this device's row block of the summed product.
  Arguments as in `all_gather_matmul`. Partial sums travel the ring in x.dtype and are
  accumulated in float32 on each device. Differentiable.
  """
  p = _axis_size("matmul_reduce_scatter", axis_name)
  interpret = _resolve_interpret("matmul_reduce_scatter", impl, interpret, x) \
      if impl == "pallas" else None
  _check("matmul_reduce_scatter", x, w, p, impl, bidirectional, interpret)
  if impl == "pallas":
    _check_interpretable("matmul_reduce_scatter", interpret)
  st = _Static(axis_name, p, impl, bool(bidirectional), interpret)
  return _matmul_rs(st, x, w)
