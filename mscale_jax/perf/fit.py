"""Fitting the efficiency constants to paper rows, and the out-of-sample validation protocol.

The fit is a deterministic grid search: each constant of `constants.FITTED` is confined to
an evenly spaced grid over its documented range (`constants.RANGES`); starting from the middle
of every range, each constant in turn takes the grid value that minimises the RMS error over the
fitted rows; when no single constant improves, pairs are moved one grid step each (a diagonal
valley would stop a pure coordinate search); it ends when neither helps. Pure Python, a few
seconds, the same answer on every machine. `validate` fits on one subset of the paper's rows
and predicts the others.
"""
import dataclasses
import math

from mscale_jax.perf import paper
from mscale_jax.perf.constants import DEFAULT, FITTED, RANGES, Constants
from mscale_jax.perf.hardware import A100_MEGASCALE, Hardware

GRID_POINTS = 13
MAX_SWEEPS = 40


def grid(name: str, points: int = GRID_POINTS) -> list:
  """`points` evenly spaced values across the documented range of constant `name`."""
  lo, hi = RANGES[name]
  return [round(lo + (hi - lo) * i / (points - 1), 12) for i in range(points)]


def errors(rows: list, hw: Hardware, c: Constants) -> list:
  """Predicted minus paper MFU, in points, for every row that has a paper figure."""
  return [100 * paper.predict_row(r, hw, c).mfu - r.paper_mfu for r in rows
          if r.paper_mfu is not None]


def rms(errs: list) -> float:
  """Root mean square of `errs` (0 for none)."""
  return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else 0.0


@dataclasses.dataclass(frozen=True)
class Fit:
  """A fitted constant set and how well it matches the rows it was fitted on."""
  constants: Constants
  names: tuple           # the constants that were fitted
  rows: tuple            # the rows they were fitted on
  rms: float             # points
  worst: float           # largest absolute error, points
  sweeps: int


def _pair_steps(c: Constants, grids: dict) -> list:
  """Every move of two fitted constants by one grid step each, in a fixed order."""
  index = {n: g.index(getattr(c, n)) for n, g in grids.items()}
  names = list(grids)
  out = []
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      for da in (-1, 1):
        for db in (-1, 1):
          ia, ib = index[a] + da, index[b] + db
          if 0 <= ia < len(grids[a]) and 0 <= ib < len(grids[b]):
            out.append({a: grids[a][ia], b: grids[b][ib]})
  return out


def fit(rows: list, hw: Hardware = A100_MEGASCALE, base: Constants = DEFAULT,
        names: tuple = FITTED, points: int = GRID_POINTS) -> Fit:
  """Coordinate (then pairwise) search of `names` on their grids, minimising RMS error on `rows`.

  Every other constant keeps its value in `base`; the starting point is the middle grid value
  of each fitted constant, so the result does not depend on `base`'s fitted values.
  """
  grids = {n: grid(n, points) for n in names}
  c = dataclasses.replace(base, **{n: g[len(g) // 2] for n, g in grids.items()})
  best = rms(errors(rows, hw, c))
  sweeps = 0
  for sweeps in range(1, MAX_SWEEPS + 1):
    trials = [{name: value} for name in names for value in grids[name]
              if value != getattr(c, name)]
    before = best
    for change in trials:
      trial = dataclasses.replace(c, **change)
      score = rms(errors(rows, hw, trial))
      if score < best - 1e-9:
        c, best = trial, score
    if best < before - 1e-9:
      continue
    # No single constant improves: try moving two at once by one grid step each, so that a
    # valley along a diagonal (two constants trading off) does not stop the search.
    for change in _pair_steps(c, grids):
      trial = dataclasses.replace(c, **change)
      score = rms(errors(rows, hw, trial))
      if score < best - 1e-9:
        c, best = trial, score
        break
    else:
      break
  errs = errors(rows, hw, c)
  return Fit(c, tuple(names), tuple(rows), rms(errs), max(abs(e) for e in errs), sweeps)


def refit_level(rows: list, hw: Hardware, c: Constants, iters: int = 8) -> Constants:
  """`c` with gemm_eff_max (the level every row moves with) set so `rows` err 0 on average.

  Secant steps on the mean error (MFU is close to linear in gemm_eff_max), kept inside its
  documented range. Used by the error bars: after another constant moves across its range,
  this is the level a fit would re-pin.
  """
  lo, hi = RANGES["gemm_eff_max"]
  mean = lambda v: sum(errors(rows, hw, dataclasses.replace(c, gemm_eff_max=v))) / len(rows)
  x0 = c.gemm_eff_max
  x1 = x0 + 0.01 if x0 + 0.01 <= hi else x0 - 0.01
  f0, f1 = mean(x0), mean(x1)
  for _ in range(iters):
    if abs(f1) < 1e-4 or f1 == f0:
      break
    x0, x1, f0 = x1, min(hi, max(lo, x1 - f1 * (x1 - x0) / (f1 - f0))), f1
    f1 = mean(x1)
  return dataclasses.replace(c, gemm_eff_max=x1)


def same_run(a: paper.Row, b: paper.Row) -> bool:
  """Whether two rows are the same run (Table 3's last step is Table 2's 256-GPU MegaScale)."""
  return (a.model, a.gpus, a.global_batch, a.techniques) == (b.model, b.gpus, b.global_batch,
                                                              b.techniques)


def protocols(rows: list | None = None) -> list:
  """(name, fit rows, held-out rows) of the validation protocol (docs/perf_model.md).

  (a) fit on Table 3 only, predict Table 2; (b) fit on the 256-GPU rows only, predict 512-1,024
  GPUs; (full) fit on both tables, the default constants. Every protocol also predicts the
  12,288-GPU rows, the only larger runs with a figure in our notes, which no fit ever sees.
  """
  rows = paper.rows() if rows is None else rows
  known = [r for r in rows if r.paper_mfu is not None]
  table3 = [r for r in known if r.table == "table3"]
  table2 = [r for r in known if r.table == "table2" and r.global_batch == 768]
  large = [r for r in known if r not in table3 + table2]
  at_256 = [r for r in table3 + table2 if r.gpus == 256]
  return [("a: fit Table 3, predict Table 2", table3, table2 + large),
          ("b: fit 256 GPUs, predict 512-1,024", at_256,
           [r for r in table2 if r.gpus > 256] + large),
          ("full: fit Tables 2+3 (the defaults)", table3 + table2, large)]


@dataclasses.dataclass(frozen=True)
class Validation:
  """One protocol's outcome: the fit and the held-out rows' errors (points)."""
  name: str
  fit: Fit
  held_out: tuple        # (row, error, same run as a fitted row)

  @property
  def out_of_sample(self) -> list:
    """Errors of held-out rows that are not a fitted row under another name."""
    return [e for _, e, dup in self.held_out if not dup]


def validate(hw: Hardware = A100_MEGASCALE, base: Constants = DEFAULT,
             points: int = GRID_POINTS) -> list:
  """Runs every protocol of `protocols()`: one `Validation` each."""
  out = []
  for name, fit_rows, test_rows in protocols():
    result = fit(fit_rows, hw, base, points=points)
    held = tuple((r, errors([r], hw, result.constants)[0], any(same_run(r, f) for f in fit_rows))
                 for r in test_rows)
    out.append(Validation(name, result, held))
  return out
