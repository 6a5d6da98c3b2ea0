"""Tensor + sequence parallelism: the two collective matmuls of a transformer block.

Between blocks, activations are sharded on the sequence over the 'tensor' mesh axis (sequence
parallelism, Korthikanti et al.). A block enters its tensor-parallel region with
`gather_matmul` (all-gather the sequence, multiply by column-parallel kernels) and leaves it with
`matmul_scatter` (multiply by row-parallel kernels, reduce-scatter the sum over the sequence).

Both take several kernels and do one collective matmul for all of them, by concatenating the
kernels' local shards on each device. So with the parallel block (MegaScale Figure 3) one
all-gather feeds [W_qkv | W_ffn_in] and one reduce-scatter follows [W_o ; W_ffn_out].

The communication strategy `tp_comm` is 'xla' (all-gather then dot; the baseline), 'ppermute'
(a ring of chunked dots and `ppermute`s that XLA overlaps) or 'pallas' (one fused kernel with
remote DMAs); all three live in `pallas_kernels.collective_matmul` and give the same numbers.

Inside the region every mesh axis is manual (the Pallas TPU interpreter requires it): the
batch is split over (data, fsdp) and kernels enter whole over fsdp, so XLA all-gathers
fsdp-sharded kernels on the way in and reduce-scatters their gradients on the way out.
"""
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mscale_jax.mesh import BATCH_AXES, auto_axes
from pallas_kernels import collective_matmul

AXIS = "tensor"


def _split_columns(y: jax.Array, widths: Sequence[int]) -> list[jax.Array]:
  offsets = [sum(widths[:i]) for i in range(1, len(widths))]
  return jnp.split(y, offsets, axis=-1)


def gather_matmul(x: jax.Array, kernels: Sequence[jax.Array], *,
                  tp_comm: str = "xla") -> list[jax.Array]:
  """All-gathers the sequence of `x`, then multiplies it by each column-parallel kernel.

  Args:
    x: [batch, seq, d] activations, sequence sharded over 'tensor' ([batch, seq/T, d] each).
    kernels: [d, n_i] weights, columns sharded over 'tensor' ([d, n_i/T] each).
    tp_comm: 'xla' | 'ppermute' | 'pallas'.
  Returns:
    One [batch, seq, n_i] array per kernel: the whole sequence, columns sharded over 'tensor'.
  """
  def local(x, *kernels):
    tp = jax.lax.axis_size(AXIS)
    b, s, d = x.shape
    widths = [k.shape[1] for k in kernels]
    w = jnp.concatenate(kernels, axis=1)
    y = collective_matmul.all_gather_matmul(x.reshape(b * s, d), w, axis_name=AXIS,
                                            impl=tp_comm)
    # Gathered rows come in device order: (tensor rank, example, local position).
    y = y.reshape(tp, b, s, -1).transpose(1, 0, 2, 3).reshape(b, tp * s, -1)
    return _split_columns(y, widths)

  n, batch = len(kernels), auto_axes(BATCH_AXES)
  return jax.shard_map(local, in_specs=(P(batch, AXIS, None),) + (P(None, AXIS),) * n,
                       out_specs=[P(batch, None, AXIS)] * n)(x, *kernels)


def matmul_scatter(xs: Sequence[jax.Array], kernels: Sequence[jax.Array], *,
                   tp_comm: str = "xla") -> jax.Array:
  """Sums `xs[i] @ kernels[i]` over row-parallel shards and reduce-scatters the sequence.

  Args:
    xs: [batch, seq, k_i] activations, the whole sequence, last dim sharded over 'tensor'.
    kernels: [k_i, d] weights, rows sharded over 'tensor'.
    tp_comm: 'xla' | 'ppermute' | 'pallas'.
  Returns:
    [batch, seq, d], sequence sharded over 'tensor' ([batch, seq/T, d] each).
  """
  def local(*args):
    xs, kernels = args[:len(args) // 2], args[len(args) // 2:]
    tp = jax.lax.axis_size(AXIS)
    x = jnp.concatenate(xs, axis=-1)
    w = jnp.concatenate(kernels, axis=0)
    b, s, k = x.shape
    # Rows in (tensor rank, example, local position) order, so rank r keeps sequence chunk r.
    rows = x.reshape(b, tp, s // tp, k).transpose(1, 0, 2, 3).reshape(b * s, k)
    y = collective_matmul.matmul_reduce_scatter(rows, w, axis_name=AXIS, impl=tp_comm)
    return y.reshape(b, s // tp, -1)

  n, batch = len(xs), auto_axes(BATCH_AXES)
  return jax.shard_map(local, in_specs=(P(batch, None, AXIS),) * n + (P(AXIS, None),) * n,
                       out_specs=P(batch, AXIS, None))(*xs, *kernels)
