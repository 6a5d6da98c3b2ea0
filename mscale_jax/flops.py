"""Model FLOPs per token (the Megatron formula MegaScale reports), accelerator peaks, and MFU.

MFU = tokens/s * FLOPs-per-token / (devices * peak FLOP/s). FLOPs per token use the Megatron-LM
formula without recomputation, `72 l h^2 (1 + s/(6h) + V/(16 l h))`, the one the paper's numbers
match (1.0762e12 for the 175B model). It counts a full causal attention matrix whatever the
window, so sliding-window attention shows up as higher MFU, as in the paper. The peak is the
accelerator's dense bf16 peak whatever the compute dtype (the paper's denominator; float32
matmuls run as TF32 on A100/H100 by default anyway).

This module is pure Python; only `measure_cpu_peak` imports JAX.
"""
import json
import os
import time

from mscale_jax.files import write_json

# Dense peak FLOP/s by device kind and dtype (vendor data sheets, no sparsity).
PEAK_FLOPS = {
    "a100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12, "tf32": 156e12},
    "h100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "tf32": 494e12},   # SXM
    "h100 pcie": {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12, "tf32": 378e12},
    "h200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "tf32": 494e12},   # SXM
    "tpu v4": {"bfloat16": 275e12, "float32": 275e12 / 4},
    "tpu v5 lite": {"bfloat16": 197e12, "float32": 197e12 / 4},   # v5e
    "tpu v5e": {"bfloat16": 197e12, "float32": 197e12 / 4},
    "tpu v5p": {"bfloat16": 459e12, "float32": 459e12 / 4},
    "tpu v5": {"bfloat16": 459e12, "float32": 459e12 / 4},        # v5p reports 'TPU v5'
}


def megatron_flops_per_token(num_layers: int, hidden: int, seq_len: int, vocab: int) -> float:
  """Training FLOPs per token (forward + backward, no recomputation), Megatron-LM's formula."""
  l, h, s, v = num_layers, hidden, seq_len, vocab
  return 72.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def model_flops_per_token(config) -> float:
  """Training FLOPs per token of a `ModelConfig`, counted as the Megatron formula counts them.

  Per layer: 6 x the matmul weights (QKV and output 4h^2, MLP (g+1) h F for g input
  projections: g=2 for SwiGLU) plus 12 s h for full causal attention (a window is not
  subtracted); 4.5 h V for the logits. With a GeLU MLP of width 4h this is exactly
  `megatron_flops_per_token`, and it stays comparable for other MLP widths and SwiGLU.
  """
  h, s, v, f = config.hidden, config.seq_len, config.vocab_size, config.mlp_dim
  gates = 2 if config.mlp_activation == "swiglu" else 1
  per_layer = 6.0 * (4 * h * h + (gates + 1) * h * f) + 12.0 * s * h
  return config.num_layers * per_layer + 4.5 * h * v


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak_flops: float) -> float:
  """Model FLOPs utilisation as a fraction of `num_devices * peak_flops`."""
  return tokens_per_s * flops_per_token / (num_devices * peak_flops)


def known_peak(device_kind: str, dtype: str) -> float | None:
  """Peak FLOP/s of a known accelerator (matched on its JAX `device_kind`), or None."""
  kind = device_kind.lower()
  for name in sorted(PEAK_FLOPS, key=len, reverse=True):
    if name in kind:
      return PEAK_FLOPS[name].get(dtype)
  return None


def measure_cpu_peak(dtype: str = "float32", size: int = 1024, repeats: int = 5,
                     cache_path: str | None = None) -> float:
  """Measures this CPU's matmul FLOP/s in `dtype` (best of `repeats`), cached in a JSON file.

  CPU has no data-sheet peak; the best square-matmul rate on this machine stands in for one,
  measured once per (dtype, size, host) and cached so every run compares against the same value.
  """
  cache_path = cache_path or os.path.join(os.path.expanduser("~"), ".cache", "mscale_jax",
                                          "cpu_peak.json")
  key = f"{dtype}-{size}-{os.uname().nodename}-{os.cpu_count()}"
  cache = {}
  if os.path.exists(cache_path):
    try:
      with open(cache_path) as f:
        cache = json.load(f)
    except (OSError, ValueError):
      cache = {}
  if key in cache:
    return float(cache[key])
  import jax
  import jax.numpy as jnp
  cpu = jax.devices("cpu")[0]
  a = jax.device_put(jnp.ones((size, size), dtype), cpu)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  peak = 2.0 * size ** 3 / best
  cache[key] = peak
  write_json(cache_path, cache)
  return peak
