"""What a schedule table costs in time: the passes' durations and the asynchronous timeline.

The tick grid (`schedule.Table`) gives every action one tick, which is what the lock-step
executor needs. In time a chunk's passes differ: counting matmul FLOPs, the backward does two
matmuls per forward matmul (the input gradient, B, and the weight gradient, W: one forward's
worth each), and full activation recomputation runs the forward again before B. So, in units
of one chunk's forward:

  recompute   F   B (input grad)   W (weight grad)   whole backward
  none        1   1                1                 2
  selective   1   1 + a            1                 2 + a
  full        1   2                1                 3

where a is attention's core (QK^T, softmax, PV) as a share of the forward, which selective
recomputation (Korthikanti et al., 2022) runs again before B (`attention_core_share`).

(The issue measured ~2.7x for the recomputing backward on CPU; give measured costs where you
have them.) Pure Python.
"""
import dataclasses
import functools

from mscale_jax.errors import ConfigError
from mscale_jax.parallel.schedule_graph import BACKWARD, FORWARD, WEIGHT

RECOMPUTES = ("full", "selective", "none")
UNIT = {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}


def attention_core_share(hidden: int, seq_len: int, mlp_dim: int | None = None,
                         gates: int = 1) -> float:
  """Attention's core (QK^T and PV over the full causal matrix) as a share of a layer's
  forward matmul FLOPs, counted as `flops.model_flops_per_token` counts them: per token
  4 s h of 8 h^2 + 2 (gates + 1) h F + 4 s h (F = mlp_dim, default 4h; gates=2 for SwiGLU).
  With F = 4h this is s / (6h + s)."""
  f = 4 * hidden if mlp_dim is None else mlp_dim
  core = 4.0 * seq_len * hidden
  return core / (2.0 * (4 * hidden * hidden + (gates + 1) * hidden * f) + core)


# The paper's GPT-3 175B at seq 2048: the default share for 'selective' (2.7%).
ATTENTION_CORE_175B = attention_core_share(12288, 2048)


def pass_costs(recompute: str, forward: float = 1.0,
               attention_core: float = ATTENTION_CORE_175B) -> dict:
  """{F, B, W: time} of one chunk's passes for `recompute` (module table), given the time of
  its forward and, for 'selective', attention's core share of it (`attention_core_share`).
  Raises ConfigError for an unknown `recompute` or a share outside [0, 1)."""
  if recompute not in RECOMPUTES:
    raise ConfigError("recompute", recompute, f"one of {', '.join(RECOMPUTES)}")
  if not 0.0 <= attention_core < 1.0:
    raise ConfigError("attention_core", attention_core, "a share of the forward in [0, 1)")
  again = {"full": 1.0, "selective": attention_core, "none": 0.0}[recompute]
  return {FORWARD: forward, BACKWARD: forward * (1.0 + again), WEIGHT: forward}


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
