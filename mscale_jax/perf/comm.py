"""Collective and point-to-point times: latency plus size over the bandwidth of the tier crossed.

A group is `size` ranks `stride` apart in the global rank order. If all of it sits inside one node
it uses the intra-node links (NVLink); otherwise each rank's share of the node's NICs, on the
innermost network tier that reaches the whole group, derated by ECMP collisions on each tier
above the first (`scale.tier_bandwidth_share`). Sizes are the full (gathered) buffer.
"""
import dataclasses
import math

from mscale_jax.perf.constants import Constants
from mscale_jax.perf.hardware import Hardware
from mscale_jax.perf.scale import tier_bandwidth_share


@dataclasses.dataclass(frozen=True)
class Link:
  """Achieved bandwidth (bytes/s per rank per direction) and per-step latency of a group."""
  bw: float
  latency_s: float
  tier: str


def group_link(hw: Hardware, size: int, stride: int, c: Constants) -> Link:
  """The link a group of `size` ranks, `stride` apart, communicates over."""
  span = (size - 1) * stride + 1
  tier = hw.tier_for_span(span)
  if tier is None:
    return Link(hw.intra_node_bw * c.nvlink_eff, hw.intra_node_latency_s, "node")
  share = tier_bandwidth_share(hw, tier.name, c)
  return Link(hw.net_bw_per_device * c.net_eff * share, tier.latency_s, tier.name)


def ranks_per_node(hw: Hardware, size: int, stride: int) -> int:
  """How many ranks of a group of `size` ranks, `stride` apart, share a node: at least 1, and
  exact where the stride divides the node and the group fills whole nodes, as data-parallel
  groups (stride = tensor-parallel size) do."""
  return max(1, min(size, hw.devices_per_node // stride))


def ring_link(hw: Hardware, size: int, stride: int, c: Constants) -> Link:
  """The link a ring all-gather or reduce-scatter over the group behaves as: its bus bandwidth.

  NCCL runs these collectives as rings, one per channel, each cutting the buffer into `size`
  chunks and moving one chunk per step over every edge of the ring at once: `size - 1` steps,
  each as slow as the ring's busiest link (nccl-tests doc/PERFORMANCE.md: the bus bandwidth,
  algorithm bandwidth x (n-1)/n, is the bottleneck link's). With g = `ranks_per_node` ranks of
  the group in each of several nodes, NCCL orders every ring node by node: it enters a node
  once, visits its g ranks over NVLink and leaves once, each channel through its own NIC. So in
  one step of a B-byte collective
    * a node's NICs carry B / n out (and in): one chunk per channel; the group owns the NIC
      share of its g devices, g x `net_bw_per_device` at `net_eff`, derated for ECMP on the tier
      like every network link (`group_link`);
    * a device's NVLink carries (g - 1) / g x B / n: g - 1 of a node's g edges per channel are
      intra-node, at `intra_node_bw` x `nvlink_eff`.
  The ring's bus bandwidth is the slower of the two per byte of chunk:
    min(g x nic_share, nvlink x g / (g - 1)),
  so the pipelined ring pays only its bottleneck, not the sum of an intra-node and an inter-node
  phase as a two-level schedule run one level after the other does (`compressed.py`). The
  step latency stays the network tier's. With one rank per node (tensor parallelism filling
  it: every MegaScale row) every edge is a NIC edge and this is `group_link` itself; a group
  inside one node rings over NVLink alone, also `group_link`.

  On H800 nodes (NVLink 200 GB/s per direction, 8 x 400 Gb/s NICs) at TP=1 (g = 8):
  min(8 x 50 x 0.78, 200 x 0.82 x 8/7) = min(312, 187) GB/s, NVLink-bound, against the 39 GB/s
  of one NIC share a ring with every hop across the network would get. The efficiencies are
  `constants.py`'s (nccl-tests on DGX A100); 200 x 0.82 = 164 GB/s of NVLink matches what
  DeepSeek-V3's report (arXiv 2412.19437, section 3.2.2) says H800's NVLink reaches, 160 GB/s.
  """
  link = group_link(hw, size, stride, c)
  g = ranks_per_node(hw, size, stride)
  if link.tier == "node" or g == 1:
    return link
  nvlink = group_link(hw, g, stride, c).bw       # the group's g ranks in one node
  return Link(min(g * link.bw, nvlink * g / (g - 1)), link.latency_s, link.tier)


def sm_share(hw: Hardware, c: Constants) -> float:
  """Fraction of the device's compute units a running collective takes from overlapped work."""
  return min(1.0, c.comm_sms / hw.num_sms)


def all_gather_time(num_bytes: float, size: int, link: Link) -> float:
  """Ring all-gather of a `num_bytes` result: n-1 steps, each moving 1/n of it."""
  if size <= 1:
    return 0.0
  return (size - 1) * link.latency_s + (size - 1) / size * num_bytes / link.bw


def reduce_scatter_time(num_bytes: float, size: int, link: Link) -> float:
  """Ring reduce-scatter of a `num_bytes` input: the mirror image of the all-gather."""
  return all_gather_time(num_bytes, size, link)


def all_reduce_time(num_bytes: float, size: int, link: Link) -> float:
  """All-reduce as NCCL would pick: ring (bandwidth-optimal) or double binary tree (latency)."""
  if size <= 1:
    return 0.0
  ring = 2 * (size - 1) * link.latency_s + 2 * (size - 1) / size * num_bytes / link.bw
  tree = 2 * math.ceil(math.log2(size)) * link.latency_s + num_bytes / link.bw
  # The tree pipelines the reduce and the broadcast but each rank still sends and receives the
  # whole buffer on its busiest link; it wins only where latency dominates.
  tree += num_bytes / link.bw
  return min(ring, tree)


def send_recv_time(num_bytes: float, link: Link, efficiency: float = 1.0,
                   latency_s: float | None = None) -> float:
  """One point-to-point transfer at `efficiency` of the link's collective bandwidth."""
  lat = link.latency_s if latency_s is None else latency_s
  return lat + num_bytes / (link.bw * efficiency)
