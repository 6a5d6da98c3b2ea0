"""Continuity: a machine is flagged only when it stays the outlier for a while.

Minder's second observation (§3, §4.4): a fault's distinctive pattern lasts (minutes, in the
paper's production traces, before the task halts), while healthy jitter (a garbage-collection
pause, a burst of logging, one slow batch) is short. Per metric, the tracker counts consecutive
checks in which the same machine was the candidate; it fires when the count reaches `checks`.
A different candidate, or none, restarts the count.
"""
import dataclasses


@dataclasses.dataclass
class Streak:
  """The current run of one machine as a metric's candidate."""
  machine: int
  since: float          # time of the first check of the run
  checks: int = 1
  ratios: list = dataclasses.field(default_factory=list)


class Continuity:
  """Feeds on one candidate (or None) per check; `update` returns the streak when it reaches
  `checks` consecutive checks (once per streak)."""

  def __init__(self, checks: int):
    if checks < 1:
      raise ValueError(f"continuity needs checks >= 1, got {checks}")
    self.checks = checks
    self.streak: Streak | None = None
    self._fired = False

  def update(self, t: float, machine: int | None, ratio: float = 0.0) -> Streak | None:
    """Records the check at time `t` (its candidate `machine`, or None, and its ratio); returns
    the streak the first time it reaches `checks`, else None."""
    if machine is None:
      self.streak, self._fired = None, False
      return None
    if self.streak is None or self.streak.machine != machine:
      self.streak, self._fired = Streak(machine, t), False
    else:
      self.streak.checks += 1
    self.streak.ratios.append(ratio)
    if self.streak.checks >= self.checks and not self._fired:
      self._fired = True
      return self.streak
    return None
