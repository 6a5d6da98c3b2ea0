"""SDP4Bit: config checks, the group-wise quantizer and Hadamard transform, and the quantized
collectives against the exact ones on 8 simulated devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mscale_jax import mesh as mesh_lib
from mscale_jax.config import Config, validate
from mscale_jax.errors import ConfigError
from mscale_jax.sdp4bit import collectives
from mscale_jax.sdp4bit.quant import Quantizer, error_bound, hadamard, quantize, roundtrip

jit_roundtrip = jax.jit(roundtrip, static_argnums=1)     # one compile per quantizer


# -- config ----------------------------------------------------------------------------------

def _sdp4bit(**fields):
  return Config().replace(optimizer={"dp_comm": "sdp4bit"}).replace(
      optimizer={"sdp4bit": Config().optimizer.sdp4bit.__class__(**fields)})


def test_default_is_none_and_sdp4bit_defaults_are_the_papers():
  o = Config().optimizer
  assert o.dp_comm == "none"
  q = o.sdp4bit
  assert (q.weights, q.weight_bits, q.weight_group) == ("differences", 4, 2048)
  assert (q.grad_bits_intra, q.grad_bits_inter, q.grad_group, q.hadamard) == (8, 4, 128, True)
  validate(_sdp4bit(), 8)


@pytest.mark.parametrize("field,value", [("weight_bits", 1), ("grad_bits_intra", 12),
                                         ("grad_bits_inter", 0), ("weight_bits", 64)])
def test_bad_bit_width_is_a_config_error(field, value):
  with pytest.raises(ConfigError) as info:
    validate(_sdp4bit(**{field: value}), 8)
  assert info.value.field == f"optimizer.sdp4bit.{field}" and info.value.value == value
  assert "16: bfloat16" in str(info.value)


@pytest.mark.parametrize("field,value", [("weight_group", 100), ("grad_group", 0),
                                         ("grad_group", 1)])
def test_bad_group_size_is_a_config_error(field, value):
  with pytest.raises(ConfigError) as info:
    validate(_sdp4bit(**{field: value}), 8)
  assert info.value.field == f"optimizer.sdp4bit.{field}" and "power of two" in str(info.value)


def test_unknown_dp_comm_and_tensor_parallelism_are_config_errors():
  with pytest.raises(ConfigError, match="optimizer.dp_comm.*'none', 'sdp4bit'"):
    validate(Config().replace(optimizer={"dp_comm": "qsdp"}), 8)
  config = _sdp4bit().replace(mesh={"data": 4, "tensor": 2})
  with pytest.raises(ConfigError, match="mesh.tensor=2"):
    validate(config, 8)


# -- quantizer -------------------------------------------------------------------------------

def _outlier_data(key, n=4096, outliers=8, scale=50.0):
  """Gaussian values with a few large outliers (as gradients have)."""
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (n,))
  where = jax.random.choice(k2, n, (outliers,), replace=False)
  return x.at[where].set(scale * jax.random.normal(k3, (outliers,)))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [32, 128, 2048])
def test_quantizer_error_is_within_its_bound(bits, group):
  x = _outlier_data(jax.random.key(bits * group), n=5000)     # not a multiple of the group
  q = Quantizer(bits, group)
  err = jnp.abs(jit_roundtrip(x, q) - x)
  bound = error_bound(x, q)
  assert bool(jnp.all(err <= bound * (1 + 1e-5) + 1e-7))
  assert float(jnp.max(err / bound)) > 0.5                      # the bound is not slack
  payload = quantize(x, q)
  assert payload["codes"].dtype == jnp.uint8
  assert payload["codes"].size == -(-5000 // group) * group * (4 if bits <= 4 else 8) // 8


@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_roundtrip_and_sum_equals_eager(bits):
  """A fused jit of quantize -> dequantize -> sum (what the collectives do) decodes the same
  values as eager per-row roundtrips: codes must survive XLA's vectorized conversions."""
  rows = jax.random.normal(jax.random.key(bits), (8, 4096))
  q = Quantizer(bits, 128)
  fused = jax.jit(lambda r: jnp.sum(jax.vmap(lambda x: roundtrip(x, q))(r), axis=0))(rows)
  eager = sum(np.asarray(jit_roundtrip(row, q)) for row in rows)     # one row per program
  np.testing.assert_allclose(fused, eager, rtol=1e-5, atol=1e-5)


def test_full_precision_bits_are_exact_or_bfloat16():
  x = _outlier_data(jax.random.key(0))
  np.testing.assert_array_equal(roundtrip(x, Quantizer(32)), x)
  np.testing.assert_array_equal(roundtrip(x, Quantizer(16)), x.astype(jnp.bfloat16).astype(jnp.float32))


def test_hadamard_is_orthonormal_and_its_own_inverse():
  x = jax.random.normal(jax.random.key(1), (6, 64))
  y = jax.jit(hadamard)(x)
  np.testing.assert_allclose(jax.jit(hadamard)(y), x, atol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=1), jnp.linalg.norm(x, axis=1), rtol=1e-5)
  h = hadamard(jnp.eye(8))                     # the Sylvester matrix / sqrt(8)
  np.testing.assert_allclose(jnp.abs(h) * np.sqrt(8), np.ones((8, 8)), atol=1e-6)


def test_hadamard_lowers_the_error_on_outlier_heavy_gradients():
  errors = {}
  for use in (False, True):
    sq = []
    for seed in range(4):
      x = _outlier_data(jax.random.key(seed), n=1 << 14, outliers=64)
      q = Quantizer(4, 128, hadamard=use)
      sq.append(float(jnp.mean((jit_roundtrip(x, q) - x) ** 2)))
    errors[use] = np.mean(sq)
  assert errors[True] < 0.5 * errors[False], errors


# -- collectives -----------------------------------------------------------------------------

def _run(mesh, fn, in_specs, out_specs, *args):
  with jax.set_mesh(mesh):
    return jax.jit(jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs,
                                 axis_names={"data", "fsdp"}, check_vma=False))(*args)


MESHES = [pytest.param({"data": 2, "fsdp": 4}, id="data2-fsdp4"),
          pytest.param({"data": 8, "fsdp": 1}, id="data8-fsdp1", marks=pytest.mark.slow),
          pytest.param({"data": 1, "fsdp": 8}, id="data1-fsdp8", marks=pytest.mark.slow)]


@pytest.mark.parametrize("shape", MESHES)
def test_tlq_reduce_scatter_matches_the_exact_mean(shape):
  mesh = mesh_lib.make_mesh({**shape, "stage": 1, "tensor": 1})
  grads = jax.random.normal(jax.random.key(0), (8, 32, 256))      # one [32, 256] per device
  grads = grads.at[:, 3, 5].mul(40.0)                               # an outlier
  exact = grads.mean(0)

  def reduce(intra_bits, inter_bits, use_hadamard=True):
    intra = Quantizer(intra_bits, 128)
    inter = Quantizer(inter_bits, 128, use_hadamard)
    return _run(mesh, lambda g: collectives.tlq_reduce_scatter(g[0], 1, intra=intra,
                                                               inter=inter),
                P(("data", "fsdp")), P(None, "fsdp"), grads)

  np.testing.assert_allclose(reduce(32, 32), exact, rtol=1e-6, atol=1e-6)
  rel = {bits: float(jnp.linalg.norm(reduce(*bits) - exact) / jnp.linalg.norm(exact))
         for bits in [(16, 16), (8, 8), (8, 4)]}
  assert rel[(16, 16)] < 1e-2 and rel[(8, 8)] < 0.02 and rel[(8, 4)] < 0.25, rel
  assert rel[(16, 16)] < rel[(8, 8)] <= rel[(8, 4)]
  if shape["data"] > 1:       # the 4-bit inter-node level exists only when 'data' > 1
    assert rel[(8, 8)] < rel[(8, 4)]
  else:
    assert rel[(8, 8)] == rel[(8, 4)]


def test_tlq_reduce_scatter_keeps_data_replicas_bitwise_equal():
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4, "stage": 1, "tensor": 1})
  grads = jax.random.normal(jax.random.key(3), (8, 16, 32))
  q = Quantizer(4, 128, True)
  # out_specs over both axes: each device's own shard, data replicas stacked on axis 0.
  out = _run(mesh, lambda g: collectives.tlq_reduce_scatter(g[0], 1, intra=q, inter=q)[None],
             P(("data", "fsdp")), P("data", None, "fsdp"), grads)
  np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.parametrize("mode", ["differences", "weights"])
def test_qwd_all_gather_reconstructs_the_weights_within_the_bound(mode):
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4, "stage": 1, "tensor": 1})
  k1, k2 = jax.random.split(jax.random.key(4))
  reference = jax.random.normal(k1, (16, 256))
  weights = reference + 1e-3 * jax.random.normal(k2, (16, 256))    # one optimizer step later
  q = Quantizer(4, 2048)

  def gather(q):
    return _run(mesh, lambda s, r: collectives.qwd_all_gather(s, r, 1, q=q, mode=mode),
                (P(None, "fsdp"), P()), P(), weights, reference)

  np.testing.assert_array_equal(gather(Quantizer(32)), weights)
  got = gather(q)
  sent = weights - reference if mode == "differences" else weights
  for f in range(4):                       # each fsdp rank quantized its own column block
    cols = slice(64 * f, 64 * (f + 1))
    block = jnp.moveaxis(sent[:, cols], 1, 0).reshape(-1)
    bound = jnp.moveaxis(error_bound(block, q).reshape(64, 16), 0, 1)
    err = jnp.abs(got[:, cols] - weights[:, cols])
    assert bool(jnp.all(err <= bound * (1 + 1e-4) + 1e-6))
  # Differences (~1e-3, max ~4e-3 a group) cost ~3e-4 at 4 bits; the weights (~1, max ~4)
  # themselves ~0.3: qWD's point.
  worst = float(jnp.max(jnp.abs(got - weights)))
  assert worst < 4e-4 if mode == "differences" else worst > 0.05


def test_pallas_kernel_option_sends_the_same_codes():
  """kernel='pallas' (pallas_kernels/quantize.py, the interpreter on CPU): the payload is the
  XLA path's without the transform, and decodes to within float rounding with it."""
  x = _outlier_data(jax.random.key(7), n=5000)
  for bits in (4, 8):
    xla, fused = Quantizer(bits, 128), Quantizer(bits, 128, kernel="pallas")
    a, b = quantize(x, xla), jax.jit(quantize, static_argnums=1)(x, fused)
    np.testing.assert_array_equal(a["codes"], b["codes"])
    np.testing.assert_array_equal(a["scales"], b["scales"])
    xla_h, fused_h = Quantizer(bits, 128, True), Quantizer(bits, 128, True, "pallas")
    np.testing.assert_allclose(jit_roundtrip(x, fused_h), jit_roundtrip(x, xla_h), atol=2e-4)


@pytest.mark.slow
def test_tlq_reduce_scatter_with_the_pallas_kernel_matches_xla():
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4, "stage": 1, "tensor": 1})
  grads = jax.random.normal(jax.random.key(0), (8, 32, 256))
  out = {}
  for kernel in ("xla", "pallas"):
    intra, inter = Quantizer(8, 128, kernel=kernel), Quantizer(4, 128, True, kernel)
    out[kernel] = _run(mesh, lambda g: collectives.tlq_reduce_scatter(g[0], 1, intra=intra,
                                                                      inter=inter),
                       P(("data", "fsdp")), P(None, "fsdp"), grads)
  # The kernel's matmul transform and the FWHT round differently, so a code near a tie can
  # flip (moving its group by one step / sqrt(g)): compare their errors against the exact mean.
  exact = grads.mean(0)
  rel = {k: float(jnp.linalg.norm(v - exact) / jnp.linalg.norm(exact)) for k, v in out.items()}
  assert rel["xla"] < 0.25 and abs(rel["pallas"] - rel["xla"]) < 0.1 * rel["xla"], rel
  same = float(jnp.mean(jnp.isclose(out["pallas"], out["xla"], atol=1e-4)))
  assert same > 0.75, same


def test_unknown_kernel_is_a_config_error():
  with pytest.raises(ConfigError, match="optimizer.sdp4bit.kernel='triton'"):
    validate(_sdp4bit(kernel="triton"), 8)
