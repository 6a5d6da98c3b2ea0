"""Benchmark of pallas_kernels/collective_matmul.py: 'xla' vs 'ppermute' vs 'pallas'.

Times `all_gather_matmul` and `matmul_reduce_scatter` inside `jax.shard_map` over a 1-D ring
of every available device (at most 8), forward and forward+backward, for each implementation
(and the bidirectional rings), and reports the median time and its ratio to 'xla'.

Shapes are per device, in the terms of a sequence-parallel TP layer: all-gather-matmul
x [m, k] @ w [k, n] (m = tokens per device, n = the column-parallel [QKV | FFN-in] width per
device); matmul-reduce-scatter x [P*m, k] @ w [k, n] (k = the row-parallel [attn-out |
FFN-hidden] width per device). The 175B rows scale MegaScale's 175B layer (hidden 12288,
FFN 49152, TP 8, 2048 tokens) down by the factor in their name.

CPU: the devices are simulated on the host's cores and the Pallas kernels run in the TPU
interpreter, so CPU timings show overhead, not overlap; Pallas rows are skipped on CPU above
the ~96 KiB buffer size at which the interpreter was seen to hang. Set
XLA_FLAGS=--xla_force_host_platform_device_count=8 before starting Python to get 8 CPU
devices. TPU: all three run natively (Pallas rows need their operands to fit in VMEM).
GPU: 'pallas' is a TPU kernel and is skipped; 'xla' vs 'ppermute' is the real comparison.
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.timing import relative_error, time_fn
from pallas_kernels import collective_matmul as cm

_AXIS = "ring"
_INTERPRET_BUFFER_LIMIT = 96 * 1024     # bytes per buffer; larger ones hung the interpreter
_VMEM_BUDGET = 12 * 2 ** 20             # bytes of operands a native Pallas row may use


def _layer_shapes(scale):
  """(name, m, k_ag, n_ag, k_rs, n_rs) for MegaScale's 175B layer divided by `scale`, TP=8."""
  hidden, ffn, tp, tokens = 12288, 49152, 8, 2048
  return (f"175B/{scale}", tokens // tp // scale, hidden // scale,
          (3 * hidden + ffn) // tp // scale, (hidden + ffn) // tp // scale, hidden // scale)


def _table(size, platform):
  """[(name, m, ag (k, n), rs (k, n))] for a size (TPU rows keep k, n multiples of 128)."""
  if size == "tiny":
    if platform == "cpu":
      return [("toy", 16, (64, 64), (64, 64))]
    return [("toy", 32, (128, 128), (128, 128))]
  if size == "small":
    rows = [("toy", 16, (64, 96), (96, 64)), ("square", 32, (128, 128), (128, 128))]
    for scale in (64, 32):
      name, m, k, n, k_rs, n_rs = _layer_shapes(scale)
      rows.append((name, m, (k, n), (k_rs, n_rs)))
    return rows
  rows = [("vmem", 256, (1024, 1024), (1024, 1024)),   # fits a TPU's VMEM: Pallas runs
          ("square", 1024, (2048, 2048), (2048, 2048))]
  for scale in (4, 1):
    name, m, k, n, k_rs, n_rs = _layer_shapes(scale)
    rows.append((name, m, (k, n), (k_rs, n_rs)))
  return rows


def _variants(platform):
  out = [("xla", False), ("ppermute", False), ("ppermute", True)]
  if platform in ("tpu", "cpu"):
    out += [("pallas", False), ("pallas", True)]
  return out


def _pallas_fits(platform, p, m, k, n, itemsize):
  """Whether the Pallas kernel can run this shape here (interpreter hang / VMEM)."""
  buffers = [m * k, k * n, p * m * n, p * m * k]
  if platform == "cpu":
    return max(buffers) * itemsize <= _INTERPRET_BUFFER_LIMIT
  return sum(buffers) * itemsize <= _VMEM_BUDGET


def _build(op, impl, bidirectional, mesh):
  fn = cm.all_gather_matmul if op == "all_gather_matmul" else cm.matmul_reduce_scatter
  body = functools.partial(fn, axis_name=_AXIS, impl=impl, bidirectional=bidirectional)
  if op == "all_gather_matmul":
    specs = dict(in_specs=(P(_AXIS), P(None, _AXIS)), out_specs=P(None, _AXIS))
  else:
    specs = dict(in_specs=(P(None, _AXIS), P(_AXIS)), out_specs=P(_AXIS))
  sharded = jax.shard_map(body, mesh=mesh, **specs)
  fwd = jax.jit(sharded)
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(sharded(x, w).astype(jnp.float32)),
                          argnums=(0, 1)))
  return fwd, grad, specs["in_specs"]


def _references(x, w):
  """The unsharded float32 x @ w and its gradients (of sum(x @ w)), what every impl computes."""
  exact = lambda x, w: jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)
  x, w = x.astype(jnp.float32), w.astype(jnp.float32)
  grads = jax.jit(jax.grad(lambda x, w: jnp.sum(exact(x, w)), argnums=(0, 1)))(x, w)
  return {"fwd": jax.jit(exact)(x, w), "fwd+bwd": grads}


def run(size: str, warmup: int, repeats: int, ring: int = 8) -> dict:
  """Times every (shape, op, impl, pass) on a ring of up to `ring` devices.

  Returns {'rows': [...], 'notes': [...]}.
  """
  devices = jax.devices()
  platform = devices[0].platform
  p = min(len(devices), ring)
  mesh = jax.make_mesh((p,), (_AXIS,), axis_types=(AxisType.Auto,), devices=devices[:p])
  dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  itemsize = jnp.dtype(dtype).itemsize
  notes = [f"ring over {p} {devices[0].device_kind} devices; dtype {jnp.dtype(dtype).name}; "
           f"shapes are per device (m tokens, k x n weight)",
           "rel_err: ||out - ref|| / ||ref||, worst of the output (of dx, dw for fwd+bwd), "
           "against the unsharded float32 x @ w at Precision.HIGHEST and its gradients"]
  if platform == "cpu":
    notes.append("CPU: simulated devices share the host's cores and Pallas runs in the TPU "
                 "interpreter: these timings show overhead, not overlap. The real measure "
                 "is a TPU (or multi-GPU for xla vs ppermute).")
    notes.append(f"CPU: Pallas rows skipped where a buffer exceeds "
                 f"{_INTERPRET_BUFFER_LIMIT // 1024} KiB (interpreter hang, see jax-notes).")
  if p == 1:
    notes.append("only 1 device: every impl reduces to a local dot. On CPU set "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=8 before starting Python.")
  if platform == "gpu":
    notes.append("GPU: 'pallas' is a TPU kernel (Mosaic) and is not timed here.")
  rows = []
  rng = np.random.RandomState(0)
  start = time.perf_counter()
  for name, m, ag_kn, rs_kn in _table(size, platform):
    for op, (k, n) in (("all_gather_matmul", ag_kn), ("matmul_reduce_scatter", rs_kn)):
      if op == "all_gather_matmul":
        x_shape, w_shape, local = (p * m, k), (k, p * n), (m, k, n)
      else:
        x_shape, w_shape, local = (p * m, p * k), (p * k, n), (p * m, k, n)
      x = jnp.asarray(rng.standard_normal(x_shape), dtype)
      w = jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(k), dtype)
      flops = 2 * p * m * k * n          # per device, forward
      references = _references(x, w)
      base = {}
      for impl, bidi in _variants(platform):
        if impl == "pallas" and not _pallas_fits(platform, p, m, k, n, itemsize):
          continue
        if bidi and m % 2:
          continue
        try:
          fwd, grad, in_specs = _build(op, impl, bidi, mesh)
          args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), in_specs)]
          for pass_name, fn, mult in (("fwd", fwd, 1), ("fwd+bwd", grad, 3)):
            t = time_fn(fn, *args, warmup=warmup, repeats=repeats)
            key = (pass_name,)
            if impl == "xla":
              base[key] = t["median_s"]
            rows.append({
                "shape": name, "op": op, "m,k,n": "x".join(map(str, local)), "P": p,
                "impl": impl + ("-bidi" if bidi else ""), "pass": pass_name,
                "median_ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"],
                "calls": t["calls"],
                "tflops_per_device": mult * flops / t["median_s"] / 1e12,
                "ratio_to_xla": t["median_s"] / base[key] if key in base else float("nan"),
                "rel_err": relative_error(fn(*args), references[pass_name], on_device=True),
            })
            print(f"[collective_matmul] {name} {op} {rows[-1]['impl']} {pass_name} done at "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        except ValueError as e:      # a shape the impl rejects: say so, keep going
          notes.append(f"{name} {op} {impl}{'-bidi' if bidi else ''}: skipped ({e})")
  return {"rows": rows, "notes": notes}
