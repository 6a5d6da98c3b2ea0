"""Achieved matmul TFLOP/s over a table of GEMM shapes: what the performance model calibrates on.

Shapes ('full') are the 175B model's per-GPU GEMMs under TP=8 (QKV, attention-out, FFN-in/out,
the parallel block's merged GEMMs) at 2,048 and 8,192 tokens, the 1,024-row chunks a TP=8
collective matmul runs, and squares. `python -m experiments.scaling_curves --calibrate=<record>`
fits mscale_jax.perf's GEMM efficiency curve to these rows.
"""
import time

import jax
import jax.numpy as jnp

from experiments.timing import relative_error, time_fn
from mscale_jax.flops import known_peak

H, FFN, TP = 12288, 4 * 12288, 8
SHAPES = {
    "tiny": [(64, 64, 64), (128, 64, 256)],
    "small": [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (512, 2048, 1024)],
    "full": [(2048, H, 3 * H // TP), (8192, H, 3 * H // TP), (8192, H // TP, H),
             (8192, H, FFN // TP), (8192, FFN // TP, H), (8192, H, (3 * H + FFN) // TP),
             (8192, (H + FFN) // TP, H), (1024, H, (3 * H + FFN) // TP),
             (1024, (H + FFN) // TP, H), (4096, 4096, 4096), (8192, 8192, 8192)],
}


def run(size: str, warmup: int, repeats: int) -> dict:
  """Times `a @ b` for each shape; rows with m, k, n, dtype, seconds, TFLOP/s and efficiency."""
  device = jax.devices()[0]
  dtype = "float32" if device.platform == "cpu" else "bfloat16"
  peak = known_peak(device.device_kind, dtype)
  matmul = jax.jit(lambda a, b: a @ b)
  # The inputs' exact products summed in float32 (bf16 x bf16 is exact in float32): the same
  # cheap GEMM with a float32 output, where a float32 Precision.HIGHEST product was not.
  exact = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
  start = time.perf_counter()
  rows = []
  for m, k, n in SHAPES[size]:
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.dtype(dtype))
    b = jax.random.normal(kb, (k, n), jnp.dtype(dtype))
    stats = time_fn(matmul, a, b, warmup=warmup, repeats=repeats)
    seconds = stats["median_s"]
    error = relative_error(matmul(a, b), exact(a, b), on_device=True)
    print(f"[gemm] {m}x{k}x{n} done at {time.perf_counter() - start:.1f} s", flush=True)
    tflops = 2.0 * m * k * n / seconds / 1e12
    rows.append({"m": m, "k": k, "n": n, "dtype": dtype, "median_s": seconds,
                 "calls": stats["calls"],
                 "tflops": tflops, "peak_tflops": peak / 1e12 if peak else None,
                 "efficiency": tflops / (peak / 1e12) if peak else None, "rel_err": error})
  notes = [f"{dtype} on {device.device_kind}; calibrate the performance model with "
           "python -m experiments.scaling_curves --calibrate=<this record>",
           "rel_err: ||a @ b - exact|| / ||exact||, exact = the same inputs' products summed "
           "in float32 (preferred_element_type): XLA's own GEMM with a float32 output, so "
           "not an independent check; it shows the bf16 output rounding (near 2e-3; 0 on "
           "CPU, where both are float32)"]
  if peak is None:
    notes.append("no data-sheet peak for this device: efficiency is empty and the record "
                 "cannot calibrate the model")
  return {"rows": rows, "notes": notes}
