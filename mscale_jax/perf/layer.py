"""Cost of one transformer layer (and the head) for one micro-batch on one device, fwd + bwd.

Tensor + sequence parallelism as Megatron-LM does it: between blocks activations are sharded
on the sequence, so the block all-gathers before its column-parallel GEMMs and reduce-scatters
after its row-parallel ones, forward and backward.
"""
import dataclasses

from mscale_jax.perf import comm, compute
from mscale_jax.perf.constants import Constants
from mscale_jax.perf.hardware import Hardware
from mscale_jax.perf.workload import Layout, ModelSpec, Techniques

# TP collectives per layer (forward, backward). Sequential block: forward all-gathers before
# QKV and FFN-in and reduce-scatters after attention-out and FFN-out (4); backward mirrors them
# (4) and re-gathers the two sequence-sharded inputs for the weight gradients (2). The parallel
# block feeds both branches from one gather and sums them before one scatter: half of each.
TP_COLLECTIVES = {"sequential": (4, 6), "parallel": (2, 3)}


@dataclasses.dataclass(frozen=True)
class Cost:
  """Seconds, forward + backward, by kind. `total` is what the critical path sees.

  `forward` and `weight_grad` say how much of `total` is the (first) forward pass and the
  weight-gradient GEMMs: the split a zero-bubble schedule needs (F, B = the rest, W).
  """
  gemm: float = 0.0
  attention: float = 0.0
  memory_bound: float = 0.0
  tp_exposed: float = 0.0
  forward: float = 0.0       # of total: the forward pass
  weight_grad: float = 0.0   # of total: the weight-gradient GEMMs (W)

  @property
  def total(self) -> float:
    """Seconds on the critical path."""
    return self.gemm + self.attention + self.memory_bound + self.tp_exposed

  @property
  def passes(self) -> tuple[float, float, float]:
    """(F, B, W) seconds: forward, input gradient (with any recomputation), weight gradient."""
    return self.forward, self.total - self.forward - self.weight_grad, self.weight_grad

  def __add__(self, other):
    """Term-by-term sum."""
    return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

  def scale(self, k: float):
    """Every term times `k` (e.g. the layers of a stage)."""
    return Cost(*(k * a for a in dataclasses.astuple(self)))


def _linear(m, k, n, chunks, peak, c):
  """(forward, input-gradient, weight-gradient) seconds of a linear layer whose token dim is
  cut into `chunks`."""
  fwd = compute.gemm_time(m / chunks, k, n, peak, c, count=chunks)
  dgrad = compute.gemm_time(m / chunks, n, k, peak, c, count=chunks)
  wgrad = compute.gemm_time(k, m / chunks, n, peak, c, count=chunks)
  return fwd, dgrad, wgrad


def tp_collective_time(model: ModelSpec, layout: Layout, hw: Hardware, c: Constants) -> float:
  """One all-gather (or reduce-scatter) of a micro-batch's [tokens, hidden] bf16 activations."""
  if layout.tp == 1:
    return 0.0
  num_bytes = layout.micro_batch * model.seq_len * model.hidden * 2.0
  return comm.all_gather_time(num_bytes, layout.tp, comm.group_link(hw, layout.tp, 1, c))


def tp_exposure(comm_s: float, overlappable_gemm_s: float, chunks: int, overlap: bool,
                share: float) -> float:
  """Exposed seconds of `comm_s` of TP communication.

  Without overlap all of it. With chunked overlap the first chunk's transfer cannot be hidden,
  the rest hides behind the GEMM chunks (any excess stays exposed), and while hidden it slows
  the GEMMs by the `share` of SMs the collective occupies (comm.sm_share).
  """
  if not overlap or chunks <= 1:
    return comm_s
  first = comm_s / chunks
  rest = comm_s - first
  return first + max(0.0, rest - overlappable_gemm_s) + share * min(rest, overlappable_gemm_s)


def overlap_chunks(layout: Layout, tech: Techniques) -> list:
  """Chunk counts a TP-overlap implementation can pick: the divisors of tp (1: no overlap).

  Smaller chunks hide more communication but run less efficient GEMMs; an implementation tunes
  the count, so the model takes whichever is fastest and overlap is never slower than none.
  """
  if not tech.tp_overlap or layout.tp == 1:
    return [1]
  return [d for d in range(1, layout.tp + 1) if layout.tp % d == 0]


def layer_cost(model: ModelSpec, layout: Layout, tech: Techniques, recompute: str,
               hw: Hardware, c: Constants, dtype: str = "bfloat16") -> Cost:
  """Forward + backward cost of one transformer layer for one micro-batch."""
  return min((_layer_cost(model, layout, tech, recompute, hw, c, dtype, k)
              for k in overlap_chunks(layout, tech)), key=lambda cost: cost.total)


def _layer_cost(model, layout, tech, recompute, hw, c, dtype, chunks):
  peak, t = hw.peak(dtype), layout.tp
  h, f = model.hidden, model.ffn_mult * model.hidden
  tokens = layout.micro_batch * model.seq_len
  overlap = chunks > 1
  if tech.parallel_block:
    shapes = [(h, (3 * h + f) // t), ((h + f) // t, h)]
  else:
    shapes = [(h, 3 * h // t), (h // t, h), (h, f // t), (f // t, h)]
  gemm_f = gemm_b = gemm_w = 0.0
  for k, n in shapes:
    fwd, dgrad, wgrad = _linear(tokens, k, n, chunks, peak, c)
    gemm_f, gemm_b, gemm_w = gemm_f + fwd, gemm_b + dgrad + wgrad, gemm_w + wgrad

  heads = model.num_heads // t
  if tech.efficient_ops:
    attn_f, attn_b = compute.flash_attention_time(tokens, model.seq_len, heads, model.head_dim,
                                                  tech.sliding_window, peak, c)
  else:
    attn_f, attn_b = compute.unfused_attention_time(
        tokens, model.seq_len, heads, model.head_dim, tech.sliding_window, peak, hw.hbm_bw, c,
        recompute=recompute == "selective")

  act_bytes = tokens * h * 2.0 / t            # sequence-parallel shard, bf16
  ffn_bytes = tokens * f * 2.0 / t
  norms = 1 if tech.parallel_block else 2
  ln = c.layernorm_passes_fused if tech.efficient_ops else c.layernorm_passes_unfused
  gelu = c.gelu_passes_fused if tech.efficient_ops else c.gelu_passes_unfused
  mem_f = mem_b = 0.0
  for tensor, passes, count in ((act_bytes, ln, norms), (ffn_bytes, gelu, 1),
                                (act_bytes, c.residual_passes, norms)):
    fwd, bwd = compute.elementwise_time(tensor, passes, hw.hbm_bw, c)
    mem_f, mem_b = mem_f + count * fwd, mem_b + count * bwd

  n_fwd, n_bwd = TP_COLLECTIVES["parallel" if tech.parallel_block else "sequential"]
  coll, share = tp_collective_time(model, layout, hw, c), comm.sm_share(hw, c)
  tp_f = tp_exposure(coll * n_fwd, gemm_f, chunks, overlap, share)
  tp_b = tp_exposure(coll * n_bwd, gemm_b, chunks, overlap, share)

  forward = gemm_f + attn_f + mem_f + tp_f
  cost = Cost(gemm_f + gemm_b, attn_f + attn_b, mem_f + mem_b, tp_f + tp_b, forward, gemm_w)
  if recompute == "full":     # the forward again, before the input gradient (part of B)
    cost = cost + Cost(gemm_f, attn_f, mem_f, tp_f)
  return cost


def head_cost(model: ModelSpec, layout: Layout, tech: Techniques, hw: Hardware, c: Constants,
              dtype: str = "bfloat16") -> Cost:
  """Extra work of the last stage: final LayerNorm, vocab-parallel LM head, cross-entropy."""
  return min((_head_cost(model, layout, tech, hw, c, dtype, k)
              for k in overlap_chunks(layout, tech)), key=lambda cost: cost.total)


def _head_cost(model, layout, tech, hw, c, dtype, chunks):
  peak, t = hw.peak(dtype), layout.tp
  tokens = layout.micro_batch * model.seq_len
  overlap = chunks > 1
  fwd, dgrad, wgrad = _linear(tokens, model.hidden, model.vocab // t, chunks, peak, c)
  bwd = dgrad + wgrad
  ln = c.layernorm_passes_fused if tech.efficient_ops else c.layernorm_passes_unfused
  ln_f, ln_b = compute.elementwise_time(tokens * model.hidden * 2.0 / t, ln, hw.hbm_bw, c)
  # Vocab-parallel cross-entropy on fp32 logits: max, exp-sum, loss forward; softmax-grad back.
  logits = tokens * model.vocab / t * 4.0
  xent = compute.memory_time(logits * 5, hw.hbm_bw, c, kernels=4)
  coll, share = tp_collective_time(model, layout, hw, c), comm.sm_share(hw, c)
  tp = (tp_exposure(coll, fwd, chunks, overlap, share)
        + tp_exposure(coll, bwd, chunks, overlap, share))
  tp_f = tp_exposure(coll, fwd, chunks, overlap, share)
  return Cost(gemm=fwd + bwd, memory_bound=ln_f + ln_b + xent, tp_exposed=tp,
              forward=fwd + ln_f + tp_f + 0.6 * xent, weight_grad=wgrad)   # 3 of 5 passes
