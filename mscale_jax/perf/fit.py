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
  """Predicted minus paper MFU, in points, for every row that has a paper figure.

  The paper figure is `paper.target_mfu`: the MFU of the paper's throughput where it gives
  one, its printed MFU elsewhere.
  """
  return [100 * paper.predict_row(r, hw, c).mfu - paper.target_mfu(r) for r in rows
          if paper.target_mfu(r) is not None]


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


@dataclasses.dataclass(frozen=True)
class Protocol:
  """Fit the constants on `fit_rows`, predict `test_rows` (named by a letter, see protocols)."""
  name: str
  description: str
  fit_rows: tuple
  test_rows: tuple


def protocols(rows: list | None = None) -> list:
  """The validation protocols (docs/perf_model.md), each a `Protocol`; the last is 'full'.

  (a) fit Table 3, predict Table 2; (b) fit the 256-GPU rows, predict every larger run;
  (c) fit the batch-768 rows, predict batch 6,144 (the protocol of the first contact, rerun on
  the current model); (d) fit up to 3,072 GPUs, predict 6,144-12,288; (e) fit up to 6,144,
  predict 8,192 and 12,288; (full) fit every row with a paper figure: the default constants.
  (b) to (e) predict larger GPU counts from smaller ones.
  """
  rows = paper.rows() if rows is None else rows
  known = tuple(r for r in rows if paper.target_mfu(r) is not None)
  table3 = tuple(r for r in known if r.table == "table3")
  batch_768 = tuple(r for r in known if r.global_batch != 6144)

  def split(name, description, fitted):
    return Protocol(name, description, fitted, tuple(r for r in known if r not in fitted))

  return [split("a", "fit Table 3, predict Table 2", table3),
          split("b", "fit 256 GPUs, predict 512-12,288", tuple(r for r in known if r.gpus == 256)),
          split("c", "fit batch 768, predict batch 6,144", batch_768),
          split("d", "fit <= 3,072 GPUs, predict 6,144-12,288",
                tuple(r for r in known if r.gpus <= 3072)),
          split("e", "fit <= 6,144 GPUs, predict 8,192-12,288",
                tuple(r for r in known if r.gpus <= 6144)),
          split("full", "fit every row (the defaults)", known)]


def distance(row: paper.Row, fit_rows) -> float:
  """How far `row` extrapolates from `fit_rows`, in doublings (log2 ratios), summed over:
  GPU count beyond the largest fitted for that model, global batch from the nearest fitted
  one, and parameter count from the nearest fitted model. 0 inside what was fitted."""
  gpus = max(f.gpus for f in fit_rows)
  batch = min(abs(math.log2(row.global_batch / f.global_batch)) for f in fit_rows)
  size = min(abs(math.log2(row.model.num_params / f.model.num_params)) for f in fit_rows)
  return max(0.0, math.log2(row.gpus / gpus)) + batch + size


@dataclasses.dataclass(frozen=True)
class Held:
  """One held-out row: the rule's error, its micro-batch nuisance range and distance."""
  row: paper.Row
  error: float           # rule's prediction minus the paper figure, points
  low: float             # slowest candidate micro-batch's MFU, percent
  high: float            # fastest (the rule's) MFU, percent
  target: float          # the paper figure, percent
  distance: float
  duplicate: bool        # the same run as a fitted row (Table 3's last step); not counted


@dataclasses.dataclass(frozen=True)
class Validation:
  """One protocol's outcome: the fit and its held-out rows."""
  protocol: Protocol
  fit: Fit
  held_out: tuple        # Held

  @property
  def name(self) -> str:
    """'<letter>: <description>'."""
    return f"{self.protocol.name}: {self.protocol.description}"

  @property
  def counted(self) -> list:
    """Held-out rows that are not a fitted row under another name."""
    return [h for h in self.held_out if not h.duplicate]

  @property
  def out_of_sample(self) -> list:
    """Errors (points) of the counted held-out rows."""
    return [h.error for h in self.counted]


def nuisance_range(row: paper.Row, hw: Hardware, c: Constants) -> tuple:
  """(low, high) MFU in percent over the candidate micro-batches of `row`: its nuisance range
  (the paper gives no micro-batch; `paper.micro_batch_choices`)."""
  choices = paper.micro_batch_choices(row.model, row.gpus, row.global_batch, row.techniques,
                                      hw, c)
  if not choices:
    mfu = 100 * paper.predict_row(row, hw, c).mfu
    return mfu, mfu
  return (100 * min(p.mfu for p in choices), 100 * max(p.mfu for p in choices))


def held_out(row: paper.Row, result: Fit, hw: Hardware) -> Held:
  """`row` predicted by the fit `result`, which did not see it."""
  target = paper.target_mfu(row)
  ours = 100 * paper.predict_row(row, hw, result.constants).mfu
  low, high = nuisance_range(row, hw, result.constants)
  return Held(row, ours - target, min(low, ours), max(high, ours), target,
              distance(row, result.rows), any(same_run(row, f) for f in result.rows))


def validate(hw: Hardware = A100_MEGASCALE, base: Constants = DEFAULT,
             points: int = GRID_POINTS, rows: list | None = None, names=None,
             progress=None) -> list:
  """Runs every protocol of `protocols(rows)` (or those `names`): one `Validation` each.

  `progress(protocol)` is called before each fit (a few seconds each).
  """
  out = []
  for protocol in protocols(rows):
    if names is not None and protocol.name not in names:
      continue
    if progress:
      progress(protocol)
    result = fit(list(protocol.fit_rows), hw, base, points=points)
    out.append(Validation(protocol, result,
                          tuple(held_out(r, result, hw) for r in protocol.test_rows)))
  return out
