"""Fused group-wise quantize / dequantize with an optional Hadamard transform (SDP4Bit).

  codes, scales = quantize(x, bits=4, hadamard=True)     # x [groups, g] float32
  y = dequantize(codes, scales, bits=4, hadamard=True)   # y [groups, g] float32

One program handles a block of groups in one pass over HBM: (x @ H, where H is the orthonormal
g x g Walsh-Hadamard matrix), the group's largest magnitude as its scale, and the codes
round(x / scale * L) + L + 1 (L = 2^(bits-1) - 1) as uint8, one per value; dequantize is the
mirror image. Codes are offset-binary so that no conversion leaves its range (XLA's vectorized
CPU code saturates those). Packing codes of 4 bits or fewer two to a byte is left to the caller.

On GPU and TPU the transform is a (block, g) x (g, g) matmul on the tensor cores: for g = 128 it
costs 2g flops per value against 8 bytes moved, still memory-bound on an H100. Backend from the
input's platform (Triton, Mosaic, or the interpreter on CPU; `interpret=True` forces it).
`reference_quantize` / `reference_dequantize` are the plain-jnp definitions.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._platform import platform_of, resolve_interpret

_BLOCK_GROUPS = 64        # groups per program, at most ...
_BLOCK_VALUES = 8192      # ... and at most this many values (Triton holds a block in registers)


def hadamard_matrix(g: int) -> np.ndarray:
  """The orthonormal g x g Walsh-Hadamard (Sylvester) matrix; g a power of two."""
  if g < 1 or g & (g - 1):
    raise ValueError(f"the Hadamard size must be a power of two, got {g}")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < g:
    h = np.block([[h, h], [h, -h]])
  return (h / np.sqrt(g)).astype(np.float32)


def _levels(bits: int) -> int:
  return 2 ** (bits - 1) - 1


def round_half_even(y):
  """`jnp.round(y)` (ties to even) from floor and compares, for every float32 y.

  The kernels use it because Pallas' Triton lowering has no `round` (seen on JAX 0.11.2). For
  |y| >= 2^23 y is already an integer (frac 0); below, y - floor(y) is exact except for tiny
  negative y, where it rounds up to 1.0 and still selects floor(y) + 1 = 0. The parity test
  r - 2 floor(r / 2) is exact for integers below 2^24. One difference: y in [-0.5, 0) gives
  +0.0 where jnp.round gives -0.0 (no matter to the codes, which add an offset).
  """
  r = jnp.floor(y)
  frac = y - r
  odd = (r - 2.0 * jnp.floor(0.5 * r)) == 1.0
  return jnp.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


def reference_quantize(x, *, bits: int, hadamard: bool):
  """Plain-jnp `quantize`: (uint8 offset codes [groups, g], float32 scales [groups])."""
  x = x.astype(jnp.float32)
  if hadamard:
    x = x @ jnp.asarray(hadamard_matrix(x.shape[1]))
  scales = jnp.max(jnp.abs(x), axis=1)
  safe = jnp.where(scales > 0, scales, 1.0)
  codes = jnp.round(x / safe[:, None] * _levels(bits)) + (_levels(bits) + 1)
  return codes.astype(jnp.int32).astype(jnp.uint8), scales


def reference_dequantize(codes, scales, *, bits: int, hadamard: bool):
  """Plain-jnp `dequantize`: float32 [groups, g]."""
  values = (codes.astype(jnp.int32) - (_levels(bits) + 1)).astype(jnp.float32)
  y = values * (scales[:, None] / _levels(bits))
  if hadamard:
    y = y @ jnp.asarray(hadamard_matrix(codes.shape[1]))
  return y


def _quantize_kernel(*refs, bits, hadamard):
  x_ref, *h_ref, codes_ref, scales_ref = refs     # h_ref: [the g x g matrix] if hadamard
  x = x_ref[...].astype(jnp.float32)
  if hadamard:
    x = jnp.dot(x, h_ref[0][...], preferred_element_type=jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=1, keepdims=True)
  safe = jnp.where(scale > 0, scale, 1.0)
  codes = round_half_even(x / safe * _levels(bits)) + (_levels(bits) + 1)
  codes_ref[...] = codes.astype(jnp.int32).astype(jnp.uint8)
  scales_ref[...] = scale


def _dequantize_kernel(*refs, bits, hadamard):
  codes_ref, scales_ref, *h_ref, y_ref = refs     # h_ref: [the g x g matrix] if hadamard
  values = (codes_ref[...].astype(jnp.int32) - (_levels(bits) + 1)).astype(jnp.float32)
  y = values * (scales_ref[...] / _levels(bits))
  if hadamard:
    y = jnp.dot(y, h_ref[0][...], preferred_element_type=jnp.float32)
  y_ref[...] = y


def block_groups(groups: int, g: int) -> int:
  """Groups per program: 64, fewer for long groups (a block holds <= 8192 values, but always
  at least one group, so a group of more than 8192 values is a block alone), <= `groups`."""
  return max(1, min(groups, _BLOCK_GROUPS, _BLOCK_VALUES // g))


def _call(kernel, rows, out_shape, *, groups, g, hadamard: bool, interpret):
  """pallas_call over blocks of groups: `rows` arrays cut by group, then, with `hadamard`,
  the g x g matrix whole (only then: an unused 2048 x 2048 block is still a 16 MiB operand)."""
  block = block_groups(groups, g)
  if groups % block:
    raise ValueError(f"the number of groups ({groups}) must be a multiple of {block}")
  spec = lambda cols: pl.BlockSpec((block, cols), lambda i: (i, 0))
  args, in_specs = [*rows], [spec(a.shape[1]) for a in rows]
  if hadamard:
    args.append(jnp.asarray(hadamard_matrix(g)))
    in_specs.append(pl.BlockSpec((g, g), lambda i: (0, 0)))
  out_specs = [spec(s.shape[1]) for s in out_shape]
  return pl.pallas_call(kernel, grid=(groups // block,), in_specs=in_specs,
                        out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret)(*args)


@functools.partial(jax.jit, static_argnames=("bits", "hadamard", "interpret"))
def quantize(x, *, bits: int = 4, hadamard: bool = False, interpret=None):
  """x [groups, g] -> (uint8 offset codes [groups, g], float32 scales [groups]); bits 2-8."""
  backend, interp = resolve_interpret("quantize", interpret, platform_of(x))
  groups, g = x.shape
  codes, scales = _call(
      functools.partial(_quantize_kernel, bits=bits, hadamard=hadamard), (x,),
      [jax.ShapeDtypeStruct((groups, g), jnp.uint8),
       jax.ShapeDtypeStruct((groups, 1), jnp.float32)], groups=groups, g=g,
      hadamard=hadamard, interpret=interp if backend == "interpret" else False)
  return codes, scales[:, 0]


@functools.partial(jax.jit, static_argnames=("bits", "hadamard", "interpret"))
def dequantize(codes, scales, *, bits: int = 4, hadamard: bool = False, interpret=None):
  """Inverse of `quantize`: float32 [groups, g]."""
  backend, interp = resolve_interpret("dequantize", interpret, platform_of(codes))
  groups, g = codes.shape
  (y,) = _call(functools.partial(_dequantize_kernel, bits=bits, hadamard=hadamard),
               (codes, scales[:, None]), [jax.ShapeDtypeStruct((groups, g), jnp.float32)],
               groups=groups, g=g, hadamard=hadamard,
               interpret=interp if backend == "interpret" else False)
  return y
