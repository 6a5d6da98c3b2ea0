"""pallas_kernels.lamb.fused_lamb against optax.lamb (Pallas interpreter on CPU)."""
import contextlib
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_kernels.lamb import fused_lamb, lamb_step

# Scalar, odd 1-D, 2-D over several 128-lane rows with a partial last block, 3-D, 128-aligned.
SHAPES = {"scale": (), "bias": (37,), "w": (33, 65), "stack": (3, 4, 5), "embed": (40, 128)}


def _tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {name: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
          for name, shape in SHAPES.items()}


def _rel_err(a, b):
  """max |a - b| / max |b|: relative to the tensor's scale, robust to entries near zero."""
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _compare(reference, fused, steps=3, jit=True):
  params_r = params_f = _tree(0)
  state_r, state_f = reference.init(params_r), fused.init(params_f)
  update_r = jax.jit(reference.update)
  update_f = jax.jit(fused.update) if jit else fused.update
  for step in range(steps):
    grads = _tree(100 + step, scale=0.1)
    updates_r, state_r = update_r(grads, state_r, params_r)
    updates_f, state_f = update_f(grads, state_f, params_f)
    for name in SHAPES:
      assert _rel_err(updates_f[name], updates_r[name]) < 1e-6, (step, name)
    params_r = optax.apply_updates(params_r, updates_r)
    params_f = optax.apply_updates(params_f, updates_f)
  for name in SHAPES:
    assert _rel_err(params_f[name], params_r[name]) < 1e-6, name
  adam_r = state_r[0]
  assert int(state_f.count) == int(adam_r.count) == steps
  for name in SHAPES:
    assert _rel_err(state_f.mu[name], adam_r.mu[name]) < 1e-6
    assert _rel_err(state_f.nu[name], adam_r.nu[name]) < 1e-6


def test_matches_optax_lamb_with_mask_weight_decay_and_schedule():
  schedule = optax.warmup_cosine_decay_schedule(1e-3, 1e-2, 2, 10, 2e-3)
  mask = {name: len(shape) >= 2 for name, shape in SHAPES.items()}
  kwargs = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05, mask=mask)
  _compare(optax.lamb(schedule, **kwargs),
           fused_lamb(schedule, interpret=True, block_rows=8, **kwargs))


def test_matches_optax_lamb_defaults_callable_mask_eps_root():
  mask_fn = lambda params: {name: name != "bias" for name in params}
  kwargs = dict(eps_root=1e-8, weight_decay=0.01, mask=mask_fn)
  _compare(optax.lamb(3e-3, **kwargs), fused_lamb(3e-3, interpret=True, **kwargs), steps=1,
           jit=False)


def test_trust_ratio_is_one_for_zero_params():
  params = {"zero": jnp.zeros((4, 8))}
  grads = {"zero": jax.random.normal(jax.random.key(1), (4, 8))}
  reference, fused = optax.lamb(1e-2), fused_lamb(1e-2, interpret=True)
  expected, _ = reference.update(grads, reference.init(params), params)
  ours, _ = fused.update(grads, fused.init(params), params)
  np.testing.assert_allclose(ours["zero"], expected["zero"], rtol=1e-6)


def test_lamb_step_partial_sums_cover_every_row():
  # 1000 rows of 128 lanes in blocks of 64: the last block is partial and must be masked.
  keys = jax.random.split(jax.random.key(2), 4)
  g, m, p = (jax.random.normal(k, (1000, 128)) for k in keys[:3])
  v = jnp.abs(jax.random.normal(keys[3], (1000, 128)))
  _, _, u, psq, usq = lamb_step(g, m, v, p, 0.5, 0.25, 0.1, b1=0.9, b2=0.999, eps=1e-6,
                                eps_root=0.0, interpret=True, block_rows=64)
  np.testing.assert_allclose(psq, jnp.sum(p * p), rtol=1e-5)
  np.testing.assert_allclose(usq, jnp.sum(u * u), rtol=1e-5)


def test_update_without_params_raises():
  fused = fused_lamb(1e-3, interpret=True)
  params = _tree(0)
  with pytest.raises(ValueError, match="params"):
    fused.update(params, fused.init(params))


def test_sharded_params_match_optax_lamb():
  # conftest gives 8 CPU devices: a 2 x 4 mesh, tensors sharded on one or both axes.
  mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  P = jax.sharding.PartitionSpec
  specs = {"bias": P(), "w": P("data", "tensor"), "embed": P(("data", "tensor"), None)}
  shapes = {"bias": (37,), "w": (32, 64), "embed": (40, 128)}
  shardings = {k: jax.sharding.NamedSharding(mesh, s) for k, s in specs.items()}
  keys = jax.random.split(jax.random.key(4), 2 * len(shapes))
  params = {k: jax.device_put(jax.random.normal(keys[i], s), shardings[k])
            for i, (k, s) in enumerate(shapes.items())}
  grads = {k: jax.device_put(jax.random.normal(keys[-1 - i], s), shardings[k])
           for i, (k, s) in enumerate(shapes.items())}
  kwargs = dict(weight_decay=0.1, mask={k: len(s) >= 2 for k, s in shapes.items()})
  reference = optax.lamb(1e-2, **kwargs)
  fused = fused_lamb(1e-2, interpret=True, shardings=shardings, **kwargs)
  expected, _ = jax.jit(reference.update)(grads, reference.init(params), params)
  ours, state = jax.jit(fused.update)(grads, fused.init(params), params)
  for name in shapes:
    assert _rel_err(ours[name], expected[name]) < 1e-6, name
    assert ours[name].sharding.is_equivalent_to(shardings[name], len(shapes[name])), name


@pytest.mark.parametrize("platform,backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_lowers_for_accelerators(monkeypatch, cuda_target, platform, backend):
  # Lowering (not compiling) checks block shapes, power-of-two sizes and primitive support.
  from jax import export
  from pallas_kernels import lamb
  monkeypatch.setattr(lamb, "_backend", lambda x, interpret: backend)
  params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in SHAPES.items()}
  params["big"] = jax.ShapeDtypeStruct((4096, 640), jnp.float32)
  params["layers"] = jax.ShapeDtypeStruct((3, 1024, 640), jnp.float32)
  tx = fused_lamb(1e-3, weight_decay=0.1,
                  stacked=lambda tree: {name: name in ("stack", "layers") for name in tree})
  step = lambda grads, params: tx.update(grads, tx.init(params), params)
  checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
            export.DisabledSafetyCheck.custom_call("tpu_custom_call")]
  with cuda_target if platform == "cuda" else contextlib.nullcontext():
    exported = export.export(jax.jit(step), platforms=[platform],
                             disabled_checks=checks)(params, params)
  assert "custom_call" in exported.mlir_module()


# Stacked tensors (layers on axis 0) whose layers differ in scale by 10^4: one trust ratio each.
STACKED = {"w": (3, 33, 65), "b": (3, 37), "tiny": (2, 5, 7)}
LAYER_SCALES = {"w": [1e-2, 1.0, 1e2], "b": [1.0, 1e-2, 10.0], "tiny": [1.0, 50.0]}


def _stacked_tree(seed, scale=1.0, shapes=STACKED):
  rng = np.random.default_rng(seed)
  return {name: jnp.asarray(scale * rng.standard_normal(shape)
                            * np.reshape(LAYER_SCALES[name], (-1,) + (1,) * (len(shape) - 1)),
                            jnp.float32)
          for name, shape in shapes.items()}


def _slices(tree):
  """Each stacked tensor as separate per-layer tensors: what LAMB per layer means."""
  return {f"{name}/{i}": x[i] for name, x in tree.items() for i in range(x.shape[0])}


def _unslice(flat, like):
  return {name: jnp.stack([flat[f"{name}/{i}"] for i in range(x.shape[0])])
          for name, x in like.items()}


def _per_slice_lamb(learning_rate, params, grads_seq, **kwargs):
  """optax.lamb run on the layer slices of `params`: the per-layer reference."""
  tx = optax.lamb(learning_rate, **kwargs)
  flat = _slices(params)
  state = tx.init(flat)
  for grads in grads_seq:
    updates, state = jax.jit(tx.update)(_slices(grads), state, flat)
    flat = optax.apply_updates(flat, updates)
  return _unslice(flat, params)


@pytest.mark.slow
def test_stacked_tensors_get_one_trust_ratio_per_layer():
  params = _stacked_tree(0)
  grads_seq = [_stacked_tree(100 + i, scale=0.1) for i in range(2)]
  kwargs = dict(weight_decay=0.05)
  mask = lambda tree: {name: name != "b" and "b/" not in name for name in tree}
  expected = _per_slice_lamb(1e-2, params, grads_seq, mask=mask, **kwargs)
  fused = fused_lamb(1e-2, interpret=True, block_rows=8, mask=mask,
                     stacked={name: True for name in STACKED}, **kwargs)
  ours, state = params, fused.init(params)
  for grads in grads_seq:
    updates, state = jax.jit(fused.update)(grads, state, ours)
    ours = optax.apply_updates(ours, updates)
  shared_tx = optax.lamb(1e-2, mask=mask, **kwargs)
  shared, state = params, shared_tx.init(params)
  for grads in grads_seq:
    updates, state = jax.jit(shared_tx.update)(grads, state, shared)
    shared = optax.apply_updates(shared, updates)
  for name in STACKED:
    for i in range(params[name].shape[0]):
      assert _rel_err(ours[name][i], expected[name][i]) < 1e-6, (name, i)
    # One ratio shared by the layers (optax.lamb on the stacked tensor) moves some layer far off.
    errors = [_rel_err(shared[name][i] - params[name][i], expected[name][i] - params[name][i])
              for i in range(params[name].shape[0])]
    assert max(errors) > 1.0, (name, errors)


@pytest.mark.slow
def test_stacked_sharded_on_layers_and_inside_layers():
  # Layers split over 'data' (whole slices per device), each slice split over 'tensor': the
  # per-layer norms are summed over 'tensor' only.
  mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  P = jax.sharding.PartitionSpec
  shapes = {"w": (4, 16, 32), "b": (4, 32)}
  specs = {"w": P("data", None, "tensor"), "b": P(None, "tensor")}
  shardings = {k: jax.sharding.NamedSharding(mesh, s) for k, s in specs.items()}
  rng = np.random.default_rng(5)
  scales = np.array([1e-2, 1.0, 10.0, 1e3])
  make = lambda scale: {k: jax.device_put(jnp.asarray(
      scale * rng.standard_normal(s) * scales.reshape((-1,) + (1,) * (len(s) - 1)),
      jnp.float32), shardings[k]) for k, s in shapes.items()}
  params, grads = make(1.0), make(0.1)
  kwargs = dict(weight_decay=0.1, mask=lambda tree: {k: not k.startswith("b") for k in tree})
  expected = _per_slice_lamb(1e-2, params, [grads], **kwargs)
  fused = fused_lamb(1e-2, interpret=True, shardings=shardings,
                     stacked={"w": True, "b": True}, **kwargs)
  updates, _ = jax.jit(fused.update)(grads, fused.init(params), params)
  ours = optax.apply_updates(params, updates)
  for name in shapes:
    assert _rel_err(ours[name], expected[name]) < 1e-6, name
    assert updates[name].sharding.is_equivalent_to(shardings[name], len(shapes[name])), name


def test_lamb_step_stacked_norms_per_layer():
  keys = jax.random.split(jax.random.key(3), 4)
  g, m, p = (jax.random.normal(k, (3, 50, 128)) for k in keys[:3])
  v = jnp.abs(jax.random.normal(keys[3], (3, 50, 128)))
  _, _, u, psq, usq = lamb_step(g, m, v, p, 0.5, 0.25, 0.1, b1=0.9, b2=0.999, eps=1e-6,
                                eps_root=0.0, stacked=True, interpret=True, block_rows=16)
  assert psq.shape == usq.shape == (3,)
  np.testing.assert_allclose(psq, jnp.sum(p * p, axis=(1, 2)), rtol=1e-5)
  np.testing.assert_allclose(usq, jnp.sum(u * u, axis=(1, 2)), rtol=1e-5)
