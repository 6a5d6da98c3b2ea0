"""Group-wise symmetric quantization and the blockwise Hadamard transform of SDP4Bit.

A flat float32 vector is cut into groups of `group` values (the last group zero-padded); each
group gets one float32 scale, its largest magnitude, and every value becomes the nearest of the
2 * (2^(bits-1) - 1) + 1 levels in [-scale, scale]:

    code = round(x / scale * L),  L = 2^(bits-1) - 1,     x' = code * scale / L

so |x - x'| <= scale / (2 L) for every value (`error_bound`). Codes of 4 bits or fewer travel
two to a byte; wider codes (up to 8) one to a byte. `bits=16` sends bfloat16 and `bits=32`
sends the values themselves (no quantization), so the same collectives run at full precision.

The Hadamard transform (`hadamard`) multiplies each group by the orthonormal Walsh-Hadamard
matrix of its size (a fast transform: log2(group) butterfly stages). It spreads a group's
outliers over all its values, so the group's largest magnitude, and with it the quantization
step, shrinks; it is its own inverse. SDP4Bit applies it before the 4-bit inter-node gradient
quantization.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mscale_jax.config import SDP4BitConfig

_SDP4BIT = SDP4BitConfig()      # the one set of SDP4Bit defaults (and their sources)

FULL_BITS = (16, 32)                    # bfloat16 on the wire; float32 (no quantization)


@dataclasses.dataclass(frozen=True)
class Quantizer:
  """How one collective quantizes: code width, group size, Hadamard transform or not.

  Bits and group default to SDP4Bit's inter-node gradient level (`config.SDP4BitConfig`).
  """
  bits: int = _SDP4BIT.grad_bits_inter
  group: int = _SDP4BIT.grad_group
  hadamard: bool = False
  kernel: str = "xla"          # 'pallas': the fused kernel of pallas_kernels/quantize.py

  @property
  def exact(self) -> bool:
    """Whether values travel unquantized (float32)."""
    return self.bits == 32

  def wire_bits_per_value(self) -> float:
    """Bits each value costs on the wire, its share of the group's scale included."""
    if self.bits in FULL_BITS:
      return float(self.bits)
    return code_bits(self.bits) + 32.0 / self.group


def code_bits(bits: int) -> int:
  """Bits one integer code occupies in the packed payload (4 for widths <= 4, else 8)."""
  return 4 if bits <= 4 else 8


def levels(bits: int) -> int:
  """L = 2^(bits-1) - 1: the largest code magnitude of a symmetric `bits`-bit code."""
  return 2 ** (bits - 1) - 1


def error_bound(x: jax.Array, q: Quantizer) -> jax.Array:
  """Per-value bound on |x - dequantize(quantize(x))| without Hadamard: scale / (2 L),
  `x` flat; shape [n] (each value gets its group's bound)."""
  groups = _groups(x, q.group)
  bound = jnp.max(jnp.abs(groups), axis=1, keepdims=True) / (2 * levels(q.bits))
  return jnp.broadcast_to(bound, groups.shape).reshape(-1)[:x.shape[0]]


def _groups(x: jax.Array, group: int) -> jax.Array:
  """Flat [n] -> [ceil(n / group), group], zero-padded."""
  n = x.shape[0]
  pad = -n % group
  return jnp.pad(x, (0, pad)).reshape(-1, group)


def hadamard(x: jax.Array) -> jax.Array:
  """Orthonormal fast Walsh-Hadamard transform of each row of `x` [rows, g], g a power of 2.

  Its own inverse: hadamard(hadamard(x)) == x (to float rounding).
  """
  rows, g = x.shape
  if g & (g - 1):
    raise ValueError(f"the Hadamard block must be a power of two, got {g}")
  h = 1
  while h < g:
    y = x.reshape(rows, g // (2 * h), 2, h)
    a, b = y[:, :, 0, :], y[:, :, 1, :]
    x = jnp.stack([a + b, a - b], axis=2).reshape(rows, g)
    h *= 2
  return x * (1.0 / np.sqrt(g))


def quantize(x: jax.Array, q: Quantizer) -> dict[str, jax.Array]:
  """Flat float32 [n] -> the payload that travels: {'codes': uint8 [...], 'scales': f32 [groups]}
  (or {'values': bfloat16/float32 [n]} at 16/32 bits). `dequantize` needs n and `q` back."""
  x = x.astype(jnp.float32)
  if q.bits == 32:
    return {"values": x}
  if q.bits == 16:
    return {"values": x.astype(jnp.bfloat16)}
  groups = _groups(x, q.group)
  if q.kernel == "pallas":
    codes, scales = _kernel_quantize(groups, q)
    return {"codes": _pack(codes, q.bits), "scales": scales}
  if q.hadamard:
    groups = hadamard(groups)
  scales = jnp.max(jnp.abs(groups), axis=1)
  safe = jnp.where(scales > 0, scales, 1.0)
  codes = jnp.round(groups / safe[:, None] * levels(q.bits)).astype(jnp.int8)
  return {"codes": _pack(codes, q.bits), "scales": scales}


_KERNEL_BLOCK = 64     # groups per program of the Pallas kernel (pads to a multiple of it)


def _padded_rows(a: jax.Array) -> jax.Array:
  return jnp.pad(a, ((0, -a.shape[0] % _KERNEL_BLOCK),) + ((0, 0),) * (a.ndim - 1))


def _kernel_quantize(groups: jax.Array, q: Quantizer):
  """(int32 codes, scales) of [n_groups, g] from the fused kernel (offset-binary undone)."""
  from pallas_kernels import quantize as kernel
  n = groups.shape[0]
  codes, scales = kernel.quantize(_padded_rows(groups), bits=q.bits, hadamard=q.hadamard)
  return codes[:n].astype(jnp.int32) - (levels(q.bits) + 1), scales[:n]


def _kernel_dequantize(codes: jax.Array, scales: jax.Array, q: Quantizer) -> jax.Array:
  """[n_groups, g] float32 from int32 codes through the fused kernel."""
  from pallas_kernels import quantize as kernel
  n = codes.shape[0]
  offset = (codes + levels(q.bits) + 1).astype(jnp.uint8)
  return kernel.dequantize(_padded_rows(offset), _padded_rows(scales), bits=q.bits,
                           hadamard=q.hadamard)[:n]


def dequantize(payload: dict[str, jax.Array], n: int, q: Quantizer) -> jax.Array:
  """The float32 [n] that `payload` (from `quantize` of an [n] vector) stands for."""
  if "values" in payload:
    return payload["values"].astype(jnp.float32)
  codes = _unpack(payload["codes"], q.bits, q.group)
  if q.kernel == "pallas":
    return _kernel_dequantize(codes, payload["scales"], q).reshape(-1)[:n]
  groups = codes.astype(jnp.float32) * (payload["scales"][:, None] / levels(q.bits))
  if q.hadamard:
    groups = hadamard(groups)
  return groups.reshape(-1)[:n]


def _pack(codes: jax.Array, bits: int) -> jax.Array:
  """int8 codes [groups, g] -> uint8 [groups, g] (bits > 4) or [groups, g / 2] (two nibbles).

  Codes travel offset by 2^(bits'-1) (bits' = 8 or 4) so that every conversion stays in range:
  XLA's vectorized CPU code saturates out-of-range integer conversions (int8 -> uint8).
  """
  if bits > 4:
    return (codes.astype(jnp.int32) + 128).astype(jnp.uint8)
  nibbles = (codes.astype(jnp.int32) + 8).astype(jnp.uint8)     # [-7, 7] -> [1, 15]
  low, high = nibbles[:, 0::2], nibbles[:, 1::2]
  return low | (high << 4)


def _unpack(packed: jax.Array, bits: int, group: int) -> jax.Array:
  """Inverse of `_pack`: int32 codes [groups, group]."""
  wide = packed.astype(jnp.int32)
  if bits > 4:
    return wide - 128
  low, high = (wide & 0xF) - 8, (wide >> 4) - 8
  return jnp.stack([low, high], axis=-1).reshape(packed.shape[0], group)


def roundtrip(x: jax.Array, q: Quantizer) -> jax.Array:
  """dequantize(quantize(x)) of a flat [n] vector (what a receiver sees)."""
  return dequantize(quantize(x, q), x.shape[0], q)
