"""Pallas kernel bodies and `pallas_call` builders for `flash_attention`.

Private to `pallas_kernels.flash_attention`. Every kernel instance owns one (batch, head) pair
and one block of rows; the other operand (all keys, or all queries) stays in the kernel's view
whole, and a `fori_loop` walks only the blocks of it that the causal/window mask touches
(`kv_block_range`, `q_block_range`). Refs seen by the bodies are 2-D [rows, head_dim] (and 1-D
[rows] for the softmax statistics) whatever the array layout, so one body serves the Triton
(GPU), Mosaic (TPU) and interpreter paths.
"""
import dataclasses
import functools

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._platform import out_struct

# Finite, so a row whose first visited block is wholly masked gives exp(0) garbage that the
# next real block rescales by exp(MASK - m) = 0, instead of exp(-inf + inf) = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Scores are kept in base 2 (scaled by log2(e)) so softmax uses exp2, one cheap instruction on
# GPUs; the saved log-sum-exp is in the same units.
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static (hashable) settings of one attention call, after validation."""
  causal: bool
  window: int | None
  sm_scale: float
  block_q: int
  block_k: int
  bwd_block_q: int
  bwd_block_k: int
  backend: str          # 'triton' | 'mosaic' | 'interpret'
  num_warps: int | None = None
  num_stages: int | None = None
  interpret_params: object = True   # True, or a hashable pltpu.InterpretParams


def _imax(a, b):
  return jnp.maximum(a, b)


def _imin(a, b):
  return jnp.minimum(a, b)


def kv_block_range(q_block, *, block_q, block_k, seq_len, causal, window):
  """Half-open range [lo, hi) of key blocks that query block `q_block` must visit.

  Exactly the key blocks holding at least one (i, j) the mask keeps, so a window of w visits
  about (w + block_q) / block_k blocks per query block whatever seq_len is. Works on Python
  ints (tests) and traced int32 scalars (kernels).
  """
  first_q = q_block * block_q
  last_q = first_q + block_q - 1
  lo_key = 0 if window is None else _imax(first_q - window + 1, 0)
  if causal:
    hi_key = last_q
  elif window is None:
    hi_key = seq_len - 1
  else:
    hi_key = _imin(last_q + window - 1, seq_len - 1)
  return lo_key // block_k, hi_key // block_k + 1


def q_block_range(k_block, *, block_q, block_k, seq_len, causal, window):
  """Half-open range [lo, hi) of query blocks that see key block `k_block` (the transpose)."""
  first_k = k_block * block_k
  last_k = first_k + block_k - 1
  if causal:
    lo_q = first_k
  elif window is None:
    lo_q = 0
  else:
    lo_q = _imax(first_k - window + 1, 0)
  hi_q = seq_len - 1 if window is None else _imin(last_k + window - 1, seq_len - 1)
  return lo_q // block_q, hi_q // block_q + 1


def _ceil_div(a, b):
  return -((-a) // b)


def _clamp_inner(lo_full, hi_full, lo, hi):
  lo_full = _imin(_imax(lo_full, lo), hi)
  return lo_full, _imin(_imax(hi_full, lo_full), hi)


def kv_full_range(q_block, *, block_q, block_k, seq_len, causal, window):
  """Sub-range of `kv_block_range` whose tiles the mask keeps whole, so need no masking."""
  lo, hi = kv_block_range(q_block, block_q=block_q, block_k=block_k, seq_len=seq_len,
                          causal=causal, window=window)
  first_q = q_block * block_q
  last_q = first_q + block_q - 1
  # Whole tile kept: last key <= first query (causal), first key > last query - window, and
  # (non-causal window) last key < first query + window.
  lo_full = lo if window is None else _ceil_div(last_q - window + 1, block_k)
  if causal:
    hi_full = (first_q + 1) // block_k
  elif window is None:
    hi_full = hi
  else:
    hi_full = (first_q + window) // block_k
  return _clamp_inner(lo_full, hi_full, lo, hi)


def q_full_range(k_block, *, block_q, block_k, seq_len, causal, window):
  """Sub-range of `q_block_range` whose tiles the mask keeps whole (the transpose)."""
  lo, hi = q_block_range(k_block, block_q=block_q, block_k=block_k, seq_len=seq_len,
                         causal=causal, window=window)
  first_k = k_block * block_k
  last_k = first_k + block_k - 1
  if causal:
    lo_full = _ceil_div(last_k, block_q)
  elif window is None:
    lo_full = lo
  else:
    lo_full = _ceil_div(last_k - window + 1, block_q)
  hi_full = hi if window is None else (first_k + window) // block_q
  return _clamp_inner(lo_full, hi_full, lo, hi)


def _walk(bounds, full_bounds, step, carry, cfg: KernelConfig):
  """Runs `step(index, carry, masked)` over [lo, hi): masked only on the partial tiles."""
  (lo, hi), (lo_full, hi_full) = bounds, full_bounds
  if not cfg.causal and cfg.window is None:
    return lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(lo, lo_full, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(lo_full, hi_full, functools.partial(step, masked=False), carry)
  return lax.fori_loop(hi_full, hi, functools.partial(step, masked=True), carry)


def _apply_mask(s, q_start, k_start, cfg: KernelConfig):
  """Sets the scores of [block_q, block_k] tile `s` that the mask drops to MASK_VALUE."""
  if not cfg.causal and cfg.window is None:
    return s
  rows = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
  cols = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
  keep = None
  if cfg.causal:
    keep = cols <= rows
  if cfg.window is not None:
    in_window = rows - cols < cfg.window
    if not cfg.causal:
      in_window = in_window & (cols - rows < cfg.window)
    keep = in_window if keep is None else keep & in_window
  return jnp.where(keep, s, MASK_VALUE)


def _dot(a, b, contract_a, contract_b):
  """2-D matmul contracting the given dims, accumulating in float32."""
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _key_block_scores(q, k_ref, v_ref, k_start, q_start, cfg: KernelConfig, masked: bool):
  """Base-2 scaled scores [bq, bk] of a query block against the key block at `k_start`,
  masked where the tile straddles the mask edge; also returns that block's keys and values."""
  k = k_ref[pl.ds(k_start, cfg.block_k), :]
  v = v_ref[pl.ds(k_start, cfg.block_k), :]
  s = _dot(q, k, 1, 1) * (cfg.sm_scale * LOG2E)
  if masked:
    s = _apply_mask(s, q_start, k_start, cfg)
  return s, k, v


def _load_col(ref, rows=None):
  """A float32 statistic as a [rows, 1] column, from a [S] (GPU) or [S, 1] (TPU) ref."""
  if ref.ndim == 2:
    return ref[...] if rows is None else ref[rows, :]
  return (ref[...] if rows is None else ref[rows])[:, None]


def _store_col(ref, col):
  ref[...] = col if ref.ndim == 2 else col.reshape(col.shape[0])


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: KernelConfig, seq_len: int):
  """One query block: online softmax over the key blocks the mask touches."""
  bq, bk = cfg.block_q, cfg.block_k
  iq = pl.program_id(2)
  q = q_ref[...]
  kw = dict(block_q=bq, block_k=bk, seq_len=seq_len, causal=cfg.causal, window=cfg.window)

  def body(jk, carry, masked):
    m, l, acc = carry   # running max [bq, 1], running sum [bq, 1], output [bq, D]; float32
    start = pl.multiple_of(jk * bk, bk)
    s, k, v = _key_block_scores(q, k_ref, v_ref, start, iq * bq, cfg, masked)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + _dot(p.astype(v.dtype), v, 1, 0)
    return m_new, l, acc

  m0 = jnp.full((bq, 1), MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((bq, 1), jnp.float32)
  acc0 = jnp.zeros((bq, q.shape[-1]), jnp.float32)
  m, l, acc = _walk(kv_block_range(iq, **kw), kv_full_range(iq, **kw), body, (m0, l0, acc0),
                    cfg)
  o_ref[...] = (acc / l).astype(o_ref.dtype)
  _store_col(lse_ref, m + jnp.log(l) * LOG2E)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: KernelConfig,
               seq_len: int):
  """dQ for one query block, walking the same key blocks as the forward."""
  bq, bk = cfg.block_q, cfg.block_k
  iq = pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  lse, delta = _load_col(lse_ref), _load_col(delta_ref)
  kw = dict(block_q=bq, block_k=bk, seq_len=seq_len, causal=cfg.causal, window=cfg.window)

  def body(jk, dq, masked):
    start = pl.multiple_of(jk * bk, bk)
    s, k, v = _key_block_scores(q, k_ref, v_ref, start, iq * bq, cfg, masked)
    p = jnp.exp2(s - lse)
    dp = _dot(do, v, 1, 1)
    ds = p * (dp - delta)
    return dq + _dot(ds.astype(k.dtype), k, 1, 0)

  dq = _walk(kv_block_range(iq, **kw), kv_full_range(iq, **kw), body,
             jnp.zeros((bq, q.shape[-1]), jnp.float32), cfg)
  dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                cfg: KernelConfig, seq_len: int):
  """dK and dV for one key block, walking only the query blocks that see it."""
  bq, bk = cfg.block_q, cfg.block_k
  jk = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  kw = dict(block_q=bq, block_k=bk, seq_len=seq_len, causal=cfg.causal, window=cfg.window)

  def body(iq, carry, masked):
    dk, dv = carry
    start = pl.multiple_of(iq * bq, bq)
    q = q_ref[pl.ds(start, bq), :]
    do = do_ref[pl.ds(start, bq), :]
    lse = _load_col(lse_ref, pl.ds(start, bq))
    delta = _load_col(delta_ref, pl.ds(start, bq))
    s = _dot(q, k, 1, 1) * (cfg.sm_scale * LOG2E)
    if masked:
      s = _apply_mask(s, start, jk * bk, cfg)
    p = jnp.exp2(s - lse)
    dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
    dp = _dot(do, v, 1, 1)
    ds = p * (dp - delta)
    dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
    return dk, dv

  zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
  dk, dv = _walk(q_block_range(jk, **kw), q_full_range(jk, **kw), body, (zeros, zeros), cfg)
  dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# Layouts. Triton and the interpreter read [B, S, H, D] in place (strided rows are free for
# them); Mosaic wants the tiled dims last, so the TPU path works on [B, H, S, D].
def _row_spec(cfg, rows, head_dim, seq_blocked):
  """BlockSpec of a [rows, head_dim] tile of a [B, S, H, D] (or [B, H, S, D]) array."""
  sq = pl.squeezed
  if cfg.backend == "mosaic":
    if seq_blocked:
      return pl.BlockSpec((sq, sq, rows, head_dim), lambda b, h, i: (b, h, i, 0))
    return pl.BlockSpec((sq, sq, rows, head_dim), lambda b, h, i: (b, h, 0, 0))
  if seq_blocked:
    return pl.BlockSpec((sq, rows, sq, head_dim), lambda b, h, i: (b, i, h, 0))
  return pl.BlockSpec((sq, rows, sq, head_dim), lambda b, h, i: (b, 0, h, 0))


def _stat_spec(cfg, rows, seq_blocked):
  """BlockSpec of [rows] of a [B, H, S] float32 statistic (lse, delta); [B, H, S, 1] on TPU."""
  sq = pl.squeezed
  if cfg.backend == "mosaic":
    if seq_blocked:
      return pl.BlockSpec((sq, sq, rows, 1), lambda b, h, i: (b, h, i, 0))
    return pl.BlockSpec((sq, sq, rows, 1), lambda b, h, i: (b, h, 0, 0))
  if seq_blocked:
    return pl.BlockSpec((sq, sq, rows), lambda b, h, i: (b, h, i))
  return pl.BlockSpec((sq, sq, rows), lambda b, h, i: (b, h, 0))


def _stat_shape(cfg, batch, heads, seq_len):
  if cfg.backend == "mosaic":
    return (batch, heads, seq_len, 1)
  return (batch, heads, seq_len)


def _call(kernel, cfg: KernelConfig, grid, in_specs, out_specs, out_shape, name):
  """`pl.pallas_call` with the backend's compiler parameters or interpreter."""
  kwargs = {}
  if cfg.backend == "interpret":
    kwargs["interpret"] = cfg.interpret_params
  elif cfg.backend == "triton":
    from jax.experimental.pallas import triton as pl_triton
    kwargs["compiler_params"] = pl_triton.CompilerParams(num_warps=cfg.num_warps,
                                                         num_stages=cfg.num_stages)
  else:
    from jax.experimental.pallas import tpu as pltpu
    kwargs["compiler_params"] = pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel"))
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, name=name, **kwargs)


def _to_kernel_layout(cfg, *xs):
  if cfg.backend == "mosaic":
    return tuple(jnp.swapaxes(x, 1, 2) for x in xs)
  return xs


def _from_kernel_layout(cfg, *xs):
  return _to_kernel_layout(cfg, *xs)


def forward(q, k, v, cfg: KernelConfig):
  """Runs the forward kernel: q, k, v [B, S, H, D] -> (o [B, S, H, D], lse [B, H, S] f32).

  lse is the base-2 log-sum-exp of the scaled scores (log2 of the softmax denominator).
  """
  batch, seq_len, heads, head_dim = q.shape
  grid = (batch, heads, seq_len // cfg.block_q)
  q_spec = _row_spec(cfg, cfg.block_q, head_dim, True)
  kv_spec = _row_spec(cfg, seq_len, head_dim, False)
  kq, kk, kv = _to_kernel_layout(cfg, q, k, v)
  o, lse = _call(
      functools.partial(_fwd_kernel, cfg=cfg, seq_len=seq_len), cfg, grid,
      [q_spec, kv_spec, kv_spec], [q_spec, _stat_spec(cfg, cfg.block_q, True)],
      [out_struct(kq.shape, q.dtype, q),
       out_struct(_stat_shape(cfg, batch, heads, seq_len), jnp.float32, q)],
      "flash_attention_fwd")(kq, kk, kv)
  (o,) = _from_kernel_layout(cfg, o)
  return o, lse


def backward(q, k, v, o, lse, do, cfg: KernelConfig):
  """Runs the two backward kernels; returns (dq, dk, dv), each [B, S, H, D] in input dtype."""
  cfg = dataclasses.replace(cfg, block_q=cfg.bwd_block_q, block_k=cfg.bwd_block_k)
  batch, seq_len, heads, head_dim = q.shape
  # delta_i = sum_d dO_id * O_id = sum_j P_ij dP_ij, the softmax-backward row term.
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
  delta = delta.reshape(lse.shape)
  kq, kk, kv, kdo = _to_kernel_layout(cfg, q, k, v, do)
  q_rows = _row_spec(cfg, cfg.block_q, head_dim, True)
  k_rows = _row_spec(cfg, cfg.block_k, head_dim, True)
  whole = _row_spec(cfg, seq_len, head_dim, False)
  dq = _call(
      functools.partial(_dq_kernel, cfg=cfg, seq_len=seq_len), cfg,
      (batch, heads, seq_len // cfg.block_q),
      [q_rows, whole, whole, q_rows, _stat_spec(cfg, cfg.block_q, True),
       _stat_spec(cfg, cfg.block_q, True)],
      q_rows, out_struct(kq.shape, q.dtype, q),
      "flash_attention_dq")(kq, kk, kv, kdo, lse, delta)
  dk, dv = _call(
      functools.partial(_dkv_kernel, cfg=cfg, seq_len=seq_len), cfg,
      (batch, heads, seq_len // cfg.block_k),
      [whole, k_rows, k_rows, whole, _stat_spec(cfg, seq_len, False),
       _stat_spec(cfg, seq_len, False)],
      [k_rows, k_rows],
      [out_struct(kk.shape, k.dtype, k), out_struct(kv.shape, v.dtype, v)],
      "flash_attention_dkv")(kq, kk, kv, kdo, lse, delta)
  return _from_kernel_layout(cfg, dq, dk, dv)
