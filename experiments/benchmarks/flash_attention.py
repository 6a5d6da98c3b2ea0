"""Flash attention (Pallas) vs XLA and cuDNN: causal and sliding-window, forward and fwd+bwd.

  python -m experiments.kernel_bench --kernel=flash_attention --size=full   # on a GPU

Shapes ('full'): a 1.3B-model layer (16 heads x 128, seq 2048, batch 8), a 175B layer's
per-device shard under TP 8 (128 / 8 = 16 heads x 128, seq 2048, batch 1) and seq 8192 with
full causal attention vs a window of 512. 'tiny' and 'small' are CPU shapes for the
interpreter. Implementations: 'pallas' (this repo's kernel), 'xla_reference' (float32 masked
softmax, `reference_attention`), 'xla_dpa' (`jax.nn.dot_product_attention(implementation='xla')`
in the input dtype) and, on GPU, 'cudnn' (the same call with implementation='cudnn'). On an
accelerator, rows named 'pallas FQxFK bwd BQxBK' also sweep block sizes on two shapes.
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import relative_error, time_fn
from pallas_kernels.flash_attention import flash_attention, reference_attention

# (label, batch, seq, heads, head_dim, window); all causal. window=None is full causal.
_SHAPES = {
    "tiny": [("tiny causal", 1, 128, 2, 32, None), ("tiny window 32", 1, 128, 2, 32, 32)],
    "small": [("small causal", 1, 512, 4, 64, None),
              ("small s1024 causal", 1, 1024, 2, 64, None),
              ("small s1024 window 128", 1, 1024, 2, 64, 128)],
    "full": [("1.3B layer", 8, 2048, 16, 128, None),
             ("175B TP8 shard", 1, 2048, 16, 128, None),
             ("s8192 causal", 1, 8192, 16, 128, None),
             ("s8192 window 512", 1, 8192, 16, 128, 512)],
}
# Interpreter runs use smaller blocks than the accelerator defaults so window skipping shows.
_CPU_BLOCKS = {"tiny": 32, "small": 64}
# On an accelerator, extra block configurations for these shapes: ((fwd bq, bk), (bwd bq, bk)).
_SWEEP_SHAPES = ("175B TP8 shard", "s8192 causal")
_SWEEP = (((128, 128), (64, 64)), ((64, 64), (64, 64)), ((128, 64), (128, 64)),
          ((128, 64), (64, 128)))


def kept_pairs(seq_len: int, window: int | None) -> int:
  """Number of (query, key) pairs a causal (windowed) mask keeps."""
  per_row = np.arange(1, seq_len + 1)
  if window is not None:
    per_row = np.minimum(per_row, window)
  return int(per_row.sum())


def attention_flops(batch, seq_len, heads, head_dim, window, backward: bool) -> float:
  """Matmul FLOPs on kept pairs only: 4*D per pair forward (QK^T, PV), 8*D more backward
  (dV, dP, dQ, dK); the backward's recomputation of QK^T is not counted."""
  per_pair = 12 if backward else 4
  return float(per_pair * head_dim * batch * heads * kept_pairs(seq_len, window))


def _implementations(platform: str, window, block, sweep: bool):
  local = None if window is None else (window - 1, 0)
  impls = {
      "pallas": functools.partial(flash_attention, causal=True, window=window, block_q=block,
                                  block_k=block, bwd_blocks=None if block is None else
                                  (block, block)),
      "xla_reference": functools.partial(reference_attention, causal=True, window=window),
      "xla_dpa": functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                   local_window_size=local, implementation="xla"),
  }
  if platform == "gpu":
    impls["cudnn"] = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                       local_window_size=local, implementation="cudnn")
  if sweep:
    for (fq, fk), (bq, bk) in _SWEEP:
      impls[f"pallas {fq}x{fk} bwd {bq}x{bk}"] = functools.partial(
          flash_attention, causal=True, window=window, block_q=fq, block_k=fk,
          bwd_blocks=(bq, bk))
  return impls


def _fwd(fn):
  return jax.jit(fn)


def _fwd_bwd(fn):
  def step(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)
  return jax.jit(step)


def _targets(rows, platform) -> list[str]:
  """Checks the GPU targets against the rows; on other platforms only says what they are."""
  targets = ["target (GPU, bf16, causal, head_dim 128): pallas fwd+bwd >= 0.9x cuDNN at seq "
             "2048 and 8192", "target (GPU): window 512 at seq 8192 >= 4x faster than full "
             "causal, fwd+bwd"]
  if platform != "gpu":
    return [t + " -- not evaluated on " + platform for t in targets]
  def time_of(label, impl, pass_):
    for r in rows:
      if r["shape"] == label and r["impl"] == impl and r["pass"] == pass_ and "median_ms" in r:
        return r["median_ms"]
    return None
  out = []
  for label in ("175B TP8 shard", "1.3B layer", "s8192 causal"):
    mine, cudnn = time_of(label, "pallas", "fwd+bwd"), time_of(label, "cudnn", "fwd+bwd")
    if mine and cudnn:
      ratio = cudnn / mine
      out.append(f"{label}: pallas fwd+bwd = {ratio:.2f}x cuDNN speed "
                 f"({'PASS' if ratio >= 0.9 else 'FAIL'} vs 0.9x)")
    variants = [r for r in rows if r["shape"] == label and r["impl"].startswith("pallas ")
                and r["pass"] == "fwd+bwd" and "median_ms" in r]
    if variants and cudnn:
      best = min(variants, key=lambda r: r["median_ms"])
      out.append(f"{label}: best swept blocks '{best['impl']}' fwd+bwd = "
                 f"{cudnn / best['median_ms']:.2f}x cuDNN speed")
  full, win = time_of("s8192 causal", "pallas", "fwd+bwd"), time_of("s8192 window 512",
                                                                    "pallas", "fwd+bwd")
  if full and win:
    out.append(f"s8192: window 512 is {full / win:.2f}x faster than causal "
               f"({'PASS' if full / win >= 4 else 'FAIL'} vs 4x)")
  return targets + out


def run(size: str, warmup: int, repeats: int) -> dict:
  """Times every implementation on the shape table for `size`; see the module docstring."""
  platform = jax.devices()[0].platform
  dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  block = _CPU_BLOCKS.get(size) if platform == "cpu" else None
  rows, notes = [], []
  start = time.perf_counter()
  for label, batch, seq_len, heads, head_dim, window in _SHAPES[size]:
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = [jax.random.normal(key, (batch, seq_len, heads, head_dim), dtype)
                   for key in keys]
    times = {}
    sweep = platform != "cpu" and label in _SWEEP_SHAPES
    exact = functools.partial(reference_attention, causal=True, window=window)
    upcast = [a.astype(jnp.float32) for a in (q, k, v, do)]
    references = {"fwd": _fwd(exact)(*upcast[:3]), "fwd+bwd": _fwd_bwd(exact)(*upcast)}
    for impl, fn in _implementations(platform, window, block, sweep).items():
      for pass_, wrapped, args in (("fwd", _fwd(fn), (q, k, v)),
                                   ("fwd+bwd", _fwd_bwd(fn), (q, k, v, do))):
        row = {"shape": label, "batch": batch, "seq": seq_len, "heads": heads,
               "head_dim": head_dim, "window": window or 0, "dtype": jnp.dtype(dtype).name,
               "impl": impl, "pass": pass_}
        try:
          stats = time_fn(wrapped, *args, warmup=warmup, repeats=repeats)
        except Exception as e:  # pylint: disable=broad-except
          notes.append(f"{label} {impl} {pass_}: failed: {type(e).__name__}: {str(e)[:200]}")
          continue
        flops = attention_flops(batch, seq_len, heads, head_dim, window, pass_ == "fwd+bwd")
        row["median_ms"] = stats["median_s"] * 1e3
        row["calls"] = stats["calls"]
        row["tflops"] = flops / stats["median_s"] / 1e12
        row["rel_err"] = relative_error(wrapped(*args), references[pass_], on_device=True)
        print(f"[flash_attention] {label} {impl} {pass_} done at "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        times[(impl, pass_)] = stats["median_s"]
        rows.append(row)
    baseline = "cudnn" if platform == "gpu" else "xla_reference"
    for row in rows:
      if row["shape"] == label and (baseline, row["pass"]) in times and "median_ms" in row:
        row[f"speed_vs_{baseline}"] = times[(baseline, row["pass"])] / (row["median_ms"] / 1e3)
  notes.append("TFLOP/s count matmul FLOPs of the (query, key) pairs the mask keeps only "
               "(4*D per pair forward, +8*D backward; the backward's recompute of QK^T is not "
               "counted), so windowed and causal rows compare as useful work.")
  notes.append("rel_err: ||out - ref|| / ||ref||, worst of the output (and dq, dk, dv for "
               "fwd+bwd), against reference_attention on the inputs upcast to float32; bf16 "
               "outputs land near 1e-3 to 1e-2.")
  notes.append(f"speed_vs_* = baseline time / this time (>1: faster than the baseline). "
               f"dtype {jnp.dtype(dtype).name}; xla_reference computes in float32.")
  if platform == "cpu":
    notes.append(f"CPU: the Pallas kernel runs in the Pallas interpreter (blocks {block}); "
                 "these times measure interpreter overhead, not kernel speed.")
  notes.extend(_targets(rows, platform))
  return {"rows": rows, "notes": notes}
