"""Closed forms for periodic checkpointing under exponential failures.

Young (1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9)):
the interval of work between checkpoints that minimises lost time is sqrt(2 * delta * M), for a
checkpoint that stops work for delta seconds and a mean time between failures M.

Daly (2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 22(3)): with failures arriving as a Poisson process at rate 1/M at any time (during work,
checkpoints and restarts alike), a failure costing a restart of R seconds after which the
segment since the last checkpoint is redone, the expected wall time per segment of tau seconds
of work is M * exp(R/M) * (exp((tau + delta)/M) - 1); his higher-order optimum is
sqrt(2 delta M) * (1 + sqrt(delta/(2M))/3 + delta/(18 M)) - delta for delta < 2M (else M).

The simulator (`simulate.py`) reduces to Daly's model when every recovery cost is fixed, a
checkpoint is durable when its stall ends and nothing else costs time; `tests/test_goodput_sim.py`
checks it against `expected_rate` there.
"""
import math


def young_interval(stall_s: float, mtbf_s: float) -> float:
  """Young's first-order optimum interval of work between checkpoints (seconds)."""
  return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval(stall_s: float, mtbf_s: float) -> float:
  """Daly's higher-order optimum interval of work between checkpoints (seconds)."""
  if stall_s >= 2.0 * mtbf_s:
    return mtbf_s
  x = stall_s / (2.0 * mtbf_s)
  return math.sqrt(2.0 * stall_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall_s


def expected_rate(interval_s: float, stall_s: float, restart_s: float, mtbf_s: float) -> float:
  """Work per wall second in Daly's model: interval / expected wall time per segment."""
  if math.isinf(mtbf_s):
    return interval_s / (interval_s + stall_s)
  segment = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + stall_s) / mtbf_s)
  return interval_s / segment
