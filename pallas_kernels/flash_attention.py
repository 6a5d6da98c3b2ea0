"""Causal and sliding-window flash attention in Pallas, forward and backward.

`flash_attention(q, k, v)` computes softmax(q k^T * sm_scale + mask) v for q, k, v of shape
[batch, seq, heads, head_dim] without materialising the [seq, seq] score matrix: each query
block keeps a running max, running sum and output accumulator (the online softmax of
FlashAttention-2) and saves the log-sum-exp for the backward pass, which recomputes the scores
block by block (one kernel for dQ, one for dK and dV).

Mask convention (that of `jax.nn.dot_product_attention` with `local_window_size=(w - 1, 0)`
and `is_causal=True`, or `local_window_size=w - 1` without):
  causal=True,  window=None: j <= i
  causal=True,  window=w:    i - w < j <= i           (w keys including the query itself)
  causal=False, window=None: every j
  causal=False, window=w:    |i - j| < w              (symmetric, 2w - 1 keys)
Only tiles that hold at least one kept (i, j) are visited, so with a window the work is
O(seq * w) rather than O(seq^2), forward and backward; tiles kept whole skip the masking.
Sequence lengths must be a multiple of both block sizes (otherwise ConfigError).

Backends are chosen from the platform of the inputs (under `jit`, the default backend):
Triton on GPU, Mosaic on TPU, the Pallas interpreter on CPU; `interpret=True` (or a
`pltpu.InterpretParams`) forces the interpreter. The chosen path is logged at INFO level.
Softmax statistics and accumulators are float32 whatever the input dtype; outputs and
gradients come back in the input dtype.
"""
import functools
import logging
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _flash_kernels as _k
from pallas_kernels._platform import ConfigError, platform_of, resolve_interpret

__all__ = ["flash_attention", "reference_attention", "attention_mask", "visited_blocks",
           "ConfigError"]

_log = logging.getLogger(__name__)

# Default (block_q, block_k) per backend. Triton: 128 x 64 tiles keep the fp32 accumulators of
# head_dim 128 in registers with 8 warps, and the backward (two accumulators per program) gets
# 64 x 64; Mosaic wants multiples of 128 on the lane dimension. Untuned guesses: sweep on a GPU.
_DEFAULT_BLOCKS = {"triton": (128, 64), "mosaic": (128, 128), "interpret": (128, 128)}
_DEFAULT_BWD_BLOCKS = {"triton": (64, 64)}


_BACKEND_NAMES = {"gpu": "triton", "tpu": "mosaic", "interpret": "interpret"}


def _resolve_backend(q, interpret):
  """('triton' | 'mosaic' | 'interpret', interpret_params) for this call."""
  backend, params = resolve_interpret("flash_attention", interpret, platform_of(q))
  return _BACKEND_NAMES[backend], params if backend == "interpret" else True


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _pick_block(name, value, default, seq_len, backend):
  """Validates one block size (or fills in the default) against seq_len and the backend."""
  if value is None:
    value = min(default, seq_len)
  elif not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ConfigError(name, value, "a positive int")
  value = int(value)
  if value > seq_len:
    raise ConfigError(name, value, f"at most the sequence length {seq_len}")
  if seq_len % value:
    raise ConfigError(name, value,
                      f"must divide the sequence length {seq_len} (q/k/v seq axis); pad the "
                      "sequence or pick a divisor")
  if backend == "triton" and (not _is_pow2(value) or value < 16):
    raise ConfigError(name, value, "a power of two >= 16 on GPU (Triton tiles)")
  return value


def _validate(q, k, v, causal, window, sm_scale, block_q, block_k, bwd_blocks, interpret):
  """Checks shapes and options before anything compiles; returns a KernelConfig."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ConfigError(f"{name}.shape", getattr(x, "shape", None),
                        "4-D [batch, seq, heads, head_dim]")
  if not q.shape == k.shape == v.shape:
    raise ConfigError("k.shape/v.shape", (k.shape, v.shape),
                      f"equal to q.shape {q.shape} (self-attention, same heads)")
  if not q.dtype == k.dtype == v.dtype:
    raise ConfigError("k.dtype/v.dtype", (str(k.dtype), str(v.dtype)),
                      f"equal to q.dtype {q.dtype}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ConfigError("q.dtype", str(q.dtype), "a floating dtype")
  if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer))
                             or window < 1):
    raise ConfigError("window", window, "None or an int >= 1")
  _, seq_len, _, head_dim = q.shape
  backend, interpret_params = _resolve_backend(q, interpret)
  if backend == "triton" and (not _is_pow2(head_dim) or head_dim < 16):
    raise ConfigError("q.shape[-1] (head_dim)", head_dim, "a power of two >= 16 on GPU")
  default_q, default_k = _DEFAULT_BLOCKS[backend]
  block_q = _pick_block("block_q", block_q, default_q, seq_len, backend)
  block_k = _pick_block("block_k", block_k, default_k, seq_len, backend)
  if bwd_blocks is None:
    bwd_q, bwd_k = _DEFAULT_BWD_BLOCKS.get(backend, (block_q, block_k))
    bwd_q, bwd_k = min(bwd_q, block_q), min(bwd_k, block_k)
  elif isinstance(bwd_blocks, (tuple, list)) and len(bwd_blocks) == 2:
    bwd_q, bwd_k = bwd_blocks
  else:
    raise ConfigError("bwd_blocks", bwd_blocks, "None or a pair (block_q, block_k)")
  bwd_q = _pick_block("bwd_blocks[0]", bwd_q, bwd_q, seq_len, backend)
  bwd_k = _pick_block("bwd_blocks[1]", bwd_k, bwd_k, seq_len, backend)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  num_warps = (4 if head_dim <= 64 else 8) if backend == "triton" else None
  num_stages = 2 if backend == "triton" else None
  cfg = _k.KernelConfig(causal=bool(causal), window=None if window is None else int(window),
                        sm_scale=float(sm_scale), block_q=block_q, block_k=block_k,
                        bwd_block_q=bwd_q, bwd_block_k=bwd_k,
                        backend=backend, num_warps=num_warps, num_stages=num_stages,
                        interpret_params=interpret_params)
  _log.info("flash_attention: backend=%s shape=%s dtype=%s causal=%s window=%s blocks=%dx%d "
            "(backward %dx%d)", backend, q.shape, q.dtype, cfg.causal, cfg.window, block_q,
            block_k, bwd_q, bwd_k)
  return cfg


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg):
  return _k.forward(q, k, v, cfg)[0]


def _attention_fwd(q, k, v, cfg):
  o, lse = _k.forward(q, k, v, cfg)
  return o, (q, k, v, o, lse)


def _attention_bwd(cfg, residuals, do):
  q, k, v, o, lse = residuals
  return _k.backward(q, k, v, o, lse, do, cfg)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q, k, v, *, causal: bool = True, window: int | None = None,
                    sm_scale: float | None = None, block_q: int | None = None,
                    block_k: int | None = None, bwd_blocks: tuple[int, int] | None = None,
                    interpret=None):
  """Flash attention with an optional sliding window; differentiable (custom VJP).

  Args:
    q, k, v: [batch, seq, heads, head_dim], one floating dtype (bf16, f16 or f32).
    causal: keep only keys j <= i.
    window: keep only keys within `window` positions (see the module docstring).
    sm_scale: score scale; defaults to 1 / sqrt(head_dim).
    block_q, block_k: forward query / key block sizes; must divide seq. Defaults per backend.
    bwd_blocks: (block_q, block_k) of the backward kernels; defaults per backend.
    interpret: None picks the backend from the platform; True (or pltpu.InterpretParams)
      runs the Pallas interpreter; False refuses to fall back to it on CPU.

  Returns:
    [batch, seq, heads, head_dim] in q's dtype.

  Raises:
    ConfigError (a ValueError) naming the argument, e.g. when seq is not a multiple of a block.
  """
  cfg = _validate(q, k, v, causal, window, sm_scale, block_q, block_k, bwd_blocks, interpret)
  return _attention(q, k, v, cfg)


def attention_mask(seq_len: int, *, causal: bool = True, window: int | None = None):
  """Boolean [seq_len, seq_len] mask, True where query i may attend key j."""
  i = np.arange(seq_len)[:, None]
  j = np.arange(seq_len)[None, :]
  keep = np.ones((seq_len, seq_len), bool)
  if causal:
    keep &= j <= i
  if window is not None:
    keep &= i - j < window
    if not causal:
      keep &= j - i < window
  return keep


def visited_blocks(seq_len: int, block_q: int, block_k: int, *, causal: bool = True,
                   window: int | None = None, backward: bool = False):
  """int8 [seq/block_q, seq/block_k] map of the tiles the kernels compute.

  0: skipped, 1: computed with the mask applied, 2: computed without a mask (kept whole).
  Uses the kernels' own loop bounds: the forward and dQ kernels walk key blocks per query block;
  `backward=True` gives the dK/dV kernel's walk (query blocks per key block), laid out the
  same way.
  """
  nq, nk = seq_len // block_q, seq_len // block_k
  out = np.zeros((nq, nk), np.int8)
  kw = dict(block_q=block_q, block_k=block_k, seq_len=seq_len, causal=causal, window=window)
  for outer in range(nk if backward else nq):
    walk, full = ((_k.q_block_range, _k.q_full_range) if backward else
                  (_k.kv_block_range, _k.kv_full_range))
    lo, hi = (int(x) for x in walk(outer, **kw))
    lo_full, hi_full = (int(x) for x in full(outer, **kw))
    line = out[:, outer] if backward else out[outer]
    line[lo:hi] = 1
    line[lo_full:hi_full] = 2
  return out


def reference_attention(q, k, v, *, causal: bool = True, window: int | None = None,
                        sm_scale: float | None = None):
  """Plain-XLA attention in float32 (masked softmax); [B, S, H, D] in, q's dtype out.

  Materialises the [B, H, S, S] scores: for tests and as the benchmark baseline only.
  """
  head_dim = q.shape[-1]
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  hi = lax.Precision.HIGHEST
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32),
                 precision=hi) * scale
  seq_len = q.shape[1]
  if causal or window is not None:
    mask = jnp.asarray(attention_mask(seq_len, causal=causal, window=window))
    s = jnp.where(mask, s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision=hi)
  return o.astype(q.dtype)
