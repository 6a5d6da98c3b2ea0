"""Plain-JAX rings behind `collective_matmul.py` (impl='ppermute').

The same decomposition as the Pallas kernels, written with `jax.lax.ppermute` inside
`jax.shard_map`: in every step the permute that carries the next chunk (all-gather) or the
previous partial sum (reduce-scatter) is issued before the dot of the current chunk and the
dot does not read its result, so XLA's async collective-permutes (start/done on GPU and TPU)
can run under the dot. On CPU collective-permutes are synchronous: the order is right, the
overlap is not real.
"""
import jax
import jax.numpy as jnp


def _ring(p, shift):
  return [(j, (j + shift) % p) for j in range(p)]


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _halves(rows, bidirectional):
  """(row offset, rows, shift) per ring: clockwise sends to i+1, counter-clockwise to i-1."""
  if not bidirectional:
    return ((0, rows, 1),)
  h = rows // 2
  return ((0, h, 1), (h, h, -1))


def all_gather_matmul_ppermute(x, w, *, axis_name, num_devices, bidirectional, save_gathered):
  """Ring all-gather matmul: local x [m, k], w [k, n] -> (y [P*m, n], gathered x or None)."""
  p = num_devices
  m, k = x.shape
  n = w.shape[1]
  me = jax.lax.axis_index(axis_name)
  rings = _halves(m, bidirectional)
  chunks = [x[offset:offset + rows] for offset, rows, _ in rings]
  y = jnp.zeros((p * m, n), x.dtype)
  xg = jnp.zeros((p * m, k), x.dtype) if save_gathered else None
  for s in range(p):
    # Issued first, not read until the next step: free to overlap the dots below.
    nxt = ([jax.lax.ppermute(c, axis_name, _ring(p, shift)) for c, (_, _, shift)
            in zip(chunks, rings)] if s < p - 1 else None)
    for c, (offset, _, shift) in zip(chunks, rings):
      block = (me - shift * s) % p
      start = block * m + offset
      y = jax.lax.dynamic_update_slice(y, _dot(c, w).astype(x.dtype), (start, 0))
      if save_gathered:
        xg = jax.lax.dynamic_update_slice(xg, c, (start, 0))
    chunks = nxt
  return y, xg


def matmul_reduce_scatter_ppermute(x, w, *, axis_name, num_devices, bidirectional):
  """Ring matmul-reduce-scatter: local x [M, k], w [k, n] -> [M/P, n]; sums travel in x.dtype."""
  p = num_devices
  k = x.shape[1]
  mb = x.shape[0] // p
  me = jax.lax.axis_index(axis_name)
  rings = _halves(mb, bidirectional)
  received = [None] * len(rings)
  finished = [None] * len(rings)
  for s in range(p):
    for r, (offset, rows, shift) in enumerate(rings):
      # Clockwise: block (me - s - 1) % P, which ends at block `me` after P-1 hops.
      block = (me - shift * (s + 1)) % p
      part = _dot(jax.lax.dynamic_slice(x, (block * mb + offset, 0), (rows, k)), w)
      if s > 0:
        part = part + received[r].astype(jnp.float32)
      if s < p - 1:
        received[r] = jax.lax.ppermute(part.astype(x.dtype), axis_name, _ring(p, shift))
      else:
        finished[r] = part.astype(x.dtype)
  return jnp.concatenate(finished, axis=0) if len(finished) > 1 else finished[0]
