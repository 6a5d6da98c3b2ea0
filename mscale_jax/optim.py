"""Optimizer factory: AdamW, LAMB (optax) or the fused LAMB kernel, with schedule and clipping.

MegaScale trains with LAMB so that the batch can grow 4x without losing quality (fewer pipeline
bubbles per sample). `make_optimizer` builds, from an `OptimizerConfig`:

  clip_by_global_norm(grad_clip)  ->  adamw | lamb | lamb_fused  (learning rate = make_schedule)

Weight decay skips norms and biases. Given the parameters' logical axis names (`param_names`),
the mask comes from them (`decay_mask_from_names`), and tensors whose first axis is 'layers'
(stacked for scan-over-layers) get one LAMB trust ratio per layer (`stacked_from_names`), as
LAMB's layer-wise adaptation intends; without names, the mask is read from the key paths
(`decay_mask`) and every tensor gets one ratio.
"""
import logging
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from mscale_jax.config import OPTIMIZERS, OptimizerConfig
from mscale_jax.errors import ConfigError

logger = logging.getLogger("mscale_jax")

# Last path names of parameters that never get weight decay (biases, norm scales and offsets).
_NO_DECAY_NAMES = ("bias", "scale", "offset")
# Trailing attribute names that wrap the array itself (nnx.Variable.value) and name nothing.
_WRAPPER_NAMES = ("value", "raw_value")
# Logical axis name of the leading dimension of parameters stacked for scan-over-layers.
LAYERS = "layers"


def make_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Learning rate per step: linear warmup, then cosine decay to `lr * min_lr_ratio`.

  Warmup: step s < warmup_steps gets lr * (s + 1) / warmup_steps, so the first step already
  moves the weights and step warmup_steps - 1 reaches the peak. Then the cosine runs from the
  peak at step warmup_steps to lr * min_lr_ratio at step `total_steps`, and stays there.

  Raises:
    ConfigError: if `total_steps` does not leave room after the warmup.
  """
  peak = float(config.learning_rate)
  end = peak * float(config.min_lr_ratio)
  warmup = int(config.warmup_steps)
  if not isinstance(total_steps, int) or total_steps <= warmup:
    raise ConfigError("total_steps", total_steps,
                      f"an integer larger than optimizer.warmup_steps={warmup}")
  decay_steps = total_steps - warmup

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * jnp.minimum(step + 1.0, max(warmup, 1)) / max(warmup, 1)
    progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
    cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
    return jnp.where(step < warmup, warm, cosine)

  return schedule


def _path_names(path) -> list[str]:
  names = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      names.append(str(key.key))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      names.append(key.name)
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
      continue
    elif isinstance(key, jax.tree_util.SequenceKey):
      continue
    else:
      names.append(str(key))
  while names and names[-1] in _WRAPPER_NAMES:
    names.pop()
  return names


def decays(path, leaf) -> bool:
  """Whether the parameter at key path `path` gets weight decay (see `decay_mask`)."""
  names = _path_names(path)
  if any("norm" in name.lower() for name in names):
    return False
  if names and names[-1].lower() in _NO_DECAY_NAMES:
    return False
  return jnp.ndim(leaf) >= 2


def decay_mask(params):
  """Tree of bools, same structure as `params`: True where weight decay applies.

  Rule, read from each leaf's key path (dict keys and attribute names; an nnx.Variable's
  trailing '.value' is ignored):
    * no decay if any name in the path contains 'norm' (e.g. 'attn_norm', 'final_norm'),
    * no decay if the last name is 'bias', 'scale' or 'offset',
    * otherwise decay if the array has ndim >= 2 (kernels, embeddings), not if 1-D/scalar.
  Names come first because with scan-over-layers a bias is stacked to [layers, dim] (ndim 2);
  a stacked bias not named 'bias' (the model's 'b_*') still decays: pass `param_names` to
  `make_optimizer` to use `decay_mask_from_names` instead.

  Works on plain dicts of arrays and on `nnx.State` (whose leaves sit under Variables).
  """
  return jax.tree_util.tree_map_with_path(decays, params)


def _is_names(x) -> bool:
  return x is None or isinstance(x, (tuple, PartitionSpec))


def stacked_from_names(param_names):
  """Tree of bools like `param_names`: True where the first logical axis is 'layers'.

  `param_names` leaves are tuples (or PartitionSpecs, as `mesh.logical_names` returns) of
  logical axis names, one per array dimension; a None leaf counts as no names.
  """
  return jax.tree.map(lambda names: bool(names) and tuple(names)[0] == LAYERS, param_names,
                      is_leaf=_is_names)


def decay_mask_from_names(param_names):
  """Tree of bools like `param_names`: True where weight decay applies.

  A tensor decays iff it has at least 2 dimensions besides a leading 'layers': matrices and
  embeddings do; biases and norm scales/offsets, stacked ([layers, dim]) or not, do not.
  """
  def decays_by_names(names):
    names = tuple(names or ())
    return len(names) - (bool(names) and names[0] == LAYERS) >= 2
  return jax.tree.map(decays_by_names, param_names, is_leaf=_is_names)


def _per_param(flags, param_names):
  """Callable on a params (or updates) tree: the leaves of `flags` laid out like it.

  Checks that the names fit: as many leaves, and one name per dimension of each array.
  """
  names = jax.tree.leaves(param_names, is_leaf=_is_names)
  values = jax.tree.leaves(flags)

  def resolve(params):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    if len(leaves) != len(names):
      raise ValueError(f"param_names has {len(names)} leaves, the parameters {len(leaves)}")
    for (path, leaf), leaf_names in zip(leaves, names):
      if len(tuple(leaf_names or ())) != jnp.ndim(leaf):
        raise ValueError(f"param_names{jax.tree_util.keystr(path)} = {leaf_names} does not "
                         f"name the {jnp.ndim(leaf)} dimensions of the parameter")
    return jax.tree.unflatten(treedef, values)

  return resolve


def scale_by_layerwise_trust_ratio(stacked=None) -> optax.GradientTransformation:
  """`optax.scale_by_trust_ratio()`, with one ratio per slice of axis 0 of stacked tensors.

  `stacked`: tree of bools like the params, or a callable on them; None: nothing stacked (then
  this is exactly `optax.scale_by_trust_ratio()`).
  """
  base = optax.scale_by_trust_ratio()

  def scale(update, param):
    return base.update(update, base.init(param), param)[0]

  def update_fn(updates, state, params=None):
    if stacked is None or params is None:
      return base.update(updates, state, params)
    flags = stacked(updates) if callable(stacked) else stacked
    updates = jax.tree.map(lambda flag, u, p: jax.vmap(scale)(u, p) if flag else scale(u, p),
                           flags, updates, params)
    return updates, state

  return optax.GradientTransformation(base.init, update_fn)


def _lamb(schedule, b1, b2, eps, weight_decay, mask, stacked) -> optax.GradientTransformation:
  """`optax.lamb`'s chain with a per-layer trust ratio for stacked tensors."""
  return optax.chain(
      optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=0.0),
      optax.add_decayed_weights(weight_decay=weight_decay, mask=mask),
      scale_by_layerwise_trust_ratio(stacked),
      optax.scale_by_learning_rate(schedule),
  )


def _base_optimizer(config: OptimizerConfig, schedule, param_names,
                    param_shardings) -> optax.GradientTransformation:
  mask, stacked = decay_mask, None
  if param_names is not None:
    mask = _per_param(decay_mask_from_names(param_names), param_names)
    stacks = stacked_from_names(param_names)
    if any(jax.tree.leaves(stacks)):
      stacked = _per_param(stacks, param_names)
  common = dict(b1=config.b1, b2=config.b2, eps=config.eps,
                weight_decay=config.weight_decay, mask=mask)
  if config.name == "adamw":
    logger.info("optimizer: optax.adamw (XLA)")
    return optax.adamw(schedule, **common)
  if config.name == "lamb":
    logger.info("optimizer: optax.lamb (XLA)%s",
                ", one trust ratio per layer of stacked tensors" if stacked else "")
    return _lamb(schedule, stacked=stacked, **common)
  if config.name == "lamb_fused":
    from pallas_kernels import lamb as lamb_kernel
    logger.info("optimizer: pallas_kernels.lamb.fused_lamb (Pallas; backend chosen per "
                "parameter platform on first update)")
    return lamb_kernel.fused_lamb(schedule, stacked=stacked, shardings=param_shardings,
                                  **common)
  raise ConfigError("optimizer.name", config.name,
                    f"one of {', '.join(map(repr, OPTIMIZERS))}")


def make_optimizer(config: OptimizerConfig, total_steps: int, *, param_names=None,
                   param_shardings=None) -> optax.GradientTransformation:
  """Global-norm clipping chained before AdamW / LAMB / fused LAMB on `make_schedule`.

  `update(grads, state, params)` needs `params` (weight decay, trust ratio). `grad_clip=None`
  disables clipping. `param_names` (a tree like the params of logical-name tuples, e.g. from
  `mesh.logical_names`) sets the weight-decay mask and which tensors are stacked layers (see
  `decay_mask_from_names`, `stacked_from_names`); without it, `decay_mask` and no stacking.
  `param_shardings` (a tree of NamedSharding like the params) matters only for 'lamb_fused': its
  Pallas kernel runs per shard (see `pallas_kernels.lamb.fused_lamb`); without it, sharded
  parameters would be gathered for the kernel.

  Raises:
    ConfigError: unknown `config.name`, or `total_steps` not beyond the warmup.
    ValueError (on the first update): `param_names` does not fit the parameters.
  """
  if config.name not in OPTIMIZERS:
    raise ConfigError("optimizer.name", config.name,
                      f"one of {', '.join(map(repr, OPTIMIZERS))}")
  schedule = make_schedule(config, total_steps)
  parts = []
  if config.grad_clip is not None:
    parts.append(optax.clip_by_global_norm(float(config.grad_clip)))
  parts.append(_base_optimizer(config, schedule, param_names, param_shardings))
  return optax.chain(*parts)
