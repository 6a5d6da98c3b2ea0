"""Costs that grow with the number of ranks: stragglers, slow machines, ECMP collisions, skew.

A synchronous step ends when its last rank does, so a job of N ranks pays the expected maximum
of N random delays, which grows with N even when each rank's own distribution does not. Each
mechanism is switched on in `Constants` (`stragglers`, `slow_nodes`, `ecmp_collisions`,
`launch_skew`) and is exactly zero when off; the constants' sources and ranges are in
docs/perf_model.md. Pure Python, deterministic (expectations in closed form, no sampling).
"""
import functools
import math
import statistics

from mscale_jax.perf.constants import Constants
from mscale_jax.perf.hardware import Hardware


@functools.lru_cache(maxsize=1024)
def expected_max_std_normal(n: int) -> float:
  """E[max of n independent standard normals], Blom's approximation (0 for n = 1).

  Phi^-1((n - 0.375) / (n + 0.25)): 4% high at n = 2, within 0.5% for n >= 100; it
  grows like sqrt(2 ln n), so the slowest of 12,288 ranks is ~3.9 sigma late, of 256 ~2.8.
  """
  if n <= 1:
    return 0.0
  return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


@functools.lru_cache(maxsize=1024)
def harmonic(n: int) -> float:
  """H_n = 1 + 1/2 + ... + 1/n: the expected maximum of n unit-mean exponential delays."""
  if n < 1:
    return 0.0
  if n < 1000:
    return sum(1.0 / k for k in range(1, n + 1))
  return math.log(n) + 0.5772156649015329 + 1.0 / (2 * n) - 1.0 / (12 * n * n)


def straggler_stretch(devices: int, hw: Hardware, c: Constants) -> float:
  """Fraction by which the synchronous pipeline time grows waiting for its slowest rank.

  Jitter (`stragglers`): every GPU's step time varies with coefficient of variation
  `gpu_time_cv` (clock, power and thermal variation, interrupts); the step waits for the
  expected slowest of `devices`. Slow machines (`slow_nodes`): a fraction `slow_node_fraction`
  of servers runs `slow_node_slowdown` slower; the chance that at least one of the job's
  servers is slow is 1 - (1 - f)^servers. The two add (a slow server's lateness on top of the
  jitter tail), an upper bound on the larger of the two.
  """
  stretch = 0.0
  if c.stragglers:
    stretch += c.gpu_time_cv * expected_max_std_normal(devices)
  if c.slow_nodes:
    servers = max(1, math.ceil(devices / hw.devices_per_node))
    stretch += c.slow_node_slowdown * (1.0 - (1.0 - c.slow_node_fraction) ** servers)
  return stretch


def launch_skew_s(devices: int, dp: int, c: Constants) -> float:
  """Seconds the exposed data-parallel collectives wait for their latest rank to launch them.

  Paper section 6.3: host-side work (garbage collection, stray CPU ops) made ranks launch the
  gradient reduce-scatter at different times, and the collective waits for the last one. With
  each rank's launch delay exponential with mean `launch_delay_s`, the last of N is H_N times
  the mean; the skew is what that adds over one rank's own delay, (H_N - 1) * mean, paid at
  each of the `dp_sync_points` collectives per step that sit on the critical path. N is every
  rank: the step (and the next one's pipeline) waits for all data-parallel groups.
  """
  if not c.launch_skew or dp <= 1:
    return 0.0
  return c.dp_sync_points * c.launch_delay_s * (harmonic(devices) - 1.0)


@functools.lru_cache(maxsize=64)
def _slowest_flow_share(flows: int, uplinks: int, speedup: float) -> float:
  """E[min(1, speedup / max load)] for `flows` balls hashed uniformly into `uplinks` bins."""
  if flows <= 1:
    return 1.0
  # P(max load <= cap) = flows! / uplinks^flows * [x^flows] (sum_{j<=cap} x^j / j!)^uplinks.
  def p_max_at_most(cap):
    base = [1.0 / math.factorial(j) for j in range(min(cap, flows) + 1)]
    poly = [1.0]
    for _ in range(uplinks):
      out = [0.0] * min(len(poly) + len(base) - 1, flows + 1)
      for i, a in enumerate(poly):
        for j, b in enumerate(base):
          if i + j <= flows:
            out[i + j] += a * b
      poly = out
    coef = poly[flows] if len(poly) > flows else 0.0
    return math.exp(math.lgamma(flows + 1) - flows * math.log(uplinks)) * coef
  share, below = 0.0, 0.0
  for cap in range(1, flows + 1):
    at_most = min(1.0, p_max_at_most(cap))
    share += (at_most - below) * min(1.0, speedup / cap)
    below = at_most
    if below > 1.0 - 1e-12:
      break
  return share


def ecmp_share(c: Constants) -> float:
  """Bandwidth fraction a synchronous ring keeps on one switch tier above the ToR.

  ECMP hashes each flow onto one of `ecmp_uplinks` uplinks; flows that land on the same uplink
  share it, and a ring moves at the pace of its slowest flow. With `ecmp_flows` concurrent
  flows leaving a switch and uplinks `ecmp_uplink_speedup` times a flow's rate (MegaScale
  splits each 400G downlink into two 200G ports, so 2), this is the expected share of the
  slowest flow, exact for uniform hashing.
  """
  if not c.ecmp_collisions:
    return 1.0
  return _slowest_flow_share(int(round(c.ecmp_flows)), c.ecmp_uplinks, c.ecmp_uplink_speedup)


def tier_bandwidth_share(hw: Hardware, tier_name: str, c: Constants) -> float:
  """ECMP share compounded over the tiers above the innermost one that a group crosses."""
  names = [t.name for t in hw.tiers]
  above = names.index(tier_name) if tier_name in names else 0
  return ecmp_share(c) ** above
