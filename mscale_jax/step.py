"""The train step as a pure function: one optimizer update of the train state on one batch.

The train state is a plain pytree `{'step', 'params', 'opt_state'}` (and 'reference' with
SDP4Bit, see `mscale_jax/sdp4bit/data_parallel.py`): `params` is the model's
`nnx.Param` state as a pure dict (merged back into the NNX model inside the step), and the
optimizer state is sharded exactly like the parameters. The Trainer jits `train_step` with the
gradient function its configuration asks for (`make_gradients`: plain backpropagation, or the
pipeline executor over `stage`); a new way to compute gradients (say, with compressed
collectives) is one more branch there, and the loop and its callbacks stay as they are.
"""
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mscale_jax.config import PipelineConfig
from mscale_jax.parallel import pipeline


def loss_fn(params, graphdef, batch) -> jax.Array:
  """Mean next-token cross-entropy of `batch` {'inputs', 'targets': int32 [b, s]} (and
  'segment_ids' [b, s] under data.document_mask: attention stays within documents)."""
  model = nnx.merge(graphdef, params)
  logits = model(batch["inputs"], batch.get("segment_ids"))
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_gradients(graphdef, pipeline_config: PipelineConfig, layer_layout: tuple[int, int],
                   data_parallel=None):
  """f(params, batch) -> (loss, grads) for this layout: backpropagation through the whole
  model, or the pipeline schedule when `layer_layout` = (stages, virtual) has stages > 1
  (params in that layout's layer order), or, given `data_parallel` (an
  `sdp4bit.DataParallel`), backpropagation per device with SDP4Bit's quantized gradient
  reduction (then f takes the reference weights)."""
  if data_parallel is not None:
    return data_parallel.gradients(
        lambda weights, batch: jax.value_and_grad(lambda p: loss_fn(p, graphdef, batch))(weights))
  stages, virtual = layer_layout
  if stages > 1:
    p = pipeline_config

    def pipelined(params, batch):
      return pipeline.value_and_grad(params, graphdef, batch, schedule=p.schedule,
                                     stages=stages, virtual=virtual,
                                     microbatches=p.microbatches, overlap=p.overlap)
    return pipelined

  def plain(params, batch):
    return jax.value_and_grad(lambda p: loss_fn(p, graphdef, batch))(params)
  return plain


def train_step(state, batch, *, gradients, tx: optax.GradientTransformation, schedule,
               gather=None):
  """(new state, metrics {'loss', 'grad_norm', 'finite', 'learning_rate'}) of one step.

  A step whose loss or gradient norm is not finite applies no update, so no state (and no
  checkpoint) ever holds one; `train.on_nonfinite` decides on the host what happens next.
  With `gather` (SDP4Bit's weight all-gather), the gradients are taken at the state's
  'reference' weights and the new reference is gathered from the updated parameters.
  """
  weights = state["params"] if gather is None else state["reference"]
  loss, grads = gradients(weights, batch)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                   (params, opt_state), (state["params"], state["opt_state"]))
  metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite,
             "learning_rate": schedule(state["step"])}
  new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
  if gather is not None:
    new_state["reference"] = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                          gather(params, state["reference"]),
                                          state["reference"])
  return new_state, metrics
