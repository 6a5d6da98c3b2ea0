"""backward_split: a backward split into B (input gradient) and W (weight gradients only)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
