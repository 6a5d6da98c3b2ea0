"""What a schedule table costs in time: the passes' durations and the asynchronous timeline.

The tick grid (`schedule.Table`) gives every action one tick, which is what the lock-step
executor needs. In time a chunk's passes differ: counting matmul FLOPs, the backward does two
matmuls per forward matmul (the input gradient, B, and the weight gradient, W: one forward's
worth each), and full activation recomputation runs the forward again before B. So, in units
of one chunk's forward:

  recompute   F   B (input grad)   W (weight grad)   whole backward
  none        1   1                1                 2
  full        1   2                1                 3

(The issue measured ~2.7x for the recomputing backward on CPU; give measured costs where you
have them.) Pure Python.
"""
import dataclasses
import functools

from mscale_jax.errors import ConfigError
from mscale_jax.parallel.schedule_graph import BACKWARD, FORWARD, WEIGHT

RECOMPUTES = ("full", "none")
UNIT = {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}


def pass_costs(recompute: str, forward: float = 1.0) -> dict:
  """{F, B, W: time} of one chunk's passes for `recompute` (module table), given the time of
  its forward. Raises ConfigError for an unknown `recompute`."""
  if recompute not in RECOMPUTES:
    raise ConfigError("recompute", recompute, f"one of {', '.join(RECOMPUTES)}")
  backward_input = 2.0 * forward if recompute == "full" else forward
  return {FORWARD: forward, BACKWARD: backward_input, WEIGHT: forward}


def action_durations(costs: dict, split: bool) -> dict:
  """Duration of each action kind of a table: with a split backward B and W as given, without
  one the table's B is the whole backward (B + W). Durations must be positive."""
  durations = dict(costs) if split else {FORWARD: costs[FORWARD],
                                         BACKWARD: costs[BACKWARD] + costs[WEIGHT],
                                         WEIGHT: costs[WEIGHT]}
  kinds = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
  for kind in kinds:
    if not durations[kind] > 0:
      raise ConfigError(f"costs[{kind!r}]", durations[kind], "a positive time")
  return durations


@dataclasses.dataclass(frozen=True)
class Timeline:
  """Start times of a table's actions under real durations (`Table.timeline`)."""
  table: object      # the schedule.Table
  durations: dict    # action kind -> time
  starts: tuple      # [stages][actions per stage], in the order of table.orders

  @property
  def busy(self) -> float:
    """Compute time of a stage (the same on every stage)."""
    return sum(self.durations[a.kind] for a in self.table.orders[0])

  @functools.cached_property
  def makespan(self) -> float:
    """Time from the first action's start to the last one's end."""
    return max(st[-1] + self.durations[o[-1].kind]
               for st, o in zip(self.starts, self.table.orders))

  @property
  def bubble(self) -> float:
    """Time each stage idles: the makespan minus its compute."""
    return self.makespan - self.busy

  @property
  def bubble_fraction(self) -> float:
    """Idle time over compute time of a stage."""
    return self.bubble / self.busy

  def ends(self, stage: int) -> tuple:
    """End times of stage `stage`'s actions, in its order."""
    return tuple(t + self.durations[a.kind]
                 for t, a in zip(self.starts[stage], self.table.orders[stage]))
