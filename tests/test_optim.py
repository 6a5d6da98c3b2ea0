"""mscale_jax.optim: schedule, clipping, weight-decay mask, optimizer choice."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mscale_jax import optim
from mscale_jax.config import OptimizerConfig
from mscale_jax.errors import ConfigError


class _Block(nnx.Module):

  def __init__(self, rngs):
    self.attn_norm = nnx.LayerNorm(8, rngs=rngs)
    self.qkv = nnx.Linear(8, 24, rngs=rngs)
    self.w_out = nnx.Param(jax.random.normal(rngs.params(), (3, 8, 8)))   # stacked kernel
    self.b_out = nnx.Param(jax.random.normal(rngs.params(), (3, 8)))      # not a bias by name


class _Model(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.blocks = _Block(rngs)
    self.final_norm = nnx.RMSNorm(8, rngs=rngs)


SHAPES = {"embed": {"embedding": (16, 8)},
          "blocks": {"attn_norm": {"scale": (3, 8), "offset": (3, 8)},
                     "qkv": {"kernel": (3, 8, 24), "bias": (3, 24)},
                     "w_qkv": {"kernel": (8, 24)}},
          "head": {"bias": (5,)}, "temperature": ()}


def _random_tree(seed, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def test_decay_mask_plain_dict_with_stacked_biases():
  mask = optim.decay_mask(_random_tree(0))
  assert mask == {"embed": {"embedding": True},
                  "blocks": {"attn_norm": {"scale": False, "offset": False},
                             "qkv": {"kernel": True, "bias": False},
                             "w_qkv": {"kernel": True}},
                  "head": {"bias": False}, "temperature": False}


@pytest.fixture(scope="module")
def nnx_state():
  return nnx.state(_Model(nnx.Rngs(0)), nnx.Param)


def test_decay_mask_nnx_state(nnx_state):
  state = nnx_state
  mask = optim.decay_mask(state)
  flat = {tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path): value
          for path, value in jax.tree_util.tree_flatten_with_path(mask)[0]}
  assert flat == {
      ("blocks", "attn_norm", "bias", "value"): False,
      ("blocks", "attn_norm", "scale", "value"): False,
      ("blocks", "b_out", "value"): True,
      ("blocks", "qkv", "bias", "value"): False,
      ("blocks", "qkv", "kernel", "value"): True,
      ("blocks", "w_out", "value"): True,
      ("embed", "embedding", "value"): True,
      ("final_norm", "scale", "value"): False,
  }


def test_optimizer_runs_on_nnx_state_and_skips_decay_on_norms(nnx_state):
  state = nnx_state
  config = OptimizerConfig(name="adamw", weight_decay=0.5, grad_clip=None, warmup_steps=0)
  tx = optim.make_optimizer(config, total_steps=10)
  zeros = jax.tree.map(jnp.zeros_like, state)
  updates, _ = tx.update(zeros, tx.init(state), state)
  # Zero gradients: the update is pure weight decay, so only decayed leaves move.
  assert np.all(np.asarray(updates["final_norm"]["scale"][...]) == 0)
  assert np.all(np.asarray(updates["blocks"]["qkv"]["bias"][...]) == 0)
  assert np.all(np.asarray(updates["embed"]["embedding"][...]) != 0)


def test_schedule_warmup_then_cosine():
  config = OptimizerConfig(learning_rate=1e-3, warmup_steps=4, min_lr_ratio=0.1)
  schedule = optim.make_schedule(config, total_steps=20)
  values = np.array([float(schedule(s)) for s in range(25)])
  np.testing.assert_allclose(values[:4], 1e-3 * np.arange(1, 5) / 4, rtol=1e-6)
  np.testing.assert_allclose(values[4], 1e-3, rtol=1e-6)
  np.testing.assert_allclose(values[12], 1e-4 + 0.9e-3 * 0.5, rtol=1e-5)   # half-way
  np.testing.assert_allclose(values[20:], 1e-4, rtol=1e-6)
  assert np.all(np.diff(values[4:21]) < 0)


def test_schedule_rejects_too_few_steps():
  with pytest.raises(ConfigError, match="total_steps"):
    optim.make_schedule(OptimizerConfig(warmup_steps=10), total_steps=10)


def test_unknown_name_raises_config_error():
  with pytest.raises(ConfigError, match="optimizer.name"):
    optim.make_optimizer(OptimizerConfig(name="sgd"), total_steps=10)


def _run_steps(tx, params, grads_seq):
  @jax.jit
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for grads in grads_seq:
    params, state = step(grads, state, params)
  return params


def test_lamb_matches_optax_lamb():
  config = OptimizerConfig(name="lamb", weight_decay=0.01, grad_clip=None, warmup_steps=2)
  params = _random_tree(1)
  grads_seq = [_random_tree(10 + i) for i in range(3)]
  ours = _run_steps(optim.make_optimizer(config, total_steps=8), params, grads_seq)
  reference = optax.lamb(optim.make_schedule(config, 8), b1=config.b1, b2=config.b2,
                         eps=config.eps, weight_decay=config.weight_decay,
                         mask=optim.decay_mask)
  expected = _run_steps(reference, params, grads_seq)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-7, atol=0)


def test_clipping_is_applied_before_the_optimizer():
  params = {"w": jnp.ones((4, 4))}
  grads = {"w": 100.0 * jax.random.normal(jax.random.key(2), (4, 4))}
  base = dataclasses.replace(OptimizerConfig(), name="adamw", weight_decay=0.0, warmup_steps=0)
  clipped = optim.make_optimizer(dataclasses.replace(base, grad_clip=1.0), total_steps=10)
  unclipped = optim.make_optimizer(dataclasses.replace(base, grad_clip=None), total_steps=10)
  state = clipped.init(params)
  _, state = clipped.update(grads, state, params)
  # The first moment after one step is (1 - b1) * clipped gradient, of global norm 1.
  mu = state[1][0].mu["w"]
  np.testing.assert_allclose(float(jnp.linalg.norm(mu)), 1.0 - base.b1, rtol=1e-5)
  _, state = unclipped.update(grads, unclipped.init(params), params)
  assert float(jnp.linalg.norm(state[0][0].mu["w"])) > 10.0


def test_logs_the_chosen_implementation(caplog):
  with caplog.at_level(logging.INFO, logger="mscale_jax"):
    optim.make_optimizer(OptimizerConfig(name="lamb"), total_steps=20)
  assert "optax.lamb" in caplog.text


def test_lamb_fused_matches_lamb():
  config = OptimizerConfig(name="lamb", weight_decay=0.01, grad_clip=1.0, warmup_steps=2)
  shapes = {"norm": {"scale": (8,)}, "w": {"kernel": (3, 8, 24), "bias": (3, 24)}}
  params = _random_tree(3, shapes)
  grads_seq = [_random_tree(20 + i, shapes) for i in range(2)]
  expected = _run_steps(optim.make_optimizer(config, 8), params, grads_seq)
  fused = optim.make_optimizer(dataclasses.replace(config, name="lamb_fused"), 8)
  ours = _run_steps(fused, params, grads_seq)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# --- logical names: weight-decay mask, stacked layers and one trust ratio per layer ---------

NAMED_SHAPES = {"blocks": {"w_in": (3, 8, 16), "b_in": (3, 16), "scale": (3, 8)},
                "embed": (16, 8), "final_norm": {"scale": (8,)}}
NAMES = {"blocks": {"w_in": ("layers", "embed", "mlp"), "b_in": ("layers", "mlp"),
                    "scale": ("layers", "act_embed")},
         "embed": ("vocab", "embed"), "final_norm": {"scale": ("act_embed",)}}
# Layers of very different scales: a ratio shared by the layers would be wrong for most.
LAYER_SCALES = np.array([1e-2, 1.0, 1e2])


def _named_tree(seed, scale=1.0):
  tree = _random_tree(seed, NAMED_SHAPES)
  tree["blocks"] = jax.tree.map(
      lambda x: scale * x * LAYER_SCALES.reshape((-1,) + (1,) * (x.ndim - 1)), tree["blocks"])
  tree["embed"] = scale * tree["embed"]
  return tree


def _sliced(tree):
  """The stacked 'blocks' leaves split into one leaf per layer: LAMB's unit of adaptation."""
  blocks = {f"{k}/{i}": x[i] for k, x in tree["blocks"].items() for i in range(x.shape[0])}
  return {**tree, "blocks": blocks}


def test_masks_from_hand_built_names():
  assert optim.decay_mask_from_names(NAMES) == {
      "blocks": {"w_in": True, "b_in": False, "scale": False}, "embed": True,
      "final_norm": {"scale": False}}
  assert optim.stacked_from_names(NAMES) == {
      "blocks": {"w_in": True, "b_in": True, "scale": True}, "embed": False,
      "final_norm": {"scale": False}}


def test_masks_from_real_model_names():
  from mscale_jax.config import ModelConfig
  from mscale_jax.model import abstract_model
  _, params, names = abstract_model(ModelConfig(num_layers=3, hidden=32, num_heads=4,
                                                mlp_dim=64, seq_len=16))
  flat = lambda tree: {jax.tree_util.keystr(path): value for path, value
                       in jax.tree_util.tree_flatten_with_path(tree)[0]}
  decay = flat(optim.decay_mask_from_names(names))
  stacked = flat(optim.stacked_from_names(names))
  assert decay.keys() == stacked.keys() == flat(params).keys()
  assert len(decay) == 15
  assert {k for k, v in decay.items() if v} == {
      "['blocks']['attn']['w_qkv']", "['blocks']['attn']['w_o']", "['blocks']['mlp']['w_in']",
      "['blocks']['mlp']['w_out']", "['embed']", "['pos_embed']", "['unembed']"}
  assert {k for k, v in stacked.items() if v} == {k for k in stacked
                                                   if k.startswith("['blocks']")}


def test_stacked_layers_get_their_own_trust_ratio():
  config = OptimizerConfig(weight_decay=0.05, grad_clip=1.0, warmup_steps=1)
  params = _named_tree(1)
  grads_seq = [_named_tree(30 + i, scale=0.1) for i in range(2)]
  lamb = lambda mask: optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.lamb(optim.make_schedule(config, 8), b1=config.b1, b2=config.b2, eps=config.eps,
                 weight_decay=config.weight_decay, mask=mask))
  # Reference: clipping + optax.lamb with each layer slice a separate tensor.
  mask = jax.tree.map(lambda x: x.ndim >= 2, _sliced(params))   # matrices of each layer
  expected = _run_steps(lamb(mask), _sliced(params), [_sliced(g) for g in grads_seq])
  # The old behaviour: one ratio per stacked leaf, as optax.lamb gives on the stacked tree.
  shared = _run_steps(lamb(optim.decay_mask_from_names(NAMES)), params, grads_seq)
  rel_err = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
  for name in ("lamb", "lamb_fused"):
    tx = optim.make_optimizer(dataclasses.replace(config, name=name), 8, param_names=NAMES)
    ours = _run_steps(tx, params, grads_seq)
    assert rel_err(ours["embed"], expected["embed"]) < 1e-6, name
    np.testing.assert_allclose(ours["final_norm"]["scale"], expected["final_norm"]["scale"],
                               rtol=1e-6)
    for key, stacked in ours["blocks"].items():
      for i in range(stacked.shape[0]):
        assert rel_err(stacked[i], expected["blocks"][f"{key}/{i}"]) < 1e-6, (name, key, i)
  for key, stacked in params["blocks"].items():
    step_errors = [rel_err(shared["blocks"][key][i] - stacked[i],
                           expected["blocks"][f"{key}/{i}"] - stacked[i])
                   for i in range(stacked.shape[0])]
    assert max(step_errors) > 1.0, (key, step_errors)


def test_without_stacked_leaves_lamb_is_optax_lamb_with_names_mask():
  config = OptimizerConfig(name="lamb", weight_decay=0.01, grad_clip=None, warmup_steps=2)
  names = {"w": ("embed", "mlp"), "b": ("mlp",)}
  params = _random_tree(4, {"w": (8, 16), "b": (16,)})
  grads_seq = [_random_tree(40 + i, {"w": (8, 16), "b": (16,)}) for i in range(2)]
  ours = _run_steps(optim.make_optimizer(config, 8, param_names=names), params, grads_seq)
  reference = optax.lamb(optim.make_schedule(config, 8), b1=config.b1, b2=config.b2,
                         eps=config.eps, weight_decay=config.weight_decay,
                         mask={"w": True, "b": False})
  expected = _run_steps(reference, params, grads_seq)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-7, atol=0)


def test_names_that_do_not_fit_the_params_raise():
  tx = optim.make_optimizer(OptimizerConfig(name="lamb"), 20,
                            param_names={"w": ("layers", "embed")})
  params = {"w": jnp.ones((2, 3, 4))}
  with pytest.raises(ValueError, match="dimensions"):
    tx.update(params, tx.init(params), params)


@pytest.mark.slow
def test_real_model_names_and_shardings_on_a_mesh():
  # What the trainer does: names and shardings from the model, a 2 x 4 (data x tensor) mesh.
  from mscale_jax import mesh as mesh_lib
  from mscale_jax.config import ModelConfig
  from mscale_jax.model import abstract_model
  _, abstract, names = abstract_model(ModelConfig(num_layers=2, hidden=32, num_heads=4,
                                                  mlp_dim=64, seq_len=16))
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 1, "stage": 1, "tensor": 4})
  shardings = mesh_lib.shardings_for(mesh, names)
  rng = np.random.default_rng(0)
  draw = lambda: jax.device_put(jax.tree.map(
      lambda x: rng.standard_normal(x.shape).astype(np.float32), abstract), shardings)
  params, grads = draw(), draw()
  config = OptimizerConfig(warmup_steps=1)
  results = {}
  for name in ("lamb", "lamb_fused"):
    tx = optim.make_optimizer(dataclasses.replace(config, name=name), 10, param_names=names,
                              param_shardings=shardings)
    results[name], _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
  for (path, a), b, s in zip(jax.tree_util.tree_flatten_with_path(results["lamb_fused"])[0],
                             jax.tree.leaves(results["lamb"]), jax.tree.leaves(shardings)):
    assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) < 1e-6, path
    assert a.sharding.is_equivalent_to(s, a.ndim), path
    assert b.sharding.is_equivalent_to(s, b.ndim), path
