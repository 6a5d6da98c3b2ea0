"""How much each constant moves the predictions: the fit's robustness, and the error bars."""
import dataclasses
import math

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
  are capped at 1. The worst error is against the paper's MFU of the rows that have one.
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
        if row.paper_mfu is not None:
          worst = max(worst, abs(100 * mfu - row.paper_mfu))
    out.append((name, move, worst))
  return sorted(out, key=lambda t: -t[1])


def _moves(rows, hw, trial, base):
  """Each row's MFU under `trial` minus `base`, in points."""
  return [100 * paper.predict_row(r, hw, trial).mfu - b for r, b in zip(rows, base)]


def _range_moves(name, rows, fit_rows, hw, c, base):
  """Moves of every row with unfitted `name` at each end of its range (level re-pinned)."""
  out = []
  for end in RANGES[name]:
    trial = fit.refit_level(fit_rows, hw, dataclasses.replace(c, **{name: end}))
    out.append(_moves(rows, hw, trial, base))
  return out


def _profile_moves(name, rows, fit_rows, hw, c, base, points):
  """Moves of every row over the values of fitted `name` that the fitted rows still allow.

  From the fitted value outward on the fit's grid, each value is tried with the level
  re-pinned; it is allowed while the RMS error over `fit_rows` stays within the profile
  bound r^2 <= r0^2 (1 + 4/n) (a 95% profile interval if the errors are independent with the
  fit's own RMS r0); the walk stops at the first value outside.
  """
  r0 = fit.rms(fit.errors(fit_rows, hw, c))
  bound = r0 * r0 * (1.0 + 4.0 / len(fit_rows))
  values = fit.grid(name, points)
  here = min(range(points), key=lambda i: abs(values[i] - getattr(c, name)))
  out = []
  for step in (-1, 1):
    i = here + step
    while 0 <= i < points:
      trial = fit.refit_level(fit_rows, hw, dataclasses.replace(c, **{name: values[i]}))
      if fit.rms(fit.errors(fit_rows, hw, trial)) ** 2 > bound:
        break
      out.append(_moves(rows, hw, trial, base))
      i += step
  return out


def prediction_intervals(rows: list, fit_rows: list, hw: Hardware = A100_MEGASCALE,
                         c: Constants = DEFAULT, points: int = fit.GRID_POINTS) -> tuple:
  """(low, high) MFU in percent per row of `rows`, and each constant's largest move.

  One constant at a time, all others held, and after each change the level (gemm_eff_max)
  re-fitted so `fit_rows` err zero on average, as a fit would re-pin it:
  - a constant that is not fitted goes to each end of its documented range (`RANGES`);
  - a fitted one walks its grid outward from the fitted value as far as the fitted rows allow
    (`_profile_moves`: a 95% profile interval).
  Per row, the upward moves of the constants add in quadrature to the upper bound and the
  downward ones to the lower bound (independent uncertainties); the fit's RMS residual over
  `fit_rows` (how well the data pins the level) adds to both. Returns ([(low, high)] aligned
  with rows, {name: largest move in points over rows}).
  """
  base = [100 * paper.predict_row(r, hw, c).mfu for r in rows]
  level = fit.rms(fit.errors(fit_rows, hw, c))
  ups, downs = [[level] for _ in rows], [[level] for _ in rows]
  moves = {}
  for name in RANGES:
    if name == "gemm_eff_max":
      continue
    if name in FITTED:
      trials = _profile_moves(name, rows, fit_rows, hw, c, base, points)
    else:
      trials = _range_moves(name, rows, fit_rows, hw, c, base)
    for i in range(len(rows)):
      ups[i].append(max([0.0] + [t[i] for t in trials]))
      downs[i].append(max([0.0] + [-t[i] for t in trials]))
    moves[name] = max([0.0] + [abs(d) for t in trials for d in t])
  bounds = [(b - math.sqrt(sum(d * d for d in dn)), b + math.sqrt(sum(u * u for u in up)))
            for b, up, dn in zip(base, ups, downs)]
  return bounds, moves
