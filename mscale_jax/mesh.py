"""The device mesh and the one table that maps logical axis names to mesh axes.

The model names every parameter and activation dimension logically ('batch', 'embed', 'heads',
...). `LOGICAL_RULES` below is the only place that says which mesh axis shards which logical
dimension: batch over (data, fsdp); parameters over fsdp on their 'embed' dimension and,
Megatron-style, over tensor on 'heads' / 'mlp' / 'vocab'; activations between blocks over tensor
on the sequence ('seq_sp', sequence parallelism).

The mesh uses `AxisType.Auto` axes: XLA propagates shardings from the parameter layouts and the
constraints the model places. Only the tensor-parallel region (`parallel/tensor.py`) and custom
kernels (`per_shard`) are written per device, inside `jax.shard_map` with every axis manual.
"""
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mscale_jax.config import MESH_AXES

BATCH_AXES = ("data", "fsdp")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,   # examples
    "seq": None,           # full sequence (inside the tensor-parallel region)
    "seq_sp": "tensor",    # sequence-parallel activations between blocks
    "act_embed": None,     # hidden dimension of activations
    "embed": "fsdp",       # hidden dimension of parameters (ZeRO/FSDP sharding)
    "heads": "tensor",     # attention heads (column-parallel QKV, row-parallel output)
    "mlp": "tensor",       # MLP hidden units
    "vocab": "tensor",     # embedding rows / logits
    "head_dim": None,
    "layers": "stage",     # stacked layers of scanned parameters (1 stage until PP lands)
    "positions": None,
}

# Activations between blocks: batch over (data, fsdp), sequence over 'tensor'. The model
# constrains its residual stream to this, and the pipeline executor its stage buffers.
RESIDUAL = ("batch", "seq_sp", "act_embed")


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with axes (data, fsdp, stage, tensor) of the given sizes over `devices`.

  `tensor` is the last axis, and `jax.make_mesh` lays axes out by the physical topology, so
  tensor-parallel groups are the most closely connected devices (NVLink, ICI neighbours).
  """
  sizes = tuple(shape[axis] for axis in MESH_AXES)
  devices = list(devices if devices is not None else jax.devices())[:int(np.prod(sizes))]
  return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def logical_to_spec(names: Sequence[str | None] | None) -> P:
  """PartitionSpec for a tuple of logical dimension names (None: replicated dimension)."""
  if names is None:
    return P()
  return P(*(LOGICAL_RULES[name] if name is not None else None for name in names))


def named_sharding(mesh: Mesh, names: Sequence[str | None] | None) -> NamedSharding:
  """NamedSharding on `mesh` for logical dimension `names` (() or None: replicated)."""
  return NamedSharding(mesh, logical_to_spec(names))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Asks XLA to lay `x` out as its logical `names` say (inside jit, under `jax.set_mesh`).

  Inside `jax.shard_map` the manual axes are left out of the layout: there each device
  already holds its own block along them (e.g. SDP4Bit's data-parallel region).
  """
  spec = P(*map(auto_axes, logical_to_spec(names)))
  return jax.lax.with_sharding_constraint(x, spec)


def auto_axes(axes):
  """A PartitionSpec entry (e.g. BATCH_AXES) without the axes that are manual here: inside
  `jax.shard_map` a nested per-device region names only the axes still left to it."""
  return without_axes(axes, jax.sharding.get_abstract_mesh().manual_axes)


def without_axes(axes, dropped):
  """A PartitionSpec entry with the `dropped` mesh axes removed (None when none are left)."""
  if axes is None:
    return None
  kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in dropped)
  return kept[0] if len(kept) == 1 else (kept or None)


def logical_names(abstract_state):
  """Pure dict of each Variable's logical names, from an `nnx.State` with sharding metadata."""
  from flax import nnx
  return nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))


def shardings_for(mesh: Mesh, names_tree):
  """NamedShardings for a tree whose leaves are logical-name tuples (or PartitionSpecs)."""
  return jax.tree.map(lambda names: named_sharding(mesh, tuple(names)), names_tree,
                      is_leaf=lambda x: isinstance(x, (tuple, P)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of a [batch, seq] token batch: rows over (data, fsdp), sequence whole."""
  return named_sharding(mesh, ("batch", None))


def process_rows(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
  """(first, end) of the contiguous global batch rows this process's devices hold.

  With the batch over (data, fsdp) and process-major device order, these are this process's
  data-parallel rows; processes that share a batch shard (tensor parallelism across
  processes) get the same rows.
  """
  indices = sharding.addressable_devices_indices_map((global_batch, 1)).values()
  spans = sorted({(i[0].start or 0, global_batch if i[0].stop is None else i[0].stop)
                  for i in indices})
  for (_, end), (start, _) in zip(spans, spans[1:]):
    if start != end:
      raise ValueError(f"this process's batch rows {spans} are not contiguous")
  return spans[0][0], spans[-1][1]


def per_shard(fn, *, in_names, out_names):
  """Runs `fn` on each device's shard of its arguments, laid out by logical names.

  For custom kernels (Pallas, cuDNN) that XLA cannot partition: every mesh axis is manual, so
  `fn` sees local blocks. `fn` must need no communication across the sharded dimensions.
  """
  def spec_tree(names):
    return logical_to_spec(names) if _is_names(names) else tuple(map(spec_tree, names))
  return jax.shard_map(fn, in_specs=spec_tree(in_names), out_specs=spec_tree(out_names),
                       check_vma=False)


def _is_names(names) -> bool:
  return isinstance(names, tuple) and all(n is None or isinstance(n, str) for n in names)


def shard_shape(shape: Sequence[int], names: Sequence[str | None],
                mesh_shape: dict[str, int]) -> tuple[int, ...]:
  """The per-device block of an array of `shape` laid out by logical `names` on a mesh shape."""
  out = []
  for size, axes in zip(shape, logical_to_spec(names)):
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    out.append(-(-size // int(np.prod([mesh_shape[a] for a in axes]))))
  return tuple(out)
