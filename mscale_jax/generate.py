"""Text generation from a trained GPT with a key/value cache, on one device.

    prompt [p] -> one call over the whole prompt (prefill) -> one call per new token

Each call runs the model on the new tokens only: every attention layer keeps the keys and
values of earlier positions (`GPT.init_cache`), so a step costs attention over the cached
positions plus the layers' matmuls for one token, and generation is linear in its length.
A sliding-window model keeps only its last `attention_window` positions. Decoding runs the
model's XLA paths (attention, norms, collective matmuls) on a one-device mesh, whatever the
run was trained with; parameters are the same either way.

`restore_params` reads the parameters of a Trainer checkpoint saved on any mesh onto the local
device (orbax reshards on load).
"""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mscale_jax import mesh as mesh_lib
from mscale_jax import optim
from mscale_jax.checkpoint import Checkpointer
from mscale_jax.config import MESH_AXES, Config, ModelConfig
from mscale_jax.errors import ConfigError
from mscale_jax.model import GPT
from mscale_jax.parallel import pipeline


def one_device_mesh(devices=None):
  """A mesh with every axis of size 1 on the first of `devices` (default: jax.devices())."""
  return mesh_lib.make_mesh({axis: 1 for axis in MESH_AXES},
                            list(devices if devices is not None else jax.devices())[:1])


def decoding_config(config: ModelConfig) -> ModelConfig:
  """The same model with the implementation choices decoding uses (XLA paths, no remat)."""
  return dataclasses.replace(config, attention_impl="xla", norm_impl="xla", tp_comm="xla",
                             remat="none")


def build_model(config: ModelConfig, params) -> GPT:
  """A GPT with the given parameters (a pure dict, as the Trainer's state holds them).

  Build it outside any mesh context (its parameters' logical names are not mesh axes), run it
  under `jax.set_mesh(one_device_mesh())`.
  """
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def restore_params(checkpoint_dir: str, step: int | None = None, devices=None):
  """(model config, parameters on one device, step, checkpoint meta) of a Trainer checkpoint.

  Raises:
    ConfigError: the folder holds no complete checkpoint (or not `step`).
  """
  from mscale_jax.checkpoint import abstract_like
  from mscale_jax.model import abstract_model
  if not os.path.isdir(checkpoint_dir):
    raise ConfigError("checkpoint directory", checkpoint_dir, "an existing folder of "
                      "checkpoints written by the Trainer (WORKDIR/checkpoints)")
  checkpointer = Checkpointer(checkpoint_dir, async_save=False)
  try:
    steps = checkpointer.all_steps()
    step = steps[-1] if step is None and steps else step
    if step is None or step not in steps:
      raise ConfigError("checkpoint step", step, f"one of the complete checkpoints in "
                        f"{checkpoint_dir}: {steps or 'none'}")
    meta = checkpointer.restore_meta(step)
    config = Config.from_dict({"model": meta["model"], "optimizer": meta["optimizer"]})
    # The saved state holds the optimizer's moments too; restore them alongside and drop them.
    _, abstract_params, _ = abstract_model(config.model)
    tx = optim.make_optimizer(config.optimizer, meta["train_steps"])
    abstract_state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": abstract_params,
                      "opt_state": jax.eval_shape(tx.init, abstract_params)}
    if checkpointer.dp_comm(step) == "sdp4bit":     # SDP4Bit's reference weights: dropped
      abstract_state["reference"] = abstract_params
    mesh = one_device_mesh(devices)
    replicated = mesh_lib.named_sharding(mesh, ())
    target = abstract_like(abstract_state, jax.tree.map(lambda _: replicated, abstract_state))
    state = checkpointer.restore(step, target)
  finally:
    checkpointer.close()
  # A pipelined run stores its stacked layers in pipeline order: put them back in model order.
  params = pipeline.reorder_layers(state["params"], config.model.num_layers,
                                   tuple(meta.get("layer_layout", (1, 1))), (1, 1))
  return config.model, params, step, meta


def sample_token(logits: jax.Array, key: jax.Array, temperature: jax.Array,
                 top_k: int | None) -> jax.Array:
  """int32 [b] tokens from float32 [b, vocab] logits: argmax at temperature 0, else a draw
  from softmax(logits / temperature) over the `top_k` most likely tokens (None: all)."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  drawn = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6)).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


@dataclasses.dataclass(frozen=True)
class Generation:
  """`tokens`: int32 [prompt + new], the prompt then what was generated; `logits`: float32
  [new, vocab], the logits each new token was chosen from."""
  tokens: np.ndarray
  logits: np.ndarray


def generate(config: ModelConfig, params, prompt, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
             stop_token: int | None = None, devices=None) -> Generation:
  """Continues the int token sequence `prompt` by up to `max_new_tokens` tokens.

  Temperature 0 is greedy (deterministic); otherwise tokens are drawn with `jax.random` from
  key `seed`, among the `top_k` most likely (None: all). Stops early after `stop_token`.
  Two compilations: one for the prompt's length, one for single tokens.

  Raises:
    ConfigError: an empty prompt or a token outside the vocabulary, a bad sampling setting,
      or (learned position embeddings) a total length beyond the model's seq_len.
  """
  prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
  check_request(config, prompt, max_new_tokens, temperature, top_k)
  positions = prompt.size + max_new_tokens - 1       # the last new token is never fed back
  window = config.attention_window
  capacity = positions if window is None else min(window, positions)
  key = jax.random.key(seed)
  model = build_model(decoding_config(config), params)
  with jax.set_mesh(one_device_mesh(devices)):
    model.init_cache(batch=1, capacity=capacity)
    graphdef, state = nnx.split(model)
    tokens, logits = prompt.tolist(), []
    feed = jnp.asarray(prompt[None], jnp.int32)
    for i in range(max_new_tokens):
      state, token, step_logits = _decode_step(graphdef, state, feed,
                                               jax.random.fold_in(key, i),
                                               jnp.float32(temperature), top_k)
      token = int(token[0])
      tokens.append(token)
      logits.append(np.asarray(step_logits[0]))
      if token == stop_token:
        break
      feed = jnp.full((1, 1), token, jnp.int32)
  return Generation(np.asarray(tokens, np.int32), np.stack(logits))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _decode_step(graphdef, state, tokens, key, temperature, top_k):
  """Runs the cached model on `tokens` [1, n]; the next token from the last position."""
  model = nnx.merge(graphdef, state)
  logits = model(tokens)[:, -1]
  return nnx.state(model), sample_token(logits, key, temperature, top_k), logits


def check_request(config: ModelConfig, prompt: np.ndarray, max_new_tokens: int,
                  temperature: float, top_k: int | None) -> None:
  """Raises ConfigError if the prompt or the sampling settings cannot work with `config`."""
  vocab = config.vocab_size
  if prompt.size == 0:
    raise ConfigError("prompt", "(empty)", "at least one token")
  outside = prompt[(prompt < 0) | (prompt >= vocab)]
  if outside.size:
    raise ConfigError("prompt", f"token {int(outside[0])}",
                      f"tokens in [0, {vocab}) (the model's vocabulary)")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
      or max_new_tokens < 1:
    raise ConfigError("max_new_tokens", max_new_tokens, "a positive integer")
  if not temperature >= 0:
    raise ConfigError("temperature", temperature, "a number >= 0 (0: greedy)")
  if top_k is not None and not 1 <= top_k <= vocab:
    raise ConfigError("top_k", top_k, f"None or an integer in [1, {vocab}]")
  if config.positions == "learned" and prompt.size + max_new_tokens - 1 > config.seq_len:
    raise ConfigError("max_new_tokens", max_new_tokens,
                      f"at most {config.seq_len + 1 - prompt.size}: with learned position "
                      f"embeddings the prompt ({prompt.size} tokens) and the new tokens must "
                      f"fit in seq_len={config.seq_len} (+1: the last is never fed back)")
