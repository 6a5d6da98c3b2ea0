"""pallas_kernels/quantize.py (interpreter on CPU) against its reference and the library's
quantizer (mscale_jax/sdp4bit/quant.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mscale_jax.sdp4bit import quant
from pallas_kernels import quantize as kernel


def _data(groups=64, g=128):
  x = jax.random.normal(jax.random.key(0), (groups, g))
  return x.at[3, 7].set(60.0).at[50, 0].set(-45.0)        # outliers


def test_round_half_even_is_jnp_round_on_ties_near_ties_and_random_values():
  ties = np.arange(-130, 130, dtype=np.float32) + np.float32(0.5)
  near = np.concatenate([np.nextafter(ties, np.float32(np.inf)),
                         np.nextafter(ties, np.float32(-np.inf)),
                         np.float32([0.49999997, -0.49999997, 0.0, -0.0])])
  spread = np.asarray(jax.random.uniform(jax.random.key(1), (4096,), minval=-128, maxval=128))
  y = jnp.asarray(np.concatenate([ties, near, spread]).astype(np.float32))
  np.testing.assert_array_equal(jax.jit(kernel.round_half_even)(y), jnp.round(y))


def test_round_half_even_is_jnp_round_on_any_float32_and_around_2_to_the_22_and_23():
  bits = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64)
  anything = bits.astype(np.uint32).view(np.float32)
  anything = anything[np.isfinite(anything)]
  integers = np.concatenate([np.arange(2**22 - 64, 2**22 + 64),
                             np.arange(2**23 - 64, 2**23 + 64)])
  around = np.concatenate([integers, -integers]).astype(np.float64)
  around = np.concatenate([around, around + 0.5, around + 0.25]).astype(np.float32)
  y = jnp.asarray(np.concatenate([anything, around, np.float32([np.inf, -np.inf, 3e38])]))
  np.testing.assert_array_equal(jax.jit(kernel.round_half_even)(y), jnp.round(y))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("hadamard", [False, True])
def test_kernel_matches_its_reference(bits, hadamard):
  x = _data()
  codes, scales = kernel.quantize(x, bits=bits, hadamard=hadamard, interpret=True)
  want_codes, want_scales = kernel.reference_quantize(x, bits=bits, hadamard=hadamard)
  assert codes.dtype == jnp.uint8
  np.testing.assert_array_equal(codes, want_codes)
  np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
  y = kernel.dequantize(codes, scales, bits=bits, hadamard=hadamard, interpret=True)
  np.testing.assert_allclose(y, kernel.reference_dequantize(codes, scales, bits=bits,
                                                            hadamard=hadamard), atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_agrees_with_the_library_quantizer(bits):
  """Without the transform the codes are the library's, offset by L + 1; with it the decoded
  values agree to within a quantization step (FWHT and the matmul round differently)."""
  x = _data()
  q = quant.Quantizer(bits, 128)
  codes, scales = kernel.quantize(x, bits=bits, interpret=True)
  lib = quant.roundtrip(x.reshape(-1), q).reshape(x.shape)
  np.testing.assert_allclose(kernel.dequantize(codes, scales, bits=bits, interpret=True), lib,
                             atol=1e-6)
  qh = quant.Quantizer(bits, 128, hadamard=True)
  codes, scales = kernel.quantize(x, bits=bits, hadamard=True, interpret=True)
  got = kernel.dequantize(codes, scales, bits=bits, hadamard=True, interpret=True)
  lib = quant.roundtrip(x.reshape(-1), qh).reshape(x.shape)
  step = float(jnp.max(scales)) / quant.levels(bits)
  assert float(jnp.max(jnp.abs(got - lib))) <= step


def test_hadamard_matrix_is_orthonormal():
  h = kernel.hadamard_matrix(64)
  np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-5)
  with pytest.raises(ValueError, match="power of two"):
    kernel.hadamard_matrix(48)


@pytest.mark.parametrize("groups, g, block", [(64, 128, 64), (8, 2048, 4), (2, 8192, 1),
                                              (16, 128, 16)])
def test_long_groups_use_smaller_blocks_and_still_match(groups, g, block):
  """Blocks stay <= 8192 values (a Triton program holds one in registers), over several
  programs; without the Hadamard transform no g x g matrix is passed."""
  assert kernel.block_groups(groups, g) == block
  x = jax.random.normal(jax.random.key(5), (groups, g)) * 3.0
  codes, scales = kernel.quantize(x, bits=4, interpret=True)
  want_codes, want_scales = kernel.reference_quantize(x, bits=4, hadamard=False)
  np.testing.assert_array_equal(codes, want_codes)
  np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
  np.testing.assert_allclose(kernel.dequantize(codes, scales, bits=4, interpret=True),
                             kernel.reference_dequantize(codes, scales, bits=4, hadamard=False),
                             atol=1e-6)


def test_groups_not_a_multiple_of_the_block_are_refused():
  with pytest.raises(ValueError, match=r"\(6\) must be a multiple of 4"):
    kernel.quantize(jnp.ones((6, 2048)), bits=4, interpret=True)
