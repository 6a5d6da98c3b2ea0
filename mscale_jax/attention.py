"""Causal attention with an optional sliding window, behind one `attention_impl` switch.

`window=w` means query i attends keys j with i - w < j <= i (w=1: itself only; w >= seq: full
causal attention). `segment_ids` (int [b, s], optional) keep attention inside documents packed
into one sequence, as MaxText's packing does: query i sees key j only if their segment ids are
equal, on top of the causal window. Implementations:
  'xla'    masked softmax in plain jnp (float32 softmax); the reference everywhere;
  'pallas' our flash-attention kernel (`pallas_kernels.flash_attention`), which skips key blocks
           wholly outside the window; run per device on local heads;
  'cudnn'  `jax.nn.dot_product_attention(implementation='cudnn')` with its local window (GPU).
The choice is logged once; nothing falls back silently. Segment ids are taken by 'xla' only:
the kernels have no segment input, so `config.validate` refuses that combination.
"""
import functools
import logging

import jax
import jax.numpy as jnp

from mscale_jax import mesh as mesh_lib
from mscale_jax.errors import ConfigError

log = logging.getLogger("mscale_jax")

# q, k, v and the output: [batch, seq, heads, head_dim], heads sharded over 'tensor'.
QKV_NAMES = ("batch", "seq", "heads", "head_dim")


def causal_window_mask(seq_len: int, window: int | None) -> jax.Array:
  """[seq, seq] boolean mask: True where query i may attend key j."""
  positions = jnp.arange(seq_len)
  return window_mask(positions, positions, window)


def window_mask(q_positions, k_positions, window: int | None) -> jax.Array:
  """[q, k] boolean mask from positions: key at j is visible to query at i if i - w < j <= i.

  Negative key positions mark empty slots (of a decoding cache) and are never visible.
  """
  i, j = q_positions[:, None], k_positions[None, :]
  mask = (j <= i) & (j >= 0)
  if window is not None:
    mask &= j > i - window
  return mask


def xla_attention(q, k, v, *, window: int | None = None, segment_ids=None) -> jax.Array:
  """Reference causal attention: [b, s, h, d] -> [b, s, h, d], softmax in float32.

  With `segment_ids` (int [b, s]) a query sees only keys of its own segment.
  """
  mask = causal_window_mask(q.shape[1], window)
  if segment_ids is not None:
    segment_ids = mesh_lib.constrain(segment_ids, ("batch", "seq"))
    mask = mask[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return _masked_attention(q, k, v, mask)


def attention_at(q, k, v, *, q_positions, k_positions, window: int | None) -> jax.Array:
  """Attention of queries [b, s, h, d] at `q_positions` [s] over keys/values [b, n, h, d] at
  `k_positions` [n] in any order (-1: empty), as decoding with a key/value cache needs."""
  return _masked_attention(q, k, v, window_mask(q_positions, k_positions, window))


def _masked_attention(q, k, v, mask) -> jax.Array:
  """Softmax attention under a boolean mask [q, k] (one for all rows) or [b, q, k] (per row)."""
  scale = q.shape[-1] ** -0.5
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  mask = mask[:, None] if mask.ndim == 3 else mask
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _pallas_attention(q, k, v, *, window):
  from pallas_kernels.flash_attention import flash_attention
  return flash_attention(q, k, v, causal=True, window=window)


def _cudnn_attention(q, k, v, *, window):
  local_window = None if window is None else (window - 1, 0)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                      local_window_size=local_window)


@functools.cache
def _log_choice(impl: str, window: int | None) -> None:
  log.info("attention: impl=%s window=%s", impl, window)


def attention(q, k, v, *, window: int | None, impl: str, segment_ids=None) -> jax.Array:
  """Causal (sliding-window) attention with the chosen implementation; [b, s, h, d] in and out.

  `segment_ids` (int [b, s] or None) restricts each query to keys of its own segment; only
  impl='xla' takes them (ConfigError otherwise, rather than ignoring them).
  """
  _log_choice(impl, window)
  if impl == "xla":
    return xla_attention(q, k, v, window=window, segment_ids=segment_ids)
  if segment_ids is not None:
    raise ConfigError("model.attention_impl", impl, "'xla' with data.document_mask=True: the "
                      f"{impl} kernel takes no segment ids")
  kernel = {"pallas": _pallas_attention, "cudnn": _cudnn_attention}[impl]
  # Kernels are custom calls XLA cannot partition: run them on each device's heads and batch.
  return mesh_lib.per_shard(functools.partial(kernel, window=window),
                            in_names=(QKV_NAMES,) * 3, out_names=QKV_NAMES)(q, k, v)
