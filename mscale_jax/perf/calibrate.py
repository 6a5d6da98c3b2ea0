"""Replaces modelled GEMM efficiency with measured efficiency from a benchmark record.

A record is what `python -m experiments.kernel_bench --kernel=gemm` writes: `figures` holds
rows with m, k, n, dtype and achieved tflops (and peak_tflops when the device's peak is known),
`device` names the accelerator. The efficiency curve 1/eff = (1 + edge*(1/m+1/k+1/n)) / eff_max
is linear in S = 1/m+1/k+1/n, so a least-squares line through (S, 1/eff) gives eff_max and edge.
A curve measured on one accelerator says little about another, so calibrating a hardware preset
with a record from a different device is refused unless asked for (`allow_other_device`).
"""
import dataclasses
import json

from mscale_jax.errors import ConfigError
from mscale_jax.flops import known_peak
from mscale_jax.perf.constants import Constants
from mscale_jax.perf.hardware import Hardware, models_device


def load_gemm_rows(path: str) -> tuple:
  """(rows with an efficiency, device description) from a kernel_bench-gemm record."""
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError("calibrate", path, f"a readable JSON results record ({e})") from e
  device = record.get("device", {})
  rows = []
  for row in record.get("figures", []):
    if not all(key in row for key in ("m", "k", "n", "tflops")):
      continue
    peak = row.get("peak_tflops") or (known_peak(device.get("device_kind", ""),
                                                 row.get("dtype", "bfloat16")) or 0) / 1e12
    if peak:
      rows.append({**row, "efficiency": row["tflops"] / peak})
  if len(rows) < 2:
    raise ConfigError("calibrate", path,
                      "a gemm record with at least two rows (m, k, n, tflops) on a device "
                      "whose peak is known")
  return rows, device


def fit_gemm_curve(rows: list) -> tuple:
  """(eff_max, edge) of the least-squares line 1/eff = a + b*S over measured rows."""
  xs = [1.0 / r["m"] + 1.0 / r["k"] + 1.0 / r["n"] for r in rows]
  ys = [1.0 / r["efficiency"] for r in rows]
  n = len(xs)
  mx, my = sum(xs) / n, sum(ys) / n
  sxx = sum((x - mx) ** 2 for x in xs)
  b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
  b = max(b, 0.0)                      # larger GEMMs are never modelled as slower
  a = my - b * mx if b > 0 else my
  return 1.0 / a, b / a


def calibrated(c: Constants, path: str, hw: Hardware | None = None, *,
               allow_other_device: bool = False) -> tuple:
  """(constants with the measured GEMM curve, a note naming what changed and from where).

  With `hw`, the record must come from the accelerator that preset models (ConfigError
  otherwise) unless `allow_other_device`; the note then says the devices differ.
  """
  rows, device = load_gemm_rows(path)
  kind = device.get("device_kind", "?")
  other = hw is not None and not models_device(hw, kind)
  if other and not allow_other_device:
    raise ConfigError(
        "calibrate", path,
        f"a record measured on the accelerator of hardware preset {hw.name!r} (device_kind "
        f"containing {' or '.join(repr(k) for k in hw.device_kinds) or '?'}); this one has "
        f"device_kind {kind!r}. Benchmark on that accelerator, pick the matching preset, or "
        f"pass allow_other_device=True (--calibrate_any_device) to apply it anyway")
  eff_max, edge = fit_gemm_curve(rows)
  new = dataclasses.replace(c, gemm_eff_max=eff_max, gemm_edge=edge)
  note = (f"GEMM curve from {len(rows)} rows measured on {kind}: "
          f"eff_max {c.gemm_eff_max:.3f} -> {eff_max:.3f}, edge {c.gemm_edge:.1f} -> {edge:.1f}")
  if other:
    note += f" (applied to {hw.name} although measured on another device)"
  return new, note
