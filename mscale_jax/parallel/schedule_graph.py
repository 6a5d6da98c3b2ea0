"""The dependency graph of a pipeline step: actions, what each waits for, what each sends.

The model is cut into `p * v` chunks; stage s holds chunks (c, s) for c < v (Megatron's
interleaved assignment: chunk c of stage s is the (c*p + s)-th slice of the layers). An action
is one chunk's forward (F), backward (B) or, for the split-backward schedules (zero bubble),
weight gradient (W) of one microbatch on one stage:

  F(i, c) on s waits for F(i, c) on the previous stage (s-1; stage p-1's chunk c-1 for s = 0);
  B(i, c) on s waits for F(i, c) on s and B(i, c) on the next stage (s+1; stage 0's chunk c+1
    for s = p-1); the last chunk's backward starts from the loss. Without a split B is the
    whole backward; with one it is the input gradient only (the cotangent sent upstream);
  W(i, c) on s (split only) waits for B(i, c) on s and sends nothing.

Pure Python; `schedule.py` builds tables on it and `schedule_place.py` places them in time.
"""
from typing import NamedTuple

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
KINDS = (FORWARD, BACKWARD, WEIGHT)


class Action(NamedTuple):
  """One piece of one stage's work: `kind` (F, B or W) of `microbatch` on model `chunk`."""
  kind: str
  microbatch: int
  chunk: int


def is_first(s: int, chunk: int) -> bool:
  """Whether chunk `chunk` of stage `s` is the model's first (it reads the embedding)."""
  return s == 0 and chunk == 0


def is_last(s: int, chunk: int, p: int, v: int) -> bool:
  """Whether chunk `chunk` of stage `s` is the model's last (it computes the loss)."""
  return s == p - 1 and chunk == v - 1


def upstream(s: int, chunk: int, p: int) -> tuple[int, int]:
  """(stage, chunk) whose forward output feeds chunk `chunk` of stage `s`."""
  return (s - 1, chunk) if s > 0 else (p - 1, chunk - 1)


def downstream(s: int, chunk: int, p: int) -> tuple[int, int]:
  """(stage, chunk) that consumes chunk `chunk` of stage `s`'s forward output."""
  return (s + 1, chunk) if s < p - 1 else (0, chunk + 1)


def predecessors(s: int, action: Action, p: int, v: int) -> list[tuple[int, Action, bool]]:
  """(stage, Action, arrives_by_message) for each action `action` on stage `s` waits for."""
  kind, i, c = action
  if kind == FORWARD:
    if is_first(s, c):
      return []
    src, chunk = upstream(s, c, p)
    return [(src, Action(FORWARD, i, chunk), True)]
  if kind == WEIGHT:
    return [(s, Action(BACKWARD, i, c), False)]
  out = [(s, Action(FORWARD, i, c), False)]
  if not is_last(s, c, p, v):
    src, chunk = downstream(s, c, p)
    out.append((src, Action(BACKWARD, i, chunk), True))
  return out


def successors(s: int, action: Action, p: int, v: int, split: bool) -> list[tuple[int, Action]]:
  """(stage, Action) pairs that wait for `action` on stage `s` (inverse of `predecessors`)."""
  kind, i, c = action
  if kind == FORWARD:
    out = [(s, Action(BACKWARD, i, c))]
    if not is_last(s, c, p, v):
      dst, chunk = downstream(s, c, p)
      out.append((dst, Action(FORWARD, i, chunk)))
    return out
  if kind == WEIGHT:
    return []
  out = [(s, Action(WEIGHT, i, c))] if split else []
  if not is_first(s, c):
    dst, chunk = upstream(s, c, p)
    out.append((dst, Action(BACKWARD, i, chunk)))
  return out


def message_target(s: int, action: Action, p: int, v: int):
  """(destination stage, chunk it feeds) of the action's output, or None (nothing is sent)."""
  kind, _, c = action
  if kind == FORWARD:
    return None if is_last(s, c, p, v) else downstream(s, c, p)
  if kind == BACKWARD:
    return None if is_first(s, c) else upstream(s, c, p)
  return None
