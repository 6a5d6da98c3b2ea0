"""The executor's view of a schedule table: per tick and stage, which branch runs and which
buffer slots it reads and writes. Pure Python and NumPy; `pipeline.py` runs it.

A branch is an `Op` (kind, first, last): F, B or W of the model's first chunk (it embeds the
tokens), its last chunk (it computes the loss) or any other; only the ops a table uses are
compiled. Buffers, each a few slots reused as the table frees them:
  inbox     messages (activations, input cotangents) from arrival to use;
  stash     what a chunk's backward needs from its forward, from F to B (to W with a split
            backward): the chunk input (recompute='full') or the backward's residuals
            (otherwise). Every chunk files into the main pool; the model's last chunk files
            what only it stashes (the loss head's residuals: logits) into a pool of its own;
  cotangent (split backward only) the output cotangent a W reads, from its B to its W.
Slot counts are the most lifetimes that overlap on any stage, so memory follows the table.
"""
import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from mscale_jax.parallel import schedule as schedule_lib
from mscale_jax.parallel.schedule_place import place
from mscale_jax.parallel.schedule_timing import UNIT

FIELDS = ("op", "chunk", "microbatch", "x_slot", "g_slot", "stash_slot", "last_slot", "cot_slot",
          "recv_f", "recv_b")
MAIN, LAST = "main", "last"   # stash pools


class Op(NamedTuple):
  """A branch of the tick's switch: `kind` (F, B, W) of the first / last / another chunk."""
  kind: str
  first: bool
  last: bool


IDLE = Op("idle", False, False)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The table as per-tick integer arrays [ticks, stages] (`fields`, -1 where unused), the
  ops they index (`ops[0]` is idle) and the buffer sizes."""
  table: schedule_lib.Table
  fields: dict
  ops: tuple
  stash_slots: dict       # pool (MAIN: every chunk; LAST: the last chunk's own) -> slots
  inbox_slots: int
  cotangent_slots: int

  @property
  def every_stage(self) -> dict:
    """Per tick, [ticks] bools the same on every stage (so that a collective run where one is
    set runs on all stages or on none): whether some stage receives a message ('send_f',
    'send_b') and whether some stage runs the model's first chunk's last backward op
    ('embed_back': the embedding's backward follows it)."""
    embeds = np.asarray([op.first and op.kind == self.table.release_kind for op in self.ops])
    return {"send_f": (self.fields["recv_f"] < self.inbox_slots).any(1),
            "send_b": (self.fields["recv_b"] < self.inbox_slots).any(1),
            "embed_back": embeds[self.fields["op"]].any(1)}

  @property
  def split_backward(self) -> bool:
    """Whether the table splits the backward into B and W (zero bubble)."""
    return any(op.kind == schedule_lib.WEIGHT for op in self.ops)


def assign(lifetimes: dict) -> tuple[dict, int]:
  """Buffer slots for {key: (first tick, last tick)}: a slot is reused once its last tick has
  passed. Greedy by first tick, so as few slots as lifetimes ever overlap. (slots, count)."""
  last_tick, slots = [], {}
  for key, (start, end) in sorted(lifetimes.items(), key=lambda kv: kv[1]):
    slot = next((k for k, busy in enumerate(last_tick) if busy < start), len(last_tick))
    if slot == len(last_tick):
      last_tick.append(end)
    last_tick[slot] = end
    slots[key] = slot
  return slots, max(len(last_tick), 1)


def forward_only(table: schedule_lib.Table) -> schedule_lib.Table:
  """The forwards of `table` alone, each as early as its input allows in the table's order
  (an evaluation step: no backward, no stash). Same chunks, stages and message rules."""
  orders = tuple(tuple(a for a in order if a.kind == schedule_lib.FORWARD)
                 for order in table.orders)
  starts = place(orders, table.stages, table.virtual, UNIT, table.latency)
  return dataclasses.replace(table, orders=orders, starts=tuple(map(tuple, starts)),
                             ticks=max(st[-1] + 1 for st in starts))


@functools.lru_cache(maxsize=64)
def make_plan(schedule: str, stages: int, virtual: int, microbatches: int,
              overlap: bool = True, forward: bool = False) -> Plan:
  """Which op each stage runs at each tick and the slots it uses (`forward`: the forwards of
  the table alone, for evaluation)."""
  p, v = stages, virtual
  table = schedule_lib.build(schedule, p, v, microbatches, latency=1 if overlap else 0)
  if forward:
    table = forward_only(table)
  release = table.release_kind
  fields = {name: np.full((table.ticks, p), -1, np.int32) for name in FIELDS}
  ops = [IDLE]
  fields["op"][:] = 0
  inbox_slots = cotangent_slots = 1
  stash_slots = {MAIN: 1, LAST: 1}
  # Receive slots: a message is in its slot from `ready` to the tick that uses it.
  arrivals, uses = {}, {}
  for msg in table.messages:
    if forward and msg.kind != schedule_lib.FORWARD:
      continue
    action = schedule_lib.Action(msg.kind, msg.microbatch, msg.chunk)
    arrivals[(msg.dst, action)] = msg
    uses[(msg.dst, action)] = (msg.ready, table.tick_of(msg.dst, action))
    if msg.ready > uses[(msg.dst, action)][1]:
      raise ValueError(f"{schedule} table (p={p}, v={v}, m={microbatches}, latency="
                       f"{table.latency}) runs {action} on stage {msg.dst} at tick "
                       f"{uses[(msg.dst, action)][1]}, before its input arrives ({msg})")
  for s in range(p):
    inbox, count = assign({k: span for k, span in uses.items() if k[0] == s})
    inbox_slots = max(inbox_slots, count)
    at = dict(zip(table.orders[s], table.starts[s]))
    stash = {}
    for pool in (MAIN, LAST):
      lifetimes = {}
      for a, t in at.items():
        if a.kind == schedule_lib.FORWARD and (pool == MAIN or (s, a.chunk) == (p - 1, v - 1)):
          end = t if forward else at[schedule_lib.Action(release, a.microbatch, a.chunk)]
          lifetimes[(a.microbatch, a.chunk)] = (t, end)
      stash[pool], count = assign(lifetimes)
      stash_slots[pool] = max(stash_slots[pool], count)
    cot, count = assign({(a.microbatch, a.chunk): (t, at[schedule_lib.Action(
        schedule_lib.WEIGHT, a.microbatch, a.chunk)])
        for a, t in at.items() if a.kind == schedule_lib.BACKWARD and
        schedule_lib.Action(schedule_lib.WEIGHT, a.microbatch, a.chunk) in at})
    cotangent_slots = max(cotangent_slots, count)
    for action, t in at.items():
      op = Op(action.kind, (s, action.chunk) == (0, 0), (s, action.chunk) == (p - 1, v - 1))
      if op not in ops:
        ops.append(op)
      f = fields
      f["op"][t, s] = ops.index(op)
      f["chunk"][t, s], f["microbatch"][t, s] = action.chunk, action.microbatch
      f["stash_slot"][t, s] = stash[MAIN][(action.microbatch, action.chunk)]
      f["last_slot"][t, s] = stash[LAST].get((action.microbatch, action.chunk), -1)
      f["cot_slot"][t, s] = cot.get((action.microbatch, action.chunk), -1)
      if action.kind == schedule_lib.FORWARD and not op.first:
        f["x_slot"][t, s] = inbox[(s, action)]
      if action.kind == schedule_lib.BACKWARD and not op.last:
        f["g_slot"][t, s] = inbox[(s, action)]
    for (dst, action), msg in arrivals.items():
      if dst == s:   # filed into its slot at the end of tick ready - 1
        fields["recv_f" if msg.kind == "F" else "recv_b"][msg.ready - 1, s] = inbox[(s, action)]
  # Ticks that receive nothing file the ring's payload into a spare last slot.
  for name in ("recv_f", "recv_b"):
    fields[name][fields[name] < 0] = inbox_slots
  return Plan(table, fields, tuple(ops), stash_slots, inbox_slots, cotangent_slots)
