"""Replica consistency: every copy of a replicated array must hold the same bits.

Parameters and optimizer state that the mesh replicates (over `data`, say) are updated on every
replica from the same all-reduced gradients, so the replicas stay bitwise identical. A device or
link that delivers a wrong collective result (silent data corruption) breaks that on its own
replicas only, and a checkpoint written then would carry the corruption past any restart. So
before a checkpoint is written, `check` compares a checksum of each device's block of each
array with those of the other devices holding the same block, within a process and across
processes.

Cost: one compiled program computes two uint32 checksums per device and array (a plain and a
position-weighted sum of the bits: any single changed element changes the weighted one) and
all-gathers that small table to every device; every process takes the same path and reaches
the same verdict. The program goes through the per-process compile cache
(mscale_jax/compile_cache.py), so a restarted job loads it instead of compiling it again.
`start_check` dispatches the program and leaves its verdict to be read later (the trainer reads
it on the save's launch thread, before orbax starts: callbacks/checkpointing.py).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mscale_jax import compile_cache


class ReplicaDivergenceError(RuntimeError):
  """Replicas of an array disagree; `culprit` is the one process whose copies differ from a
  majority (None when no majority names one, e.g. two replicas), `processes` all involved."""

  def __init__(self, step: int | None, divergences: list["Divergence"]):
    self.step, self.divergences = step, divergences
    suspects = sorted({p for d in divergences for p in d.suspects})
    self.processes = sorted({p for d in divergences for p in d.processes})
    self.culprit = suspects[0] if len(suspects) == 1 and all(
        d.majority for d in divergences) else None
    shown = "; ".join(d.describe() for d in divergences[:3])
    more = f" (and {len(divergences) - 3} more)" if len(divergences) > 3 else ""
    who = (f"process {self.culprit} differs from the majority" if self.culprit is not None
           else f"no majority among processes {self.processes}: a self-check must tell")
    super().__init__(
        f"replicas disagree{f' at step {step}' if step is not None else ''}: {who}; {shown}"
        f"{more}. The checkpoint was not written; the previous one stays the latest")


@dataclasses.dataclass
class Divergence:
  """One block of one array whose replicas disagree: device ids by the checksum they hold."""
  path: str
  block: tuple                       # ((start, stop), ...) per dimension
  groups: list[tuple[tuple, list]]   # [(checksum, [(device id, process), ...])], largest first

  @property
  def majority(self) -> bool:
    return len(self.groups) > 1 and len(self.groups[0][1]) > len(self.groups[1][1])

  @property
  def processes(self) -> list[int]:
    return sorted({p for _, members in self.groups for _, p in members})

  @property
  def suspects(self) -> list[int]:
    """Processes holding a minority copy; every process involved when there is no majority."""
    if not self.majority:
      return self.processes
    return sorted({p for _, members in self.groups[1:] for _, p in members})

  def describe(self) -> str:
    block = ", ".join(f"{a}:{b}" for a, b in self.block)
    copies = " vs ".join(
        "devices " + ",".join(str(d) for d, _ in m) + " of process(es) "
        + ",".join(str(p) for p in sorted({p for _, p in m})) for _, m in self.groups)
    return f"{self.path}[{block}]: {copies}"


def _block_checksum(x):
  """[2] uint32: the sum and the position-weighted (odd weights) sum of `x`'s bits."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  bits = bits.reshape(-1).astype(jnp.uint32)
  weights = 2 * jnp.arange(bits.size, dtype=jnp.uint32) + 1
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                    jnp.sum(bits * weights, dtype=jnp.uint32)])


@functools.lru_cache(maxsize=8)
def _program(mesh, layouts: tuple):
  """The executable of the checksum table of arrays laid out as `layouts` ((shape, dtype,
  sharding) each) on `mesh`: a [*mesh.shape, num_arrays, 2] uint32 array, one [num_arrays, 2]
  block per device, replicated on every device (so every process reads all of it)."""
  lead = (1,) * len(mesh.axis_names)

  def per_device(*blocks):
    return jnp.stack([_block_checksum(b) for b in blocks]).reshape(lead + (len(blocks), 2))

  specs = tuple(sharding.spec for *_, sharding in layouts)
  table = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs,
                                out_specs=P(*mesh.axis_names), check_vma=False),
                  out_shardings=NamedSharding(mesh, P()))
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
          for shape, dtype, sharding in layouts]
  executable, _ = compile_cache.load_or_lower(table.lower, args, "replica_check", mesh,
                                              built_from="")
  return executable


@functools.lru_cache(maxsize=4096)
def _replica_groups(sharding, shape) -> list[tuple[tuple, list]]:
  """[(block, [device, ...])] for each block that more than one device holds."""
  groups: dict[tuple, list] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    block = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
    groups.setdefault(block, []).append(device)
  return [(b, sorted(ds, key=lambda d: d.id)) for b, ds in groups.items() if len(ds) > 1]


def _dispatch(tree):
  """(paths, arrays, mesh, table) of `tree`'s replicated arrays, the table's program dispatched
  (not waited for): a collective that every process must call at the same point."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  chosen = [(jax.tree_util.keystr(path), x) for path, x in flat
            if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
            and _replica_groups(x.sharding, x.shape)]
  if not chosen:
    return [], [], None, None
  mesh = chosen[0][1].sharding.mesh
  chosen = [(p, x) for p, x in chosen if x.sharding.mesh == mesh]
  paths, arrays = [p for p, _ in chosen], [x for _, x in chosen]
  program = _program(mesh, tuple((x.shape, x.dtype, x.sharding) for x in arrays))
  return paths, arrays, mesh, program(*arrays)


def _read(paths, arrays, mesh, table) -> tuple[list, list, np.ndarray]:
  """`checksums`' answer from `_dispatch`'s (waits for the table)."""
  if mesh is None:
    return [], [], np.zeros((0, 0, 2), np.uint32)
  table = np.asarray(table)
  by_device = np.zeros((max(d.id for d in mesh.devices.flat) + 1, len(arrays), 2), np.uint32)
  for position, device in np.ndenumerate(mesh.devices):
    by_device[device.id] = table[position]
  return paths, arrays, by_device


def checksums(tree) -> tuple[list, list, np.ndarray]:
  """(paths, arrays, table) of `tree`'s replicated jax.Arrays laid out with a NamedSharding on
  one mesh; `table[device id]` is that device's [num_arrays, 2] checksums (every process gets
  the whole table: a collective that every process must call)."""
  return _read(*_dispatch(tree))


def divergences(tree) -> list[Divergence]:
  """The blocks of `tree`'s replicated arrays whose replicas do not hold the same bits."""
  return _divergences(*checksums(tree))


def _divergences(paths, arrays, table) -> list[Divergence]:
  found = []
  for i, (path, x) in enumerate(zip(paths, arrays)):
    for block, devices in _replica_groups(x.sharding, x.shape):
      copies: dict[tuple, list] = {}
      for d in devices:
        copies.setdefault(tuple(int(v) for v in table[d.id, i]), []).append(
            (d.id, d.process_index))
      if len(copies) > 1:
        groups = sorted(copies.items(), key=lambda kv: (-len(kv[1]), kv[1]))
        found.append(Divergence(path, block, groups))
  return found


def check(tree, step: int | None = None) -> None:
  """Raises ReplicaDivergenceError if any replicated array of `tree` has replicas that differ.

  Call it on every process at the same point (it is a collective)."""
  start_check(tree)(step)


def start_check(tree):
  """Dispatches `check`'s program on `tree` now (call it on every process at the same point: a
  collective) and returns the function that reads its verdict: `verdict(step)` raises
  ReplicaDivergenceError as `check` does. The verdict may be read later, on any thread (the
  table is read, no program is dispatched), so the check's program runs beside other work."""
  dispatched = _dispatch(tree)

  def verdict(step: int | None = None) -> None:
    found = _divergences(*_read(*dispatched))
    if found:
      raise ReplicaDivergenceError(step, found)
  return verdict
