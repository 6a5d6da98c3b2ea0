"""Time of on-device work: GEMMs (shape-dependent efficiency), attention, memory-bound kernels."""
from mscale_jax.perf.constants import Constants


def gemm_efficiency(m: int, k: int, n: int, c: Constants) -> float:
  """Achieved fraction of peak for an (m x k) @ (k x n) GEMM; see Constants.gemm_edge."""
  return c.gemm_eff_max / (1.0 + c.gemm_edge * (1.0 / m + 1.0 / k + 1.0 / n))


def gemm_time(m: int, k: int, n: int, peak: float, c: Constants, count: int = 1) -> float:
  """Seconds for `count` GEMMs of shape (m,k,n) at the modelled efficiency."""
  return count * 2.0 * m * k * n / (peak * gemm_efficiency(m, k, n, c))


def gemm_fwd_bwd_time(m: int, k: int, n: int, peak: float, c: Constants) -> tuple:
  """(forward, backward) seconds of a linear layer: backward is dgrad (m,n,k) + wgrad (k,m,n)."""
  return (gemm_time(m, k, n, peak, c),
          gemm_time(m, n, k, peak, c) + gemm_time(k, m, n, peak, c))


def attention_pairs(seq: int, window: int | None, causal_skip: bool) -> float:
  """(query, key) pairs computed per head and sequence.

  Flash attention skips blocks above the diagonal (causal_skip) and outside the window; the
  unfused path computes the full s x s score matrix and masks it, or, with a window, the band
  of width w (a blocked banded implementation).
  """
  w = seq if window is None else min(window, seq)
  if causal_skip:
    return seq * w - w * (w - 1) / 2.0
  return float(seq * w)


def flash_attention_time(tokens: int, seq: int, heads: int, head_dim: int,
                         window: int | None, peak: float, c: Constants) -> tuple:
  """(forward, backward) seconds of flash attention over `tokens` (= micro-batch * seq)."""
  pairs = attention_pairs(seq, window, causal_skip=True) * (tokens / seq) * heads
  fwd_flops = 4.0 * pairs * head_dim
  rate = peak * c.flash_attn_eff
  return fwd_flops / rate, 2.5 * fwd_flops / rate


def unfused_attention_time(tokens: int, seq: int, heads: int, head_dim: int,
                           window: int | None, peak: float, hbm_bw: float, c: Constants,
                           recompute: bool) -> tuple:
  """(forward, backward) seconds of attention with materialised scores (Megatron-LM core).

  Two batched GEMMs forward (QK^T, PV) and four backward, plus the softmax passes over the
  bf16 score tensor; with selective recomputation the backward first redoes the forward.
  """
  batch_heads = (tokens // seq) * heads
  w = seq if window is None else min(window, seq)
  one = gemm_time(seq, head_dim, w, peak, c, count=batch_heads)   # QK^T or PV (same FLOPs)
  score_bytes = attention_pairs(seq, window, causal_skip=False) * batch_heads * 2.0
  f_pass, b_pass = c.softmax_passes
  fwd = 2 * one + memory_time(score_bytes * f_pass, hbm_bw, c, kernels=1)
  bwd = 4 * one + memory_time(score_bytes * b_pass, hbm_bw, c, kernels=1)
  if recompute:
    bwd += fwd
  return fwd, bwd


def memory_time(num_bytes: float, hbm_bw: float, c: Constants, kernels: int = 1) -> float:
  """Seconds to stream `num_bytes` through HBM in `kernels` launches."""
  return num_bytes / (hbm_bw * c.hbm_eff) + kernels * c.kernel_gap_s


def elementwise_time(tensor_bytes: float, passes: tuple, hbm_bw: float, c: Constants) -> tuple:
  """(forward, backward) seconds of an elementwise operator making `passes` over a tensor.

  One kernel per two passes (each eager op reads one tensor and writes one).
  """
  f, b = passes
  return (memory_time(tensor_bytes * f, hbm_bw, c, kernels=max(1, f // 2)),
          memory_time(tensor_bytes * b, hbm_bw, c, kernels=max(1, b // 2)))
