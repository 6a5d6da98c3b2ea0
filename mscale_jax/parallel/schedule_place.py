"""Placing a pipeline step's actions in time: two placers over `schedule_graph`'s dependencies.

`place` runs fixed per-stage orders, each action as early as its dependencies allow (how
Megatron-LM runs its schedules: the order is the program, the clock follows). `list_schedule`
chooses the order as it goes: whenever a stage is free it starts the ready action of highest
priority, so a stage never idles while it has work it may run (a list scheduler, Graham 1966).
Both take per-kind durations and a message `latency` in the same unit: ticks for the
executor's grid (durations 1, latency 0 or 1), seconds or forward-times for costing.
"""
import heapq

from mscale_jax.parallel.schedule_graph import (BACKWARD, FORWARD, WEIGHT, Action, predecessors,
                                                successors)


def place(orders, p: int, v: int, durations: dict, latency) -> list[list]:
  """Start times of `orders[s]` (stage s's actions in the order it runs them) when each action
  starts as soon as its stage is free and its inputs have arrived (`latency` after the sender
  finished; same-stage inputs at once). Raises RuntimeError if the orders deadlock."""
  finish = {}
  starts = [[] for _ in range(p)]
  free = [0] * p
  pending = set(range(p))
  while pending:
    s = pending.pop()
    order = orders[s]
    while len(starts[s]) < len(order):
      action = order[len(starts[s])]
      start = free[s]
      for src, pred, by_message in predecessors(s, action, p, v):
        done = finish.get((src, pred))
        if done is None:
          break
        start = max(start, done + latency if by_message else done)
      else:
        starts[s].append(start)
        free[s] = finish[(s, action)] = start + durations[action.kind]
        pending.update(((s - 1) % p, (s + 1) % p))
        continue
      break
  if any(len(st) != len(o) for st, o in zip(starts, orders)):
    raise RuntimeError(f"the stage orders deadlock (p={p}, v={v})")
  return starts


def list_schedule(priorities, caps, p: int, v: int, durations: dict, latency,
                  release: str) -> tuple[list, list]:
  """(orders, starts): a work-conserving placement of every action in `priorities`.

  `priorities[s]` ranks stage s's actions (earlier is more urgent). When stage s is free at
  time t it starts, among its actions whose inputs have arrived by t:
    the most urgent F or B, where forwards keep their order in `priorities` and start only
    while fewer than `caps[s]` microbatch chunks are in flight on s (forwarded, their
    `release` kind, B or W, not yet run);
    else the most urgent W (weight gradients fill what would be idle time);
    else it idles until the next input arrives.
  Decisions are taken in time order, so every input that arrives by t is known at t
  (durations are positive). Raises RuntimeError when the caps deadlock the step.
  """
  rank = [{a: k for k, a in enumerate(order)} for order in priorities]
  waiting = {}      # (stage, Action) -> [unfinished predecessors, latest arrival]
  ready = [dict() for _ in range(p)]       # Action -> arrival time of its last input
  for s, order in enumerate(priorities):
    for a in order:
      preds = predecessors(s, a, p, v)
      if preds:
        waiting[(s, a)] = [len(preds), 0]
      else:
        ready[s][a] = 0
  forwards = [[a for a in order if a.kind == FORWARD] for order in priorities]
  orders, starts = [[] for _ in range(p)], [[] for _ in range(p)]
  free, inflight, next_forward = [0] * p, [0] * p, [0] * p
  events = [(0, s) for s in range(p)]
  while events:
    t, s = heapq.heappop(events)
    if t < free[s]:
      continue
    best = wbest = None
    later = None
    for a, arrival in ready[s].items():
      if arrival > t:
        later = arrival if later is None else min(later, arrival)
      elif a.kind == WEIGHT:
        if wbest is None or rank[s][a] < rank[s][wbest]:
          wbest = a
      elif a.kind != FORWARD or (inflight[s] < caps[s] and a == forwards[s][next_forward[s]]):
        if best is None or rank[s][a] < rank[s][best]:
          best = a
    action = best or wbest
    if action is None:
      if later is not None:
        heapq.heappush(events, (later, s))
      continue
    del ready[s][action]
    orders[s].append(action)
    starts[s].append(t)
    end = free[s] = t + durations[action.kind]
    inflight[s] += (action.kind == FORWARD) - (action.kind == release)
    next_forward[s] += action.kind == FORWARD
    heapq.heappush(events, (end, s))
    for dst, succ in successors(s, action, p, v, release == WEIGHT):
      entry = waiting[(dst, succ)]
      entry[0] -= 1
      entry[1] = max(entry[1], end + latency if dst != s else end)
      if entry[0] == 0:
        del waiting[(dst, succ)]
        ready[dst][succ] = entry[1]
        heapq.heappush(events, (max(free[dst], entry[1]), dst))
  if waiting or any(ready):
    raise RuntimeError(f"the in-flight caps {list(caps)} deadlock the step (p={p}, v={v})")
  return orders, starts


__all__ = ["place", "list_schedule", "Action", "FORWARD", "BACKWARD", "WEIGHT"]
