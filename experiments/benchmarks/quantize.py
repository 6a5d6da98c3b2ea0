"""Fused quantize/dequantize (+ Hadamard) (Pallas) against the same steps in plain XLA.

Shapes ('full'): one 1.3B model's gradients in SDP4Bit's groups of 128 (1.3e9 / 128 groups would
not fit a benchmark; 2^21 groups = 268 M values), and a 6.7B layer's weights in groups of 2048.
GB/s counts the bytes a perfect kernel moves (quantize: read 4 B, write 1 B + the scale per
value; dequantize: the reverse), the same for both implementations. The XLA version is
`reference_quantize` / `reference_dequantize` under jit (transform as a matmul, as the kernel).
"""
import time

import jax
import jax.numpy as jnp

from experiments.timing import relative_error, time_fn
from pallas_kernels import quantize as qk

SHAPES = {
    "tiny": [("tiny", 256, 128, 4, True)],
    "small": [("grad g128 4b+H", 4096, 128, 4, True), ("weights g2048 4b", 256, 2048, 4, False)],
    "full": [("grad g128 4b+H", 1 << 21, 128, 4, True), ("grad g128 8b", 1 << 21, 128, 8, False),
             ("weights g2048 4b", 1 << 15, 2048, 4, False)],
}


def run(size: str, warmup: int, repeats: int) -> dict:
  """Times the kernel and the XLA version of quantize and dequantize at the `size` shapes."""
  rows = []
  start = time.perf_counter()
  for label, groups, g, bits, hadamard in SHAPES[size]:
    x = jax.random.normal(jax.random.key(0), (groups, g))
    impls = {
        "xla": (jax.jit(lambda x: qk.reference_quantize(x, bits=bits, hadamard=hadamard)),
                jax.jit(lambda c, s: qk.reference_dequantize(c, s, bits=bits,
                                                             hadamard=hadamard))),
        "pallas": (lambda x: qk.quantize(x, bits=bits, hadamard=hadamard),
                   lambda c, s: qk.dequantize(c, s, bits=bits, hadamard=hadamard)),
    }
    ideal = groups * g * 5 + groups * 4
    times = {}
    ref_codes, ref_scales = impls["xla"][0](x)
    ref_values = impls["xla"][1](ref_codes, ref_scales)
    for impl, (quantize, dequantize) in impls.items():
      codes, scales = quantize(x)
      # On the device: the full shapes hold 268 M values, too many to copy to the host.
      accuracy = {
          "quantize": {"codes_differing": float(jnp.mean(codes != ref_codes)),
                       "rel_err": relative_error(scales, ref_scales, on_device=True)},
          "dequantize": {"rel_err": relative_error(dequantize(ref_codes, ref_scales),
                                                   ref_values, on_device=True)},
      }
      for name, fn, args in (("quantize", quantize, (x,)),
                             ("dequantize", dequantize, (codes, scales))):
        stats = time_fn(fn, *args, warmup=warmup, repeats=repeats)
        t = stats["median_s"]
        times[(impl, name)] = t
        row = {"shape": f"{label} {groups}x{g}", "impl": impl, "pass": name,
               "median_ms": t * 1e3, "calls": stats["calls"], "GB/s": ideal / t / 1e9,
               **accuracy[name]}
        if impl == "pallas":
          row["speedup_vs_xla"] = times[("xla", name)] / t
        rows.append(row)
      del codes, scales
    del x, ref_codes, ref_scales, ref_values
    print(f"[quantize] {label} {groups}x{g} done at {time.perf_counter() - start:.1f} s",
          flush=True)
  notes = ["codes one per byte (offset-binary uint8), float32 scale per group; GB/s = ideal "
           "bytes / median time",
           "accuracy against the XLA version: quantize, the fraction of codes that differ and "
           "the scales' relative error; dequantize (of the XLA codes), the relative error "
           "(float32 reductions on the device)"]
  if jax.devices()[0].platform == "cpu":
    notes.append("CPU: the Pallas kernel runs in the interpreter; times show interpreter "
                 "overhead, not kernel speed")
  return {"rows": rows, "notes": notes}
