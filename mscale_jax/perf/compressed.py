"""Two-level data-parallel collectives, with SDP4Bit's quantization or without.

`dp_times_two_level` replaces `iteration.dp_times` when `Techniques.dp_compression` is set. It
sees the data-parallel group as g ranks in each of k nodes (g = the group's ranks per node):

* gradients: a reduction inside each node over the intra-node links, then one across the nodes
  on 1/g of the gradients, each rank's share of the node's NICs carrying it (SDP4Bit's TLq-HS:
  two all-to-alls at `grad_bits_intra` and `grad_bits_inter` bits);
* parameters: the all-gather, whose inter-node part each node receives once (qWD at
  `weight_bits`);
* codes below 16 bits carry a 32-bit scale per group, and quantizing, dequantizing and summing
  (and the Hadamard transform) stream the buffers through HBM once each, as the paper's fused
  kernels do. `DPCompression.uncompressed()` is the same two-level schedule at bf16 weights and
  fp32 gradients with no quantization: the quantization's own baseline. NCCL's ring (`none`,
  `comm.ring_link`) equals it with one data-parallel rank per node; with several the ring
  pipelines its two links and wins unless few nodes and a slow network make the two-level
  schedule's smaller share across nodes, (k-1)/k of the buffer against (n-1)/n, count more.

The two gradient levels run one after the other (the official code's
`--gradient-alltoall-pipeline 1`, its default and the authors' speed-test setting; the README's
example pipelines 8 chunks to overlap them, which this model does not).

A step of n values of b bits among P ranks moves (P - 1) / P * n * b / 8 bytes per rank on its
tier (ring or direct all-to-all alike).
"""
import dataclasses

from mscale_jax.config import SDP4BitConfig
from mscale_jax.perf import comm, compute
from mscale_jax.perf.constants import Constants
from mscale_jax.perf.hardware import Hardware

_SDP4BIT = SDP4BitConfig()      # the one set of SDP4Bit defaults (and their sources)


@dataclasses.dataclass(frozen=True)
class DPCompression:
  """Bit widths and group sizes of the data-parallel collectives.

  Defaults: `config.SDP4BitConfig`'s, the paper's. Bits 16 and 32 are not quantized.
  """
  weight_bits: int = _SDP4BIT.weight_bits
  weight_group: int = _SDP4BIT.weight_group
  grad_bits_intra: int = _SDP4BIT.grad_bits_intra
  grad_bits_inter: int = _SDP4BIT.grad_bits_inter
  grad_group: int = _SDP4BIT.grad_group
  hadamard: bool = _SDP4BIT.hadamard

  @classmethod
  def uncompressed(cls) -> "DPCompression":
    """bf16 weights, fp32 gradients: the same two-level schedule without quantization."""
    return cls(weight_bits=16, grad_bits_intra=32, grad_bits_inter=32, hadamard=False)

  @classmethod
  def from_config(cls, cfg: SDP4BitConfig) -> "DPCompression":
    """What a training run with `optimizer.sdp4bit = cfg` sends: exact weights (weights='none')
    go as bf16, exact gradients (gradients=False) as fp32, as `uncompressed()`."""
    exact = cls.uncompressed()
    weights = cfg.weights != "none"
    return cls(weight_bits=cfg.weight_bits if weights else exact.weight_bits,
               weight_group=cfg.weight_group,
               grad_bits_intra=cfg.grad_bits_intra if cfg.gradients else exact.grad_bits_intra,
               grad_bits_inter=cfg.grad_bits_inter if cfg.gradients else exact.grad_bits_inter,
               grad_group=cfg.grad_group, hadamard=cfg.hadamard and cfg.gradients)


def bytes_per_value(bits: int, group: int) -> float:
  """Wire bytes per value: the code plus its share of the group's float32 scale (< 16 bits)."""
  return bits / 8.0 if bits >= 16 else (bits + 32.0 / group) / 8.0


def _step(num_bytes: float, ranks: int, link: comm.Link) -> float:
  if ranks <= 1:
    return 0.0
  return (ranks - 1) * link.latency_s + (ranks - 1) / ranks * num_bytes / link.bw


def _coding(values: float, wire_bytes: float, full_bytes: float, passes: int, hw: Hardware,
            c: Constants) -> float:
  """HBM time to encode `values` (read full precision, write codes) and decode them back."""
  return compute.memory_time(passes * values * full_bytes + 2 * wire_bytes, hw.hbm_bw, c,
                             kernels=2)


def dp_times_two_level(n: float, dp: int, tp: int, comp: DPCompression, hw: Hardware,
                       c: Constants) -> tuple[float, float]:
  """(gradient reduction, parameter all-gather) seconds for `n` parameters per device."""
  if dp <= 1:
    return 0.0, 0.0
  g = comm.ranks_per_node(hw, dp, tp)
  k = dp // g
  intra = comm.group_link(hw, g, tp, c)
  inter = comm.group_link(hw, k, tp * g, c)

  wire = n * bytes_per_value(comp.grad_bits_intra, comp.grad_group)
  rs = _step(wire, g, intra)
  if g > 1 and comp.grad_bits_intra < 16:
    rs += _coding(n, wire, c.grad_reduce_bytes, 1, hw, c)
  wire = n / g * bytes_per_value(comp.grad_bits_inter, comp.grad_group)
  rs += _step(wire, k, inter)
  if k > 1 and comp.grad_bits_inter < 16:
    rs += _coding(n / g, wire, c.grad_reduce_bytes, 2 if comp.hadamard else 1, hw, c)

  # All-gather: each node receives the other nodes' (k - 1) / k of the weights once, spread
  # over its g ranks' NIC shares, then the ranks share them over the intra-node links.
  wire = n * bytes_per_value(comp.weight_bits, comp.weight_group)
  ag = _step(wire / g, k, inter) + _step(wire, g, intra)
  if comp.weight_bits < 16:
    # Difference against the reference and quantize the own shard; decode and add them all.
    ag += _coding(n, wire, c.param_bytes, 2, hw, c)
  return rs, ag
