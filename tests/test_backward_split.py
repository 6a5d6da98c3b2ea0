"""backward_split: a backward split into B (input gradient) and W (weight gradients only)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mscale_jax.parallel import backward_split


def _layers(params, x):
  """A scan of tanh(x @ w + b) layers, checkpointed like the pipeline's stashing chunks."""
  def layer(h, p):
    return jnp.tanh(h @ p["w"] + p["b"]), None
  return jax.lax.scan(layer, x, params)[0]


def _backward(policy):
  fn = jax.checkpoint(_layers, policy=policy) if policy else _layers

  def backward(params, x, g):
    _, vjp = jax.vjp(fn, params, x)
    d_params, d_x = vjp(g)
    return d_x, d_params
  return backward


def _dots(fn, *args) -> int:
  """dot_general equations in `fn`'s jaxpr, nested ones (a scan body) counted once."""
  def count(jaxpr):
    n = 0
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name == "dot_general"
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        n += count(sub)
    return n
  return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable,
                                    jax.checkpoint_policies.nothing_saveable])
def test_b_and_w_together_are_the_backward_and_share_its_matmuls(policy):
  """On random data, B's input gradient and W's weight gradients equal the unsplit vjp's; W
  reads no cotangent argument (it gets zeros) and no matmul runs twice: in the layer scan's
  body B has the forward's x @ w (in the vjp's forward or recomputed, never both) and the
  input gradient's g w^T, W the weight gradient's x^T g alone."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(3, 8, 8)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)}
  x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
  backward = _backward(policy)
  b, w = backward_split.split(backward, b_outputs=1, b_only=1)
  (d_x,), saved = b(params, x, g)
  d_params = w(saved, params, x, jnp.zeros_like(g))
  want_x, want_params = backward(params, x, g)
  np.testing.assert_allclose(d_x, want_x, rtol=1e-6, atol=1e-6)
  for got, want in zip(d_params, jax.tree.leaves(want_params)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert _dots(lambda *a: b(*a), params, x, g) == 2
  assert _dots(w, saved, params, x, g) == 1
  assert not any(s.shape[-2:] == (8, 8) for s in saved)   # B kept no weight (gradient)


def test_w_redoes_elementwise_steps_and_gathers_rather_than_keep_their_outputs():
  """A tensor-parallel-like region: each device gathers its row shard of x, c = x @ w1 + b,
  out = c @ w2 + tanh(c) @ w3. W reads c and tanh(c) (dW2, dW3), c's cotangent (dW1, db) and
  the gathered x (dW1). B keeps c once (W redoes tanh), its cotangent, and no gathered x (W
  gathers it again from x); the gradients equal the unsplit vjp's on random data."""
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,))
  rows, d, k, n = 16, 8, 6, 5

  def region(w1, b, w2, w3, x):
    full = jax.lax.all_gather(x, "x", tiled=True)     # [rows, d] from [rows / 4, d]
    c = full @ w1 + b
    return c @ w2 + jnp.tanh(c) @ w3

  f = jax.shard_map(region, mesh=mesh, in_specs=(P(), P(), P(), P(), P("x")),
                    out_specs=P("x"), check_vma=False)

  def backward(params, x, g):
    _, vjp = jax.vjp(f, *params, x)
    *d_params, d_x = vjp(g)
    return d_x, d_params
  rng = np.random.default_rng(1)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  params = [normal(d, k), normal(k), normal(k, n), normal(k, n)]
  x, g = normal(rows, d), normal(4 * rows, n)
  b, w = backward_split.split(backward, b_outputs=1, b_only=1)
  (d_x,), saved = b(params, x, g)
  d_params = w(saved, params, x, jnp.zeros_like(g))
  want_x, want_params = backward(params, x, g)
  np.testing.assert_allclose(d_x, want_x, rtol=1e-5, atol=1e-5)
  for got, want in zip(d_params, want_params):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  per_device = [s.shape[1:] for s in saved]      # B's region stacks them over its devices
  assert per_device.count((rows, k)) == 2, per_device     # c and its cotangent
  assert (rows, d) not in per_device, per_device           # the gathered x
