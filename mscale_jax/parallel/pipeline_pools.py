"""Stash and cotangent slots of the pipeline executor (`pipeline.py`): per-leaf arrays with a
leading slot axis, sized from the schedule table (`pipeline_plan.Plan`), so memory follows the
schedule. The op that makes a record files it, leaf by leaf, into its slots (in place: the
executor runs each op under a `lax.cond` that passes the arrays through otherwise)."""
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
    """The pools, each array [slots, *shape]."""
    # No layout asked for: XLA lays each out as the records filed into it are (asked for the
    # activations' layout, it resharded a record on every tick, with an all-to-all).
    return {pool: [jnp.zeros((self.plan.stash_slots[pool],) + shape, dtype)
                   for shape, dtype, _ in keys] for pool, keys in self.arrays.items()}

  def file(self, pools: dict, op, leaves, slots: dict) -> dict:
    """`pools` with `op`'s stashed `leaves` in slot `slots[pool]` of their arrays."""
    pools = {pool: list(arrays) for pool, arrays in pools.items()}
    for leaf, (pool, k) in zip(leaves, self.layout[op.first, op.last]):
      pools[pool][k] = put(pools[pool][k], leaf, slots[pool])
    return pools

  def load(self, pools: dict, op, slots: dict) -> list:
    """`op`'s stashed leaves, from slot `slots[pool]` of each pool."""
    return [pools[pool][k][slots[pool]] for pool, k in self.layout[op.first, op.last]]



class Kept:
  """Slots for what a split backward's B keeps for its W (`backward_split`): one array
  [slots, *shape] per leaf; the kinds of chunk but the model's first share arrays by (shape,
  dtype, j), as the stash does. The first chunk keeps its output cotangent (a message, laid
  out as the activations are), the others what their B computed (laid out as B made it, a
  logits cotangent over the vocabulary, say): in one array, a record laid out unlike the
  array would be resharded (an all-to-all) on every write and read. `shapes`: {(op.first,
  op.last): [ShapeDtypeStruct]}."""

  def __init__(self, shapes: dict, slots: int):
    self.slots, self.keys, self.layout = slots, [], {}
    for (first, last), leaves in shapes.items():
      seen, where = {}, []
      for leaf in leaves:
        key = (tuple(leaf.shape), jnp.dtype(leaf.dtype))
        key = key + (seen.get(key, 0), first)
        seen[key[:2]] = key[2] + 1
        if key not in self.keys:
          self.keys.append(key)
        where.append(self.keys.index(key))
      self.layout[first, last] = where

  def zeros(self) -> list:
    return [jnp.zeros((self.slots,) + shape, dtype) for shape, dtype, *_ in self.keys]

  def file(self, arrays: list, op, leaves, slot) -> list:
    """`arrays` with `op`'s kept `leaves` in slot `slot` of theirs."""
    arrays = list(arrays)
    for leaf, k in zip(leaves, self.layout[op.first, op.last]):
      arrays[k] = put(arrays[k], leaf, slot)
    return arrays

  def load(self, arrays: list, op, slot) -> list:
    return [arrays[k][slot] for k in self.layout[op.first, op.last]]


def put(array, record, slot):
  """`array` with `record` in slot `slot` (in range): an in-place update-slice (`.at[].set`
  would also read the slot, to keep it where the index is out of range)."""
  return jax.lax.dynamic_update_index_in_dim(array, record.astype(array.dtype), slot, 0)
