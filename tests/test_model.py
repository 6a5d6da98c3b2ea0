"""The GPT model: sharded equals unsharded, the window and the parallel block are what they say."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mscale_jax import mesh as mesh_lib
from mscale_jax.attention import xla_attention
from mscale_jax.config import ModelConfig
from mscale_jax.model import GPT, Block

SINGLE = dict(data=1, fsdp=1, stage=1, tensor=1)


def init_params(config: ModelConfig, mesh, seed=0):
  """Model params (pure dict) built directly in their sharded layout on `mesh`."""
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(seed)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  shardings = mesh_lib.shardings_for(mesh, mesh_lib.logical_names(params))

  def init():
    with nnx.use_eager_sharding(False):
      return nnx.to_pure_dict(nnx.state(GPT(config, rngs=nnx.Rngs(seed)), nnx.Param))

  with jax.set_mesh(mesh):
    return graphdef, jax.jit(init, out_shardings=shardings)()


def loss_and_grads(config, mesh_shape, tokens):
  mesh = mesh_lib.make_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
  graphdef, params = init_params(config, mesh)

  def loss_fn(params):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  with jax.set_mesh(mesh):
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, )
  return float(loss), jax.tree.map(np.asarray, grads)


def max_rel_err(a, b):
  return max(float(np.abs(x - y).max() / (np.abs(x).max() + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# Each block kind once, each window mode once: neither changes what is sharded (attention runs
# on whole sequences inside the tensor-parallel region, where the causal mask already checks
# every position), so the cross product would prove nothing more.
@pytest.mark.parametrize("block,window", [
    pytest.param("parallel", 5, marks=pytest.mark.slow),
    pytest.param("sequential", None, marks=pytest.mark.slow)])
def test_sharded_equals_single_device(block, window):
  config = ModelConfig(num_layers=2, hidden=32, num_heads=4, mlp_dim=64, seq_len=16,
                       block=block, attention_window=window)
  tokens = jax.random.randint(jax.random.key(1), (4, config.seq_len + 1), 0, config.vocab_size)
  ref_loss, ref_grads = loss_and_grads(config, SINGLE, tokens)
  for shape in (dict(data=2, fsdp=1, stage=1, tensor=4), dict(data=2, fsdp=2, stage=1, tensor=2)):
    loss, grads = loss_and_grads(config, shape, tokens)
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5, shape
    assert max_rel_err(ref_grads, grads) < 1e-5, shape


def test_variants_shard_like_single_device():
  """SwiGLU, RMSNorm, rotary positions and tied embeddings also survive sharding."""
  config = ModelConfig(num_layers=1, hidden=32, num_heads=4, mlp_dim=32, seq_len=16,
                       mlp_activation="swiglu", norm="rmsnorm", positions="rotary",
                       tie_embeddings=True, use_bias=False, attention_window=3)
  tokens = jax.random.randint(jax.random.key(2), (2, config.seq_len + 1), 0, config.vocab_size)
  ref_loss, ref_grads = loss_and_grads(config, SINGLE, tokens)
  loss, grads = loss_and_grads(config, dict(data=1, fsdp=2, stage=1, tensor=4), tokens)
  assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
  assert max_rel_err(ref_grads, grads) < 1e-5


def naive_window_attention(q, k, v, window):
  """Loop over queries; query i averages values of keys j with i - window < j <= i."""
  b, s, h, d = q.shape
  out = np.zeros_like(q)
  for i in range(s):
    lo = 0 if window is None else max(0, i - window + 1)
    logits = np.einsum("bhd,bjhd->bhj", q[:, i], k[:, lo:i + 1]) / np.sqrt(d)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[:, i] = np.einsum("bhj,bjhd->bhd", p, v[:, lo:i + 1])
  return out


@pytest.mark.parametrize("window", [1, 4, 15, 16, 40, None])
def test_sliding_window_equals_naive_reference(window):
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((2, 16, 3, 8)).astype(np.float32) for _ in range(3))
  got = np.asarray(xla_attention(q, k, v, window=window))
  np.testing.assert_allclose(got, naive_window_attention(q, k, v, window), rtol=1e-5,
                             atol=1e-5)
  if window == 1:   # each token sees only itself
    np.testing.assert_allclose(got, v, rtol=1e-6)


def _layer_norm(x, scale, offset):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-5) * scale + offset


def test_parallel_block_is_x_plus_attn_plus_mlp():
  """y = x + Attn(LN(x)) + MLP(LN(x)) with one shared LayerNorm, written out in numpy."""
  c = ModelConfig(hidden=16, num_heads=2, mlp_dim=32, seq_len=8, attention_window=3,
                  num_layers=1, block="parallel")
  mesh = mesh_lib.make_mesh(SINGLE, jax.devices()[:1])
  with nnx.use_eager_sharding(False):
    block = Block(c, rngs=nnx.Rngs(3))
  # Random (not default) norm and bias values, so a misplaced term shows.
  rng = np.random.default_rng(1)
  for _, var in nnx.iter_graph(block):
    if isinstance(var, nnx.Param):
      var[...] = jnp.asarray(rng.standard_normal(var[...].shape).astype(np.float32) * 0.3)
  x = rng.standard_normal((2, c.seq_len, c.hidden)).astype(np.float32)
  with jax.set_mesh(mesh):
    got = np.asarray(jax.jit(lambda x: block(x))(x))

  p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(block, nnx.Param)))
  h = _layer_norm(x, p["norm"]["scale"], p["norm"]["offset"])
  qkv = (h @ p["attn"]["w_qkv"] + p["attn"]["b_qkv"]).reshape(2, c.seq_len, c.num_heads, 3, -1)
  attn = naive_window_attention(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], window=3)
  attn = attn.reshape(2, c.seq_len, -1) @ p["attn"]["w_o"] + p["attn"]["b_o"]
  pre = h @ p["mlp"]["w_in"] + p["mlp"]["b_in"]
  mlp = np.asarray(jax.nn.gelu(pre)) @ p["mlp"]["w_out"] + p["mlp"]["b_out"]
  np.testing.assert_allclose(got, x + attn + mlp, rtol=1e-4, atol=1e-4)


@pytest.mark.slow   # one of the fast tier's heaviest (a trainer run or a full search)
def test_scanned_and_unrolled_layers_agree():
  """The same weights give the same logits with nnx.scan over layers and a Python loop."""
  base = ModelConfig(num_layers=3, hidden=16, num_heads=2, mlp_dim=32, seq_len=8,
                     attention_window=4, remat="full")
  mesh = mesh_lib.make_mesh(SINGLE, jax.devices()[:1])
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 256)
  scanned_def, scanned = init_params(base, mesh)
  unrolled_cfg = ModelConfig(**{**base.__dict__, "scan_layers": False, "remat": "none"})
  unrolled_def, unrolled = init_params(unrolled_cfg, mesh)
  unrolled["blocks"] = {i: jax.tree.map(lambda x: x[i], scanned["blocks"])
                        for i in range(base.num_layers)}
  for key in ("embed", "pos_embed", "unembed", "final_norm"):
    unrolled[key] = scanned[key]
  with jax.set_mesh(mesh):
    a = nnx.merge(scanned_def, scanned)(tokens)
    b = nnx.merge(unrolled_def, unrolled)(tokens)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
