"""Pipeline schedules as tables: what every stage does at every tick. Pure Python.

One table, many readers: the executor (`parallel/pipeline.py`) runs its integer tick grid, the
picture (`experiments/pipeline_schedule.py`) draws it and the performance model (`perf/`)
costs it with the passes' real durations (`Table.timeline`, `schedule_timing.py`).

A tick is one action of one stage: a chunk's forward (F), backward (B) or, in the zero-bubble
schedule, weight gradient (W) of one microbatch (dependencies: `schedule_graph.py`). `latency`
is the number of ticks a message takes between stages: 0 means a result of tick t can be used
at tick t+1; 1 means it is sent while tick t+1 computes and used from tick t+2 on (MegaScale's
decoupled, overlapped send/receive with double-buffered receive slots).

Schedules:
  gpipe              all forwards, then all backwards (with v > 1 every microbatch through a
                     chunk before the next chunk, as circular pipelines do); fixed order;
  1f1b               p - s - 1 warm-up forwards, then one forward / one backward in turn, then
                     the remaining backwards;
  interleaved_1f1b   Megatron's: (p - s - 1) * 2 + (v - 1) * p warm-up forwards, microbatches
                     in groups of p per chunk, backwards from the last chunk down;
  zb_h1              ZB-H1 (Qi et al., ICLR 2024): 1F1B with the backward split into B (input
                     gradient, on the critical path) and W (weight gradient, no message),
                     W run where 1F1B would idle; at most 1F1B's in-flight microbatches.
Without latency, 1f1b and interleaved_1f1b run Megatron-LM's fixed orders. With latency (and
always for zb_h1) a list scheduler (`schedule_place.list_schedule`) takes each stage's next
action from those orders as priorities: it never idles a stage that has ready work, and caps
the microbatches in flight at the schedule's warm-up depth for that latency (`inflight_cap`).
"""
import dataclasses
import functools

from mscale_jax.errors import ConfigError
from mscale_jax.parallel.schedule_graph import (BACKWARD, FORWARD, WEIGHT, Action,
                                                message_target)
from mscale_jax.parallel.schedule_place import list_schedule, place
from mscale_jax.parallel.schedule_timing import (RECOMPUTES, UNIT, Timeline, action_durations,
                                                 attention_core_share, pass_costs)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
SPLIT_BACKWARD = ("zb_h1",)      # schedules whose backward is B (input grad) + W (weight grad)

__all__ = ["SCHEDULES", "SPLIT_BACKWARD", "FORWARD", "BACKWARD", "WEIGHT", "Action", "Message",
           "Table", "build", "check", "summary", "megatron_summary", "stage_order",
           "warmup_forwards", "inflight_cap", "forward_groups", "Timeline", "pass_costs",
           "RECOMPUTES", "attention_core_share"]


@dataclasses.dataclass(frozen=True)
class Message:
  """An activation (F) or input cotangent (B) sent at the end of tick `sent` from stage `src`
  to stage `dst`, usable there from tick `ready` on (`sent + 1 + latency`)."""
  kind: str
  microbatch: int
  chunk: int         # the chunk that consumes it on `dst`
  src: int
  dst: int
  sent: int
  ready: int


@dataclasses.dataclass(frozen=True)
class Table:
  """A schedule laid out in ticks.

  `orders[s]` lists stage s's actions in the order it runs them and `starts[s]` the tick of
  each; `grid[s][t]` is the Action of stage s at tick t, or None (idle). Every stage runs the
  same actions: F and B (and W with a split backward) of every (microbatch, chunk).
  """
  schedule: str
  stages: int
  virtual: int
  microbatches: int
  latency: int
  orders: tuple      # [stages][actions per stage] of Action
  starts: tuple      # [stages][actions per stage] of ticks
  ticks: int         # length of the schedule

  @property
  def split_backward(self) -> bool:
    """Whether the backward is split into B (input gradient) and W (weight gradient)."""
    return self.schedule in SPLIT_BACKWARD

  @property
  def busy_ticks(self) -> int:
    """Ticks each stage computes: one per action, 2 (or 3 with W) per (microbatch, chunk)."""
    return len(self.orders[0])

  @property
  def idle_ticks(self) -> int:
    """Ticks each stage waits (the same on every stage)."""
    return self.ticks - self.busy_ticks

  @property
  def bubble_fraction(self) -> float:
    """Idle ticks over busy ticks of a stage (ticks of equal length; see `timeline`)."""
    return self.idle_ticks / self.busy_ticks

  @functools.cached_property
  def grid(self) -> tuple:
    """[stages][ticks]: the Action each stage runs at each tick, None when idle."""
    rows = []
    for order, starts in zip(self.orders, self.starts):
      row = [None] * self.ticks
      for action, t in zip(order, starts):
        assert row[t] is None, "two actions of one stage in one tick"
        row[t] = action
      rows.append(tuple(row))
    return tuple(rows)

  def tick_of(self, stage: int, action: Action) -> int:
    """The tick at which `stage` runs `action`."""
    return self._ticks[stage][action]

  @functools.cached_property
  def _ticks(self) -> tuple:
    return tuple(dict(zip(o, s)) for o, s in zip(self.orders, self.starts))

  @functools.cached_property
  def messages(self) -> tuple:
    """Every Message, in order of sending (then source stage). W sends none."""
    p, v, out = self.stages, self.virtual, []
    for s, (order, starts) in enumerate(zip(self.orders, self.starts)):
      for action, t in zip(order, starts):
        target = message_target(s, action, p, v)
        if target is not None:
          out.append(Message(action.kind, action.microbatch, target[1], s, target[0], t,
                             t + 1 + self.latency))
    return tuple(sorted(out, key=lambda msg: (msg.sent, msg.src, msg.kind)))

  @property
  def release_kind(self) -> str:
    """The action after which a (microbatch, chunk)'s stashed activations are freed: its last
    (W with a split backward, else B)."""
    return WEIGHT if self.split_backward else BACKWARD

  @functools.cached_property
  def peak_inflight(self) -> tuple:
    """Per stage: the most (microbatch, chunk)s stashed at once, from their F to their last
    action (`release_kind`). Each holds the activations of 1/v of the stage's layers for one
    microbatch. Depends on the order only."""
    return self._peak(FORWARD, self.release_kind)

  @functools.cached_property
  def peak_awaiting_weight(self) -> tuple:
    """Per stage: the most (microbatch, chunk)s between their B and W (the output cotangents
    a split backward keeps for W); zeros without a split."""
    return self._peak(BACKWARD, WEIGHT) if self.split_backward else (0,) * self.stages

  def _peak(self, opens: str, closes: str) -> tuple:
    peaks = []
    for order in self.orders:
      count = peak = 0
      for action in order:
        count += (action.kind == opens) - (action.kind == closes)
        peak = max(peak, count)
      peaks.append(peak)
    return tuple(peaks)

  def timeline(self, costs=None, hop: float = 0.0) -> Timeline:
    """The table's orders run asynchronously with real pass costs (each action starts when its
    stage is free and its inputs have arrived, `hop` after the sender finished), as
    Megatron-LM's executor runs them. `costs` maps F, B (input gradient) and W (weight
    gradient) of one chunk to a time (`pass_costs`); a table without a split runs B + W as
    its backward. Default: the tick grid itself (1 per action, hop = latency)."""
    if costs is None:
      return Timeline(self, dict(UNIT), tuple(map(tuple, self.starts)))
    durations = action_durations(costs, self.split_backward)
    starts = place(self.orders, self.stages, self.virtual, durations, hop)
    return Timeline(self, durations, tuple(map(tuple, starts)))

  def lockstep_time(self, costs, hop: float = 0.0) -> float:
    """Wall time of the grid run in lock-step (every stage starts tick t together, as the SPMD
    executor does): a tick lasts as long as its slowest action; without latency every tick
    also ends in a send of `hop`, with latency the send overlaps the next tick."""
    durations = action_durations(costs, self.split_backward)
    total = 0.0
    for t in range(self.ticks):
      compute = max((durations[row[t].kind] for row in self.grid if row[t] is not None),
                    default=0.0)
      total += compute + hop if self.latency == 0 else max(compute, hop)
    return total


def forward_groups(schedule: str, p: int, m: int, latency: int = 0) -> list[int]:
  """Sizes of the microbatch groups a stage runs through chunk 0, 1, ..., v-1 before the next
  group (they matter only with v > 1).

  GPipe: one group of m. Megatron's interleaving: groups of p, which without latency is
  exactly what covers the wrap-around (microbatch i leaves chunk c of stage 0 and is back for
  chunk c+1 p ticks later). With `latency` the round trip is p * (1 + latency) ticks, so the
  groups are that large at least: m split as evenly as possible into groups of >= p(1+latency)
  (a smaller last group would leave stage 0 waiting at its wrap-around).
  """
  if schedule == "gpipe":
    return [m]
  n = max(1, m // (p * (1 + latency)))
  return [m // n + (k < m % n) for k in range(n)]


def _forward_order(sizes: list[int], v: int) -> list[tuple[int, int]]:
  """(microbatch, chunk) in the order a stage runs forwards: each group of `sizes` through
  chunk 0, 1, ..., v-1 (with v = 1: microbatch order)."""
  order, start = [], 0
  for size in sizes:
    for chunk in range(v):
      order.extend((i, chunk) for i in range(start, start + size))
    start += size
  return order


def warmup_forwards(schedule: str, p: int, v: int, m: int, s: int, latency: int = 0) -> int:
  """Forwards stage `s` runs before its first backward: Megatron-LM's counts without latency
  ((p-s-1) * 2 + (v-1) * p interleaved, which already covers two ticks per hop; p-s-1 for
  1F1B). With latency 1F1B's is doubled and interleaving's runs its first (larger) group
  through the first v-1 chunks (`forward_groups`)."""
  total = v * m
  if schedule == "gpipe":
    return total
  if schedule in ("1f1b", "zb_h1"):
    return min((p - s - 1) * (1 + latency), total)
  if m == p:
    return total       # Megatron: with as many microbatches as stages, all forwards first
  first = forward_groups(schedule, p, m, latency)[0]
  return min((p - s - 1) * 2 + (v - 1) * first, total)


def inflight_cap(schedule: str, p: int, v: int, m: int, s: int, latency: int = 0) -> int:
  """The most (microbatch, chunk)s stage `s` may hold between F and release: its warm-up
  forwards plus the one of the first steady pair (what a stage needs to cover the round trip
  of its first microbatch to the last stage and back with `latency` ticks per hop)."""
  if schedule in SPLIT_BACKWARD:
    s = 0    # ZB-H1: every stage may hold what 1F1B's first stage does (W delayed, not F)
  return min(warmup_forwards(schedule, p, v, m, s, latency) + 1, v * m)


def stage_order(schedule: str, p: int, v: int, m: int, s: int, latency: int = 0) -> list:
  """The Actions of stage `s` in the order Megatron-LM runs them (the list scheduler's
  priorities): warm-up forwards, then one forward and one backward in turn, then the remaining
  backwards; with a split backward each B is followed by its W."""
  order = _forward_order(forward_groups(schedule, p, m, latency), v)
  forwards = [Action(FORWARD, i, c) for i, c in order]
  backwards = [[Action(BACKWARD, i, v - 1 - c)] for i, c in order]
  if schedule in SPLIT_BACKWARD:
    backwards = [[b[0], Action(WEIGHT, *b[0][1:])] for b in backwards]
  warmup = warmup_forwards(schedule, p, v, m, s, latency)
  out = forwards[:warmup]
  for f, b in zip(forwards[warmup:], backwards):
    out += [f, *b]
  for b in backwards[len(forwards) - warmup:]:
    out += b
  return out


def check(schedule: str, p: int, v: int, m: int, latency: int = 0) -> None:
  """Raises ConfigError (a ValueError) naming the field when `schedule` cannot run (p, v, m)."""
  if schedule not in SCHEDULES:
    raise ConfigError("schedule", schedule, f"one of {', '.join(SCHEDULES)}")
  for name, value in (("stages", p), ("virtual", v), ("microbatches", m)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(name, value, "a positive integer")
  if latency not in (0, 1):
    raise ConfigError("latency", latency, "0 or 1 ticks")
  if schedule in ("1f1b", "zb_h1") and v != 1:
    raise ConfigError("virtual", v, f"1: {schedule} runs one chunk per stage (virtual=1); "
                                    f"interleaved_1f1b or gpipe run more")
  if schedule == "interleaved_1f1b" and m % p:
    raise ConfigError("microbatches", m, f"a multiple of stages={p}: interleaved_1f1b runs "
                                         f"microbatches in groups of one per stage")


@functools.lru_cache(maxsize=1024)
def build(schedule: str, p: int, v: int = 1, m: int = 1, latency: int = 0) -> Table:
  """The table of `schedule` for p stages, v chunks per stage and m microbatches.

  Fixed orders (GPipe; Megatron's 1F1B orders without latency) run each action as early as its
  dependencies allow; the others are list-scheduled (module docstring). `latency` ticks
  between a send and its use. Cached.
  """
  check(schedule, p, v, m, latency)
  orders = [stage_order(schedule, p, v, m, s, latency) for s in range(p)]
  release = WEIGHT if schedule in SPLIT_BACKWARD else BACKWARD
  if schedule == "gpipe" or (latency == 0 and schedule not in SPLIT_BACKWARD):
    starts = place(orders, p, v, UNIT, latency)
  else:
    caps = [inflight_cap(schedule, p, v, m, s, latency) for s in range(p)]
    orders, starts = list_schedule(orders, caps, p, v, UNIT, latency, release)
  ticks = max(st[-1] + 1 for st in starts)
  return Table(schedule, p, v, m, latency, tuple(map(tuple, orders)),
               tuple(map(tuple, starts)), ticks)


def steady_microbatches(schedule: str, p: int, v: int, m: int, latency: int = 0) -> int:
  """The fewest microbatches whose table has the idle ticks and peak in-flight counts of m.

  Beyond 2p microbatches (more than the longest warm-up, 2(p-1) + (v-1)p forwards) a table
  only grows by steady pairs (triples with W), which change neither; tests check it.
  GPipe stashes every microbatch, so its tables never shrink; nor do interleaved tables with
  latency, whose group sizes (`forward_groups`), and so their peaks, depend on m, nor ZB-H1's
  with latency, whose greedy W placement varies with m.
  """
  if schedule == "gpipe" or (schedule != "1f1b" and latency > 0):
    return m
  return min(m, 2 * p)


@functools.lru_cache(maxsize=4096)
def summary(schedule: str, p: int, v: int, m: int, latency: int = 0) -> tuple[int, tuple]:
  """(idle ticks per stage, peak in-flight per stage) of `build(schedule, p, v, m, latency)`,
  from the smallest table that has them (`steady_microbatches`): fast enough for planners."""
  check(schedule, p, v, m, latency)
  table = build(schedule, p, v, steady_microbatches(schedule, p, v, m, latency), latency)
  return table.idle_ticks, table.peak_inflight


def megatron_summary(p: int, v: int, m: int) -> tuple[int, tuple]:
  """`summary` of the schedule Megatron-LM runs for (p, v, m) without send latency:
  interleaved 1F1B when v > 1, else 1F1B. The interleaved table needs m a multiple of p; other
  m (>= p) take the next multiple up, whose warm-up (which does not depend on m once m > p)
  is Megatron-LM's for m: both have the idle ticks and peak in-flight count of any m >= 2p."""
  if v == 1:
    return summary("1f1b", p, 1, m)
  return summary("interleaved_1f1b", p, v, m + (-m) % p)
