"""SDP4Bit's quantized collectives, written per device (call inside `jax.shard_map` manual over
the data-parallel axes 'data' and 'fsdp').

Each function works on one parameter-shaped leaf. `dim` is the leaf's dimension sharded over
'fsdp' (None: the leaf is replicated over 'fsdp').

* `tlq_reduce_scatter` (TLq-HS): the gradient reduction. Level 1 runs over 'fsdp' (the fast,
  intra-node tier): every device cuts its gradient into one chunk per 'fsdp' rank, quantizes
  the chunks (8 bits), exchanges them in one all-to-all and sums what it receives: its own
  chunk, summed over the node. Level 2 runs over 'data' (the slow, inter-node tier): the chunk
  is Hadamard-transformed and quantized (4 bits) and reduced the same way (all-to-all, sum).
  Our parameters are replicated over 'data' (hybrid sharding), so the level-2 sum is then
  quantized once more and all-gathered over 'data' (same codes on every replica, so the
  replicas stay bitwise equal); in the paper's fully sharded layout that all-gather is the next
  step's weight all-gather. A level whose axis has size 1 is skipped.
* `qwd_all_gather` (qWD): the parameter all-gather. Every device quantizes the difference
  between its new shard and its slice of the reference weights (the weights every rank
  reconstructed last step), all-gathers the codes and adds the decoded differences to its
  full replica of the reference. The error does not accumulate: the next difference is taken
  against the reconstructed weights.

Leaves replicated over 'fsdp' (a few small vectors) are reduced with an exact `pmean`.
"""
import jax
import jax.numpy as jnp

from mscale_jax.sdp4bit.quant import Quantizer, dequantize, quantize

INTRA, INTER = "fsdp", "data"


def _rows_quantize(rows: jax.Array, q: Quantizer):
  return jax.vmap(lambda r: quantize(r, q))(rows)


def _rows_dequantize(payload, n: int, q: Quantizer) -> jax.Array:
  return jax.vmap(lambda p: dequantize(p, n, q))(payload)


def _exchange_and_sum(rows: jax.Array, axis: str, q: Quantizer) -> jax.Array:
  """rows [P, m], row i for rank i of `axis` -> [m]: the sum over ranks of their row for me,
  each row quantized by `q` on the wire (one all-to-all)."""
  payload = _rows_quantize(rows, q)
  received = jax.tree.map(lambda a: jax.lax.all_to_all(a, axis, 0, 0), payload)
  return jnp.sum(_rows_dequantize(received, rows.shape[1], q), axis=0)


def _all_gather_rows(x: jax.Array, axis: str, q: Quantizer) -> jax.Array:
  """[m] on each rank of `axis` -> [P, m], every rank's vector as its quantized codes decode."""
  payload = quantize(x, q)
  gathered = jax.tree.map(lambda a: jax.lax.all_gather(a, axis), payload)
  return _rows_dequantize(gathered, x.shape[0], q)


def _split_rows(flat: jax.Array, parts: int) -> jax.Array:
  """Flat [n] -> [parts, ceil(n / parts)], zero-padded."""
  pad = -flat.shape[0] % parts
  return jnp.pad(flat, (0, pad)).reshape(parts, -1)


def tlq_reduce_scatter(grad: jax.Array, dim: int | None, *, intra: Quantizer,
                       inter: Quantizer) -> jax.Array:
  """This device's local gradient leaf (full shape) -> its 'fsdp' shard of the mean gradient
  over all data-parallel devices (replicated over 'data'), reduced in two quantized levels."""
  f, d = jax.lax.axis_size(INTRA), jax.lax.axis_size(INTER)
  if dim is None:
    return jax.lax.pmean(grad, (INTER, INTRA))
  moved = jnp.moveaxis(grad, dim, 0)
  chunk_shape = (moved.shape[0] // f,) + moved.shape[1:]
  rows = moved.reshape(f, -1).astype(jnp.float32)
  chunk = _exchange_and_sum(rows, INTRA, intra) if f > 1 else rows[0]
  if d > 1:
    m = chunk.shape[0]
    piece = _exchange_and_sum(_split_rows(chunk, d), INTER, inter)
    chunk = _all_gather_rows(piece, INTER, inter).reshape(-1)[:m]
  chunk = chunk / (f * d)
  return jnp.moveaxis(chunk.reshape(chunk_shape).astype(grad.dtype), 0, dim)


def qwd_all_gather(shard: jax.Array, reference: jax.Array, dim: int | None, *, q: Quantizer,
                   mode: str = "differences") -> jax.Array:
  """This device's new 'fsdp' shard and its full reference replica -> the new reference.

  mode 'differences' (qWD): reference + decode(all-gather(quantize(shard - my slice of the
  reference))). mode 'weights' (the ablation qWD improves on): decode(all-gather(quantize(
  shard))). At 32 bits the shards themselves are gathered, so the reference equals the
  weights exactly. Leaves replicated over 'fsdp' need no communication.
  """
  f = jax.lax.axis_size(INTRA)
  if dim is None or f == 1:
    return shard
  if q.exact:
    return jax.lax.all_gather(shard, INTRA, axis=dim, tiled=True)
  size = shard.shape[dim]
  mine = jax.lax.dynamic_slice_in_dim(reference, jax.lax.axis_index(INTRA) * size, size, dim)
  sent = shard - mine if mode == "differences" else shard
  moved = jnp.moveaxis(sent, dim, 0)
  rows = _all_gather_rows(moved.reshape(-1).astype(jnp.float32), INTRA, q)   # [f, m]
  full = jnp.moveaxis(rows.reshape((f * moved.shape[0],) + moved.shape[1:]), 0, dim)
  full = full.astype(reference.dtype)
  return reference + full if mode == "differences" else full
