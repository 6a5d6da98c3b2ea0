"""Pallas TPU ring kernels behind `collective_matmul.py` (impl='pallas').

Each kernel runs on every device of one mesh axis (inside `jax.shard_map`) and moves data
round the ring with `pltpu.make_async_remote_copy`. In ring step s:

  all-gather:      handshake; start the DMA of chunk s to the next device; matmul of chunk s
                   (the DMA reads the same chunk, the matmul never touches the slot it
                   writes); wait on the DMA (send and receive).
  reduce-scatter:  matmul of block s (while the partial sum of step s-1 is in flight); wait
                   on that DMA; add; write the new partial sum; handshake; start its DMA.

The handshake: each device signals, on the barrier semaphore, the neighbour(s) that write
into its buffers, and waits for the signal of the neighbour(s) it writes to. A device gives
that signal only once it has finished with the slot about to be overwritten (its previous
step), so no DMA lands in a buffer that is still being read.

Ring buffers are double-buffered VMEM scratch ([2, rows, cols], one DMA semaphore per slot),
so step s+1's data lands in the slot that step s is not reading. Operands live in VMEM whole
(no grid), which bounds the sizes a real TPU accepts by its VMEM; the steps are unrolled in
Python (P <= a few dozen), so slot indices are static and the program order of DMA starts,
dots and waits can be read off the kernel's jaxpr (`tests/test_collective_matmul.py` does).

Bidirectional variants split each chunk in two halves of rows: the top half goes clockwise
(to device i+1), the bottom half counter-clockwise (to device i-1), so both links of every
device carry half the bytes at once.
"""
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._platform import out_struct

# Barrier semaphores are keyed by this id; both kernels talk to the same neighbours on the
# same axis with balanced signal/wait counts, so they may share it.
_COLLECTIVE_ID = 7


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _neighbours(index_ref, num_devices):
  # The ring position comes in through SMEM rather than from lax.axis_index inside the
  # kernel: the TPU interpreter mixes the latter's varying type with invariant constants
  # and fails under shard_map(check_vma=True).
  me = index_ref[0]
  right = jax.lax.rem(me + 1, num_devices)
  left = jax.lax.rem(me + num_devices - 1, num_devices)
  return me, left, right


def _handshake(axis_name, senders):
  """Tells each device that writes into our buffers (`senders`) that we finished reading
  them, then waits until every device we write to has told us the same."""
  barrier = pltpu.get_barrier_semaphore()
  for sender in senders:
    pl.semaphore_signal(barrier, 1, device_id={axis_name: sender},
                        device_id_type=pl.DeviceIdType.MESH)
  pl.semaphore_wait(barrier, len(senders))


class _Ring(NamedTuple):
  """One direction of a ring: which rows it carries, where it sends, which way it turns.

  `sign` is -1 for clockwise (send to i+1, so the data held in step s comes from i-s) and
  +1 for counter-clockwise (send to i-1, data from i+s). `offset` is the first row it
  carries within a chunk (0, or half the chunk for the second direction).
  """
  dest: jax.Array
  sign: int
  offset: int
  send: Any          # all-gather: the receive/forward buffer; reduce-scatter: the send buffer
  recv: Any = None   # reduce-scatter only


def _rings(bidirectional, rows, left, right, buffers):
  """The ring directions, rows per message and the devices that write into our buffers."""
  if not bidirectional:
    return (_Ring(right, -1, 0, *buffers[0]),), rows, [left]
  h = rows // 2
  return (_Ring(right, -1, 0, *buffers[0]), _Ring(left, +1, h, *buffers[1])), h, [left, right]


def _block(me, s, sign, p):
  """(me - s) % P clockwise, (me + s) % P counter-clockwise, without negative operands."""
  return jax.lax.rem(me + p - s, p) if sign < 0 else jax.lax.rem(me + s, p)


def _all_gather_matmul_kernel(*refs, axis_name, num_devices, bidirectional, save_gathered):
  """y[(me - s) % P] = chunk_s @ w for s = 0..P-1, chunk_s arriving from the left."""
  if save_gathered:
    index_ref, x_ref, w_ref, y_ref, xg_ref, *scratch = refs
  else:
    (index_ref, x_ref, w_ref, y_ref, *scratch), xg_ref = refs, None
  *buffers, send_sems, recv_sems = scratch
  p, m = num_devices, x_ref.shape[0]
  me, left, right = _neighbours(index_ref, p)
  rings, size, senders = _rings(bidirectional, m, left, right, [(b,) for b in buffers])

  def chunk_ref(ring, s):
    return x_ref.at[pl.ds(ring.offset, size)] if s == 0 else ring.send.at[s % 2]

  for s in range(p):
    copies = []
    if s < p - 1:
      _handshake(axis_name, senders)
      for r, ring in enumerate(rings):
        nxt = (s + 1) % 2
        copy = pltpu.make_async_remote_copy(
            src_ref=chunk_ref(ring, s), dst_ref=ring.send.at[nxt],
            send_sem=send_sems.at[r, nxt], recv_sem=recv_sems.at[r, nxt],
            device_id={axis_name: ring.dest}, device_id_type=pl.DeviceIdType.MESH)
        copy.start()
        copies.append(copy)
    for ring in rings:
      chunk = chunk_ref(ring, s)[...]
      start = _block(me, s, ring.sign, p) * m + ring.offset
      rows = pl.ds(pl.multiple_of(start, size), size)
      y_ref[rows, :] = _dot(chunk, w_ref[...]).astype(y_ref.dtype)
      if xg_ref is not None:
        xg_ref[rows, :] = chunk
    for copy in copies:
      copy.wait()


def _matmul_reduce_scatter_kernel(index_ref, x_ref, w_ref, y_ref, *scratch, axis_name,
                                  num_devices, bidirectional):
  """Partial sums of block b travel the ring; device i finishes block i at step P-1."""
  *buffers, send_sems, recv_sems = scratch
  p = num_devices
  mb = x_ref.shape[0] // p
  me, left, right = _neighbours(index_ref, p)
  pairs = [tuple(buffers[i:i + 2]) for i in range(0, len(buffers), 2)]
  rings, size, senders = _rings(bidirectional, mb, left, right, pairs)

  def descriptor(r, s):
    ring = rings[r]
    return pltpu.make_async_remote_copy(
        src_ref=ring.send.at[s % 2], dst_ref=ring.recv.at[s % 2],
        send_sem=send_sems.at[r, s % 2], recv_sem=recv_sems.at[r, s % 2],
        device_id={axis_name: ring.dest}, device_id_type=pl.DeviceIdType.MESH)

  for s in range(p):
    partials = []
    for ring in rings:
      # Step s works on block (me - s - 1) % P clockwise, (me + s + 1) % P the other way.
      start = _block(me, s + 1, ring.sign, p) * mb + ring.offset
      partials.append(_dot(x_ref[pl.ds(pl.multiple_of(start, size), size), :], w_ref[...]))
    if s > 0:
      for r, ring in enumerate(rings):
        descriptor(r, s - 1).wait()
        partials[r] = partials[r] + ring.recv[(s - 1) % 2].astype(jnp.float32)
    if s < p - 1:
      for ring, partial in zip(rings, partials):
        ring.send[s % 2] = partial.astype(ring.send.dtype)
      _handshake(axis_name, senders)
      for r in range(len(rings)):
        descriptor(r, s).start()
    else:
      for ring, partial in zip(rings, partials):
        y_ref[pl.ds(ring.offset, size), :] = partial.astype(y_ref.dtype)


def _ring_index(axis_name):
  return jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)


def _smem_spec():
  return pl.BlockSpec(memory_space=pltpu.SMEM)


def _vmem_spec():
  return pl.BlockSpec(memory_space=pltpu.VMEM)


def _compiler_params():
  return pltpu.CompilerParams(collective_id=_COLLECTIVE_ID)


def all_gather_matmul_pallas(x, w, *, axis_name, num_devices, bidirectional, save_gathered,
                             interpret):
  """Pallas ring all-gather matmul on local x [m, k], w [k, n] -> ([P*m, n], [P*m, k]?)."""
  p = num_devices
  m, k = x.shape
  n = w.shape[1]
  rows = m // 2 if bidirectional else m
  rings = 2 if bidirectional else 1
  buffers = [pltpu.VMEM((2, rows, k), x.dtype) for _ in range(rings)]
  scratch = buffers + [pltpu.SemaphoreType.DMA((rings, 2)), pltpu.SemaphoreType.DMA((rings, 2))]
  out_shape = [out_struct((p * m, n), x.dtype, x)]
  if save_gathered:
    out_shape.append(out_struct((p * m, k), x.dtype, x))
  kernel = functools.partial(_all_gather_matmul_kernel, axis_name=axis_name, num_devices=p,
                             bidirectional=bidirectional, save_gathered=save_gathered)
  name = "all_gather_matmul_bidi" if bidirectional else "all_gather_matmul"
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, in_specs=[_smem_spec(), _vmem_spec(), _vmem_spec()],
      out_specs=[_vmem_spec() for _ in out_shape], scratch_shapes=scratch,
      compiler_params=_compiler_params(), interpret=interpret, name=name,
  )(_ring_index(axis_name), x, w)
  return (outs[0], outs[1]) if save_gathered else (outs[0], None)


def matmul_reduce_scatter_pallas(x, w, *, axis_name, num_devices, bidirectional, interpret):
  """Pallas ring matmul-reduce-scatter on local x [M, k], w [k, n] -> [M/P, n]."""
  p = num_devices
  mb = x.shape[0] // p
  n = w.shape[1]
  rows = mb // 2 if bidirectional else mb
  rings = 2 if bidirectional else 1
  buffers = [pltpu.VMEM((2, rows, n), x.dtype) for _ in range(2 * rings)]
  scratch = buffers + [pltpu.SemaphoreType.DMA((rings, 2)), pltpu.SemaphoreType.DMA((rings, 2))]
  kernel = functools.partial(_matmul_reduce_scatter_kernel, axis_name=axis_name,
                             num_devices=p, bidirectional=bidirectional)
  name = "matmul_reduce_scatter_bidi" if bidirectional else "matmul_reduce_scatter"
  return pl.pallas_call(
      kernel, out_shape=out_struct((mb, n), x.dtype, x),
      in_specs=[_smem_spec(), _vmem_spec(), _vmem_spec()], out_specs=_vmem_spec(),
      scratch_shapes=scratch, compiler_params=_compiler_params(), interpret=interpret, name=name,
  )(_ring_index(axis_name), x, w)
