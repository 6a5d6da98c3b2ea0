"""SDP4Bit in the train step: the gradient function and the weight all-gather it plugs in.

With optimizer.dp_comm='sdp4bit' the train state gains `reference`: the full weights every
data-parallel rank reconstructed from the quantized weight differences (the model computes
with these), replicated over 'data' and 'fsdp'. The master weights `params` and the optimizer
state keep their 'fsdp' sharding. One step is then

  loss, grads = gradients(reference, batch)     # local backprop, TLq-HS reduce-scatter
  params      = optimizer(params, grads)        # on the shards, as without SDP4Bit
  reference   = gather(params, reference)       # qWD all-gather

`gradients` and `gather` run inside `jax.shard_map`, manual over 'data' and 'fsdp' (the model
code is unchanged: `mesh.constrain` leaves manual axes out), so XLA adds no collectives of its
own to them. Call them under `jax.set_mesh(mesh)` inside jit.
"""
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from mscale_jax import mesh as mesh_lib
from mscale_jax.config import SDP4BitConfig
from mscale_jax.sdp4bit import collectives
from mscale_jax.sdp4bit.quant import Quantizer

DP_AXES = ("data", "fsdp")
_EXACT = Quantizer(bits=32)


def _is_names(x) -> bool:
  return isinstance(x, (tuple, P))


def fsdp_dims(param_names):
  """Tree like the params: the dimension each leaf shards over 'fsdp', or None."""
  def dim(names):
    for i, axes in enumerate(mesh_lib.logical_to_spec(tuple(names))):
      if axes == "fsdp" or (isinstance(axes, tuple) and "fsdp" in axes):
        return i
    return None
  return jax.tree.map(dim, param_names, is_leaf=_is_names)


class DataParallel:
  """SDP4Bit's collectives for parameters with logical names `param_names` (see module doc)."""

  def __init__(self, config: SDP4BitConfig, param_names):
    self.config = config
    self.dims = fsdp_dims(param_names)
    k = config.kernel
    self.weights = (_EXACT if config.weights == "none"
                    else Quantizer(config.weight_bits, config.weight_group, kernel=k))
    self.intra = (Quantizer(config.grad_bits_intra, config.grad_group, kernel=k)
                  if config.gradients else _EXACT)
    self.inter = (Quantizer(config.grad_bits_inter, config.grad_group, config.hadamard, k)
                  if config.gradients else _EXACT)

  def reference_shardings(self, param_shardings):
    """The reference weights' shardings: the parameters' with 'fsdp' (and 'data') removed."""
    def strip(sharding: NamedSharding) -> NamedSharding:
      spec = P(*(mesh_lib.without_axes(axes, DP_AXES) for axes in sharding.spec))
      return NamedSharding(sharding.mesh, spec)
    return jax.tree.map(strip, param_shardings)

  def gradients(self, value_and_grad):
    """f(reference, batch) -> (mean loss, grads sharded like the params), from
    `value_and_grad(weights, local batch) -> (local loss, local grads)` run per device."""
    dims = self.dims

    def per_device(reference, batch):
      loss, grads = value_and_grad(reference, batch)
      grads = jax.tree.map(
          lambda g, dim: collectives.tlq_reduce_scatter(g, dim, intra=self.intra,
                                                        inter=self.inter), grads, dims)
      return jax.lax.pmean(loss, DP_AXES), grads

    def run(reference, batch):
      specs = _shard_specs(reference, dims)
      return jax.shard_map(per_device, in_specs=(P(), P(DP_AXES)), out_specs=(P(), specs),
                           axis_names=set(DP_AXES), check_vma=False)(reference, batch)
    return run

  def gather(self, params, reference):
    """The new reference weights from the updated `params` shards and the last `reference`."""
    dims, q, mode = self.dims, self.weights, self.config.weights

    def per_device(params, reference):
      return jax.tree.map(lambda p, r, dim: collectives.qwd_all_gather(p, r, dim, q=q,
                                                                       mode=mode),
                          params, reference, dims)

    specs = _shard_specs(params, dims)
    return jax.shard_map(per_device, in_specs=(specs, P()), out_specs=P(),
                         axis_names=set(DP_AXES), check_vma=False)(params, reference)


def _shard_specs(tree, dims):
  """Per-leaf PartitionSpecs over the manual axes: 'fsdp' on each leaf's dimension `dims`."""
  return jax.tree.map(lambda x, dim: P(*("fsdp" if i == dim else None for i in range(x.ndim))),
                      tree, dims)
