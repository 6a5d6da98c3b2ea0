"""How much the constants move the predictions: +-10% each, and their ranges varied jointly.

The constant-range band is one labelled component of the error bars; the prediction interval
proper comes from the model's out-of-sample errors (`intervals`).
"""
import dataclasses
import random

from mscale_jax.perf import fit, paper
from mscale_jax.perf.constants import DEFAULT, FITTED, RANGES, Constants
from mscale_jax.perf.hardware import A100_MEGASCALE, Hardware


def scalar_fields(c: Constants) -> list:
  """Names of the float constants (efficiencies, latencies, host times) a sweep can scale."""
  return [f.name for f in dataclasses.fields(c) if isinstance(getattr(c, f.name), float)]


def sensitivity(rows: list, step: float = 0.1, hw: Hardware = A100_MEGASCALE,
                c: Constants = DEFAULT) -> list:
  """Per float constant: (name, largest MFU move in points over `rows`, worst error after).

  Each constant is scaled by (1 - step) and (1 + step) in turn, all others held; efficiencies
  are capped at 1. The worst error is against the paper figure (`paper.target_mfu`) of the
  rows that have one.
  """
  base = {id(r): paper.predict_row(r, hw, c).mfu for r in rows}
  out = []
  for name in scalar_fields(c):
    move, worst = 0.0, 0.0
    for factor in (1.0 - step, 1.0 + step):
      value = getattr(c, name) * factor
      if name.endswith("_eff") or name == "gemm_eff_max":
        value = min(value, 1.0)
      trial = dataclasses.replace(c, **{name: value})
      for row in rows:
        mfu = paper.predict_row(row, hw, trial).mfu
        move = max(move, 100 * abs(mfu - base[id(row)]))
        if paper.target_mfu(row) is not None:
          worst = max(worst, abs(100 * mfu - paper.target_mfu(row)))
    out.append((name, move, worst))
  return sorted(out, key=lambda t: -t[1])


def profile_range(name: str, fit_rows: list, hw: Hardware, c: Constants,
                  points: int = fit.GRID_POINTS) -> tuple:
  """(low, high) values of fitted constant `name` that the fitted rows allow, one at a time.

  From the fitted value outward on the fit's grid, each value is tried with the level
  (gemm_eff_max) re-pinned; it is allowed while the RMS error over `fit_rows` stays within
  r^2 <= r0^2 (1 + 4/n) (a 95% profile interval if the errors were independent with the fit's
  own RMS r0); the walk stops at the first value outside.
  """
  r0 = fit.rms(fit.errors(fit_rows, hw, c))
  bound = r0 * r0 * (1.0 + 4.0 / len(fit_rows))
  values = fit.grid(name, points)
  here = min(range(points), key=lambda i: abs(values[i] - getattr(c, name)))
  ends = []
  for step in (-1, 1):
    i = here
    while 0 <= i + step < points:
      trial = fit.refit_level(fit_rows, hw, dataclasses.replace(c, **{name: values[i + step]}))
      if fit.rms(fit.errors(fit_rows, hw, trial)) ** 2 > bound:
        break
      i += step
    ends.append(values[i])
  return tuple(ends)


# 95% quantile of a chi-square with k degrees of freedom, for the joint acceptance bound.
_CHI2_95 = {1: 3.84, 2: 5.99, 3: 7.81, 4: 9.49, 5: 11.07, 6: 12.59, 7: 14.07, 8: 15.51}


def constant_range_band(rows: list, fit_rows: list, hw: Hardware = A100_MEGASCALE,
                        c: Constants = DEFAULT, samples: int = 48,
                        points: int = fit.GRID_POINTS, seed: int = 0) -> dict:
  """How far the constants' documented ranges move each row, varied jointly.

  Every constant of `RANGES` but the level varies at once over a Latin hypercube of `samples`
  points (fixed `seed`: the same points on every run): an unfitted one over its documented
  range, a fitted one over its `profile_range`. At each point the level is re-pinned to the
  fitted rows and the point is kept only if the fitted rows still allow it jointly (RMS^2 <=
  r0^2 (1 + chi2_k(95%) / n), k the fitted constants varied), so constants that trade off
  against each other move together instead of adding in quadrature as if independent. The band
  is each row's lowest and highest MFU over the kept points and the defaults. It measures what
  the ranges allow, not how wrong the model's structure is (that is `intervals`).
  Returns {'band': [(low, high)] aligned with rows, 'ranges': {name: (lo, hi)}, 'kept': int,
  'samples': int}.
  """
  rng = random.Random(seed)
  base = [100 * paper.predict_row(r, hw, c).mfu for r in rows]
  ranges = {name: (profile_range(name, fit_rows, hw, c, points) if name in FITTED
                   else RANGES[name]) for name in RANGES if name != "gemm_eff_max"}
  varied_fitted = sum(1 for n in ranges if n in FITTED and ranges[n][0] != ranges[n][1])
  r0 = fit.rms(fit.errors(fit_rows, hw, c))
  bound = r0 * r0 * (1.0 + _CHI2_95.get(max(1, varied_fitted), 15.5) / len(fit_rows))
  strata = {name: rng.sample(range(samples), samples) for name in ranges}
  lows, highs, kept = list(base), list(base), 0
  for k in range(samples):
    values = {name: lo + (hi - lo) * (strata[name][k] + rng.random()) / samples
              for name, (lo, hi) in ranges.items()}
    trial = fit.refit_level(fit_rows, hw, dataclasses.replace(c, **values))
    if fit.rms(fit.errors(fit_rows, hw, trial)) ** 2 > bound:
      continue
    kept += 1
    for i, row in enumerate(rows):
      mfu = 100 * paper.predict_row(row, hw, trial).mfu
      lows[i], highs[i] = min(lows[i], mfu), max(highs[i], mfu)
  return {"band": list(zip(lows, highs)), "ranges": ranges, "kept": kept, "samples": samples}
