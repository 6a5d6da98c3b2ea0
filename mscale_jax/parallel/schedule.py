"""Pipeline schedules as tables: what every stage does at every tick. Pure Python.

One table, many readers: the executor (`parallel/pipeline.py`) runs it, the picture
(`experiments/pipeline_schedule.py`) draws it and the performance model (`perf/`) costs it.

The model is cut into `p * v` chunks; stage s holds chunks (c, s) for c < v, i.e. Megatron's
interleaved assignment: chunk c of stage s is the (c*p + s)-th slice of the layers. A tick is
one chunk's forward (F) or backward (B) of one microbatch on one stage (F and B are one tick
each, as in the figures of the Megatron and MegaScale papers).

Each stage runs its actions in a fixed order (the schedule), each as early as its dependencies
allow:
  F(i, c) on s needs F(i, c) on the previous stage (s-1; stage p-1's chunk c-1 for s = 0);
  B(i, c) on s needs F(i, c) on s and B(i, c) on the next stage (s+1; stage 0's chunk c+1 for
  s = p-1); the last chunk's backward starts from the loss.
`latency` is the number of ticks a message takes between stages: 0 means a result of tick t
can be used at tick t+1; 1 means it is sent while tick t+1 computes and used from tick t+2 on
(MegaScale's decoupled, overlapped send/receive with double-buffered receive slots).

Orders:
  gpipe              all forwards, then all backwards (with v > 1 every microbatch through a
                     chunk before the next chunk, as circular pipelines do);
  1f1b               p - s - 1 warm-up forwards (twice that with a tick of latency), then one
                     forward / one backward in turn, then the remaining backwards;
  interleaved_1f1b   Megatron's: (p - s - 1) * 2 + (v - 1) * p warm-up forwards, microbatches in
                     groups of p per chunk, backwards from the last chunk down.
"""
import dataclasses
import functools
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
FORWARD, BACKWARD = "F", "B"


class Action(NamedTuple):
  """One tick's work on one stage: forward or backward of `microbatch` on model `chunk`."""
  kind: str          # FORWARD | BACKWARD
  microbatch: int
  chunk: int


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
  each; `grid[s][t]` is the Action of stage s at tick t, or None (idle).
  """
  schedule: str
  stages: int
  virtual: int
  microbatches: int
  latency: int
  orders: tuple      # [stages][2 * virtual * microbatches] of Action
  starts: tuple      # [stages][2 * virtual * microbatches] of ticks
  ticks: int         # length of the schedule

  @property
  def busy_ticks(self) -> int:
    """Ticks each stage computes: a forward and a backward per (microbatch, chunk)."""
    return 2 * self.virtual * self.microbatches

  @property
  def idle_ticks(self) -> int:
    """Ticks each stage waits (the same on every stage)."""
    return self.ticks - self.busy_ticks

  @property
  def bubble_fraction(self) -> float:
    """Idle ticks over busy ticks of a stage."""
    return self.idle_ticks / self.busy_ticks

  @functools.cached_property
  def grid(self) -> tuple:
    """[stages][ticks]: the Action each stage runs at each tick, None when idle."""
    rows = []
    for order, starts in zip(self.orders, self.starts):
      row = [None] * self.ticks
      for action, t in zip(order, starts):
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
    """Every Message, in order of sending (then source stage)."""
    p, v, out = self.stages, self.virtual, []
    for s, (order, starts) in enumerate(zip(self.orders, self.starts)):
      for action, t in zip(order, starts):
        target = _message_target(s, action, p, v)
        if target is not None:
          out.append(Message(action.kind, action.microbatch, target[1], s, target[0], t,
                             t + 1 + self.latency))
    return tuple(sorted(out, key=lambda msg: (msg.sent, msg.src, msg.kind)))

  @functools.cached_property
  def peak_inflight(self) -> tuple:
    """Per stage: the most (microbatch, chunk) inputs stashed at once (each holds the
    activations of 1/v of the stage's layers for one microbatch). Depends on the order only."""
    peaks = []
    for order in self.orders:
      count = peak = 0
      for action in order:
        count += 1 if action.kind == FORWARD else -1
        peak = max(peak, count)
      peaks.append(peak)
    return tuple(peaks)


def _is_first(s: int, chunk: int) -> bool:
  return s == 0 and chunk == 0


def _is_last(s: int, chunk: int, p: int, v: int) -> bool:
  return s == p - 1 and chunk == v - 1


def _upstream(s: int, chunk: int, p: int) -> tuple[int, int]:
  """(stage, chunk) whose forward output feeds chunk `chunk` of stage `s`."""
  return (s - 1, chunk) if s > 0 else (p - 1, chunk - 1)


def _downstream(s: int, chunk: int, p: int) -> tuple[int, int]:
  """(stage, chunk) that consumes chunk `chunk` of stage `s`'s forward output."""
  return (s + 1, chunk) if s < p - 1 else (0, chunk + 1)


def _predecessors_of(s: int, action: Action, p: int, v: int):
  """(stage, Action) pairs that `action` on stage `s` waits for."""
  i, c = action.microbatch, action.chunk
  if action.kind == FORWARD:
    if not _is_first(s, c):
      src, chunk = _upstream(s, c, p)
      yield src, Action(FORWARD, i, chunk)
    return
  yield s, Action(FORWARD, i, c)
  if not _is_last(s, c, p, v):
    src, chunk = _downstream(s, c, p)
    yield src, Action(BACKWARD, i, chunk)


def _message_target(s: int, action: Action, p: int, v: int):
  """(destination stage, chunk it feeds) of the action's output, or None (nothing is sent)."""
  c = action.chunk
  if action.kind == FORWARD:
    return None if _is_last(s, c, p, v) else _downstream(s, c, p)
  return None if _is_first(s, c) else _upstream(s, c, p)


def _forward_order(m: int, group_size: int, v: int) -> list[tuple[int, int]]:
  """(microbatch, chunk) in the order a stage runs forwards: groups of `group_size`
  microbatches, each group through chunk 0, 1, ..., v-1 (with v = 1: microbatch order)."""
  order = []
  for start in range(0, m, group_size):
    group = range(start, min(start + group_size, m))
    for chunk in range(v):
      order.extend((i, chunk) for i in group)
  return order


def warmup_forwards(schedule: str, p: int, v: int, m: int, s: int, latency: int = 0) -> int:
  """Forwards stage `s` runs before its first backward (Megatron-LM's counts; the interleaved
  one already leaves room for a tick of latency per hop, the 1F1B one is doubled for it)."""
  total = v * m
  if schedule == "gpipe":
    return total
  if schedule == "1f1b":
    return min((p - s - 1) * (1 + latency), total)
  if m == p:
    return total       # Megatron: with as many microbatches as stages, all forwards first
  return min((p - s - 1) * 2 + (v - 1) * p, total)


def stage_order(schedule: str, p: int, v: int, m: int, s: int, latency: int = 0) -> list:
  """The Actions of stage `s` in the order it runs them: warm-up forwards, then one forward
  and one backward in turn, then the remaining backwards."""
  # Megatron's groups of p microbatches per chunk; GPipe runs every microbatch through a
  # chunk before the next chunk (breadth-first, as circular pipelines do).
  order = _forward_order(m, m if schedule == "gpipe" else p, v)
  forwards = [Action(FORWARD, i, c) for i, c in order]
  backwards = [Action(BACKWARD, i, v - 1 - c) for i, c in order]
  warmup = warmup_forwards(schedule, p, v, m, s, latency)
  out = forwards[:warmup]
  for f, b in zip(forwards[warmup:], backwards):
    out += [f, b]
  return out + backwards[len(forwards) - warmup:]


def check(schedule: str, p: int, v: int, m: int, latency: int = 0) -> None:
  """Raises ValueError when `schedule` cannot run (p, v, m)."""
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
  for name, value in (("stages", p), ("virtual", v), ("microbatches", m)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r}: a positive integer")
  if latency not in (0, 1):
    raise ValueError(f"latency={latency!r}: 0 or 1 ticks")
  if schedule == "1f1b" and v != 1:
    raise ValueError(f"1f1b runs one chunk per stage (virtual=1), not virtual={v}; use "
                     f"interleaved_1f1b")
  if schedule == "interleaved_1f1b" and m % p:
    raise ValueError(f"interleaved_1f1b runs microbatches in groups of stages={p}: "
                     f"microbatches={m} must be a multiple of {p}")


@functools.lru_cache(maxsize=1024)
def build(schedule: str, p: int, v: int = 1, m: int = 1, latency: int = 0) -> Table:
  """The table of `schedule` for p stages, v chunks per stage and m microbatches.

  Every stage runs its `stage_order`, each action as early as its dependencies allow, with
  `latency` ticks between a send and its use. O(p * v * m) work; cached.
  """
  check(schedule, p, v, m, latency)
  orders = [stage_order(schedule, p, v, m, s, latency) for s in range(p)]
  n = v * m
  # tick[s][kind * n + chunk * m + microbatch], -1 until scheduled.
  tick = [[-1] * (2 * n) for _ in range(p)]
  starts = [[] for _ in range(p)]
  free = [0] * p
  pending = set(range(p))
  while pending:
    s = pending.pop()
    order, k = orders[s], len(starts[s])
    while k < len(order):
      kind, i, c = order[k]
      start = free[s]
      if kind == FORWARD:
        if not (s == 0 and c == 0):
          src, chunk = (s - 1, c) if s > 0 else (p - 1, c - 1)
          ready = tick[src][chunk * m + i]
          if ready < 0:
            break
          start = max(start, ready + 1 + latency)
      else:
        start = max(start, tick[s][c * m + i] + 1)
        if not (s == p - 1 and c == v - 1):
          src, chunk = (s + 1, c) if s < p - 1 else (0, c + 1)
          ready = tick[src][n + chunk * m + i]
          if ready < 0:
            break
          start = max(start, ready + 1 + latency)
      tick[s][(n if kind == BACKWARD else 0) + c * m + i] = start
      starts[s].append(start)
      free[s] = start + 1
      k += 1
      pending.update(((s - 1) % p, (s + 1) % p))
  if any(len(st) != len(o) for st, o in zip(starts, orders)):
    raise RuntimeError(f"{schedule} deadlocks for p={p}, v={v}, m={m}")
  return Table(schedule, p, v, m, latency, tuple(map(tuple, orders)),
               tuple(map(tuple, starts)), max(free))


def steady_microbatches(schedule: str, p: int, v: int, m: int) -> int:
  """The fewest microbatches whose table has the idle ticks and peak in-flight counts of m.

  Beyond 2p microbatches (more than the longest warm-up, 2(p-1) + (v-1)p forwards) a table
  only grows by steady one-forward-one-backward pairs, which change neither; tests check it.
  GPipe stashes every microbatch, so its tables never shrink.
  """
  if schedule == "gpipe":
    return m
  return min(m, 2 * p)


@functools.lru_cache(maxsize=4096)
def summary(schedule: str, p: int, v: int, m: int, latency: int = 0) -> tuple[int, tuple]:
  """(idle ticks per stage, peak in-flight per stage) of `build(schedule, p, v, m, latency)`,
  from the smallest table that has them (`steady_microbatches`): fast enough for planners."""
  check(schedule, p, v, m, latency)
  table = build(schedule, p, v, steady_microbatches(schedule, p, v, m), latency)
  return table.idle_ticks, table.peak_inflight


def megatron_summary(p: int, v: int, m: int) -> tuple[int, tuple]:
  """`summary` of the schedule Megatron-LM runs for (p, v, m) without send latency:
  interleaved 1F1B when v > 1, else 1F1B. The interleaved table needs m a multiple of p; other
  m (>= p) take the next multiple up, whose warm-up (which does not depend on m once m > p)
  is Megatron-LM's for m: both have the idle ticks and peak in-flight count of any m >= 2p."""
  if v == 1:
    return summary("1f1b", p, 1, m)
  return summary("interleaved_1f1b", p, v, m + (-m) % p)
