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
