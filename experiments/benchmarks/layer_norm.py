"""Fused LayerNorm (Pallas) against XLA's LayerNorm: forward, forward + residual, fwd+bwd.

Shapes ('full'): the 1.3B model's activations (8192 tokens x hidden 2048) and one 175B layer
(2048 tokens x hidden 12288), bf16. GB/s counts the bytes a perfect kernel must move
(fwd: read x, write y; +residual: also read r, write h; fwd+bwd: that plus read h, dy, dh, write
dx), so the same figure applies to both implementations. Target on GPU: the fused kernel at
>= 80% of HBM bandwidth.
"""
import jax
import jax.numpy as jnp

from experiments.timing import relative_error, time_fn
from pallas_kernels import layer_norm as ln

SHAPES = {
    "tiny": [("tiny", 256, 256)],
    "small": [("1.3B-like/8", 1024, 512), ("175B-like/24", 256, 512)],
    "full": [("1.3B", 8192, 2048), ("175B", 2048, 12288)],
}
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def hbm_peak():
  """Peak HBM bandwidth of device 0 in bytes/s, or None where unknown (CPU)."""
  kind = jax.devices()[0].device_kind
  return next((peak for name, peak in HBM_BYTES_PER_S.items() if name in kind), None)


def _passes(impl):
  if impl == "pallas":
    norm = lambda x, s, b, **kw: ln.layer_norm(x, s, b, **kw)
  else:
    norm = lambda x, s, b, **kw: ln.reference_layer_norm(x, s, b, **kw)
  fwd = jax.jit(lambda x, r, s, b: norm(x, s, b))
  fwd_res = jax.jit(lambda x, r, s, b: norm(x, s, b, residual=r))

  def backward(x, r, s, b):
    # Random cotangents: with all-ones ones the LayerNorm part of dx nearly cancels, and an
    # error in it would hide in the accuracy column.
    (y, h), vjp = jax.vjp(lambda x, r, s, b: norm(x, s, b, residual=r), x, r, s, b)
    keys = jax.random.split(jax.random.key(7))
    return vjp((jax.random.normal(keys[0], y.shape).astype(y.dtype),
                jax.random.normal(keys[1], h.shape).astype(h.dtype)))
  fwd_bwd = jax.jit(backward)
  # Multiples of rows * hidden * itemsize moved by an ideal kernel.
  return [("fwd", fwd, 2), ("fwd+residual", fwd_res, 4), ("fwd+bwd (residual)", fwd_bwd, 8)]


def run(size: str, warmup: int, repeats: int) -> dict:
  """Times the Pallas and XLA LayerNorm at the `size` shapes; rows with GB/s and HBM fraction."""
  peak = hbm_peak()
  dtype = jnp.bfloat16
  rows_out = []
  for label, rows, hidden in SHAPES[size]:
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (rows, hidden), dtype)
    r = jax.random.normal(keys[1], (rows, hidden), dtype)
    s = 1.0 + 0.1 * jax.random.normal(keys[2], (hidden,))
    b = 0.1 * jax.random.normal(keys[3], (hidden,))
    times = {}
    upcast = [a.astype(jnp.float32) for a in (x, r, s, b)]
    references = {name: fn(*upcast) for name, fn, _ in _passes("xla")}
    for impl in ("xla", "pallas"):
      for name, fn, multiple in _passes(impl):
        stats = time_fn(fn, x, r, s, b, warmup=warmup, repeats=repeats)
        t = stats["median_s"]
        times[(impl, name)] = t
        gbps = multiple * rows * hidden * jnp.dtype(dtype).itemsize / t / 1e9
        row = {"shape": f"{label} {rows}x{hidden}", "impl": impl, "pass": name,
               "median_ms": t * 1e3, "calls": stats["calls"], "GB/s": gbps,
               "rel_err": relative_error(fn(x, r, s, b), references[name])}
        if peak:
          row["hbm_frac"] = gbps * 1e9 / peak
        if impl == "pallas":
          row["speedup_vs_xla"] = times[("xla", name)] / t
        rows_out.append(row)
  notes = ["bf16 activations, fp32 scale/bias and statistics; GB/s = ideal bytes / median time",
           "rel_err: worst ||out - ref|| / ||ref|| over the outputs (gradients for fwd+bwd) "
           "against the XLA reference on float32 inputs",
           "target: fused LayerNorm >= 80% of HBM bandwidth (H100 3.35 TB/s, H200 4.8 TB/s)",
           "calls: back-to-back calls per timed sample (one sync each, so dispatch and sync "
           "do not count); they reuse the same inputs, 32-48 MiB each at full size against "
           "a 50 MB (H100) L2, so a little of an input may still be cached from the last call"]
  if jax.devices()[0].platform == "cpu":
    notes.append("CPU: the Pallas kernel runs in the interpreter; times show interpreter "
                 "overhead, not kernel speed")
  return {"rows": rows_out, "notes": notes}
