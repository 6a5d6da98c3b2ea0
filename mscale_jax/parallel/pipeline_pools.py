"""Stash and cotangent slots of the pipeline executor (`pipeline.py`): per-leaf arrays with a
leading slot axis, sized from the schedule table (`pipeline_plan.Plan`), so memory follows the
schedule. A tick that files nothing writes a spare last slot (the switch's branches must all
return the same record)."""
import jax
import jax.numpy as jnp

from mscale_jax.parallel import pipeline_plan as plan_lib
from mscale_jax.parallel import schedule as schedule_lib


class Pools:
  """Stash slots: one array [slots, *shape] per stashed leaf, in two pools. Every chunk's
  forward files into `plan_lib.MAIN` (slot: the plan's `stash_slot`), where the j-th leaf of
  a (shape, dtype) in one op's stash goes where the j-th such leaf of another op's goes. The
  model's last chunk files there too, and what no other chunk stashes (the loss head's
  residuals: logits, targets) into `plan_lib.LAST` (slot: `last_slot`), sized by its own
  lifetimes."""

  def __init__(self, program, plan: plan_lib.Plan):
    self.plan, self.layout = plan, {}
    self.arrays = {plan_lib.MAIN: [], plan_lib.LAST: []}
    forwards = [op for op in plan.ops if op.kind == schedule_lib.FORWARD]
    for op in sorted(forwards, key=lambda op: op.last):   # the last chunk's after the others
      seen, where = {}, []
      for leaf in program.stash_shapes(op):
        key = (tuple(leaf.shape), jnp.dtype(leaf.dtype))
        key = key + (seen.get(key, 0),)
        seen[key[:2]] = key[2] + 1
        main = self.arrays[plan_lib.MAIN]
        pool = plan_lib.MAIN if key in main or not op.last or len(forwards) == 1 else plan_lib.LAST
        keys = self.arrays[pool]
        if key not in keys:
          keys.append(key)
        where.append((pool, keys.index(key)))
      self.layout[op.first, op.last] = where

  def zeros(self) -> dict:
    """The pools, each array [slots + 1, *shape]: the last slot takes writes of ticks that
    file nothing."""
    # No layout asked for: XLA lays each out as the records filed into it are (asked for the
    # activations' layout, it resharded a record on every tick, with an all-to-all).
    return {pool: [jnp.zeros((self.plan.stash_slots[pool] + 1,) + shape, dtype)
                   for shape, dtype, _ in keys] for pool, keys in self.arrays.items()}

  def blank(self) -> dict:
    """A record of one slot of every array, zeros (what a tick that files nothing writes)."""
    return {pool: [jnp.zeros(shape, dtype) for shape, dtype, _ in keys]
            for pool, keys in self.arrays.items()}

  def record(self, op, leaves) -> dict:
    """`blank()` with `op`'s stashed leaves in their places."""
    out = self.blank()
    for leaf, (pool, k) in zip(leaves, self.layout[op.first, op.last]):
      out[pool][k] = leaf
    return out

  def load(self, pools: dict, op, slots: dict) -> list:
    """`op`'s stashed leaves, from slot `slots[pool]` of each pool."""
    return [pools[pool][k][slots[pool]] for pool, k in self.layout[op.first, op.last]]

  def write(self, pools: dict, record: dict, slots: dict) -> dict:
    """`pools` with `record` written into slot `slots[pool]` of each pool."""
    return {pool: [put(a, r, slots[pool]) for a, r in zip(arrays, record[pool])]
            for pool, arrays in pools.items()}


class Kept:
  """Slots for what a split backward's B keeps for its W (`backward_split`): one array
  [slots + 1, *shape] per leaf; the kinds of chunk share arrays by (shape, dtype, j), as the
  stash does. `shapes`: {(op.first, op.last): [ShapeDtypeStruct]}."""

  def __init__(self, shapes: dict, slots: int):
    self.slots, self.keys, self.layout = slots, [], {}
    for kind, leaves in shapes.items():
      seen, where = {}, []
      for leaf in leaves:
        key = (tuple(leaf.shape), jnp.dtype(leaf.dtype))
        key = key + (seen.get(key, 0),)
        seen[key[:2]] = key[2] + 1
        if key not in self.keys:
          self.keys.append(key)
        where.append(self.keys.index(key))
      self.layout[kind] = where

  def zeros(self) -> list:
    return [jnp.zeros((self.slots + 1,) + shape, dtype) for shape, dtype, _ in self.keys]

  def blank(self) -> list:
    return [jnp.zeros(shape, dtype) for shape, dtype, _ in self.keys]

  def record(self, op, leaves) -> list:
    """`blank()` with `op`'s kept leaves in their places."""
    out = self.blank()
    for leaf, k in zip(leaves, self.layout[op.first, op.last]):
      out[k] = leaf
    return out

  def load(self, arrays: list, op, slot) -> list:
    return [arrays[k][slot] for k in self.layout[op.first, op.last]]

  def write(self, arrays: list, record: list, slot) -> list:
    return [put(a, r, slot) for a, r in zip(arrays, record)]


def put(array, record, slot):
  """`array` with `record` in slot `slot` (in range): an in-place update-slice (`.at[].set`
  would also read the slot, to keep it where the index is out of range)."""
  return jax.lax.dynamic_update_index_in_dim(array, record.astype(array.dtype), slot, 0)
