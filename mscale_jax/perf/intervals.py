"""Prediction intervals from the model's own out-of-sample errors, and the coverage they reach.

The validation protocols (`fit.validate`) fit the constants on some of the paper's rows and
predict the others, each at an extrapolation distance `d` (`fit.distance`: doublings of GPU
count, batch and model size beyond what was fitted). Their errors say how wrong the model is
where it was not fitted, and how that grows with `d`:

  scale(d) = base + slope * d       least squares on the absolute errors, both >= 0, and at
                                    least the paper's rounding (0.05 points)
  half_width(d) = q * scale(d)      q: the split-conformal quantile of |error| / scale(d) at
                                    the nominal coverage (e.g. 80%)

An error here is how far the paper's figure lies outside the micro-batch nuisance range of the
prediction (the MFU of every plausible micro-batch, since the paper gives none; 0 inside it),
so the reported interval is that range widened by `half_width(d)` on both sides, and it is that
interval whose coverage is calibrated. With every error used to calibrate, the coverage on those
errors is nominal by construction; what the protocols actually achieve is measured by leaving
each protocol out in turn (`cross_validated_coverage`). Pure Python, deterministic.
"""
import dataclasses
import math

RESOLUTION = 0.05      # the paper prints MFU to 0.1 points: no scale below its rounding


@dataclasses.dataclass(frozen=True)
class ErrorModel:
  """How the out-of-sample error grows with extrapolation distance, calibrated at `nominal`."""
  base: float            # points at distance 0
  slope: float           # points per doubling
  quantile: float        # q
  nominal: float         # the coverage the half-width is calibrated for
  count: int             # errors it was calibrated on

  def scale(self, distance: float) -> float:
    """The error scale at `distance` (points)."""
    return max(RESOLUTION, self.base + self.slope * distance)

  def half_width(self, distance: float) -> float:
    """Half-width (points) of the nominal interval at `distance`."""
    return self.quantile * self.scale(distance)


def excess(value: float, low: float, high: float) -> float:
  """How far `value` lies outside [low, high]: negative below, positive above, 0 inside."""
  return value - min(max(value, low), high)


def fit_scale(errors: list, distances: list) -> tuple:
  """(base, slope) of the least-squares line |error| = base + slope * distance, both >= 0."""
  n = len(errors)
  size = [abs(e) for e in errors]
  mean_d, mean_e = sum(distances) / n, sum(size) / n
  sxx = sum((d - mean_d) ** 2 for d in distances)
  slope = sum((d - mean_d) * (e - mean_e) for d, e in zip(distances, size)) / sxx if sxx else 0.0
  slope = max(0.0, slope)
  base = mean_e - slope * mean_d
  if base < 0.0:           # refit through the origin: slope alone
    base = 0.0
    sdd = sum(d * d for d in distances)
    slope = sum(d * e for d, e in zip(distances, size)) / sdd if sdd else 0.0
  return base, slope


def conformal_quantile(scores: list, nominal: float) -> float:
  """The ceil((n + 1) * nominal)-th smallest score: a new score exchangeable with these falls at
  or below it with probability >= nominal (split conformal). Infinite when n is too small."""
  rank = math.ceil((len(scores) + 1) * nominal)
  if rank > len(scores):
    return math.inf
  return sorted(scores)[rank - 1]


def calibrate(errors: list, distances: list, nominal: float = 0.8) -> ErrorModel:
  """The `ErrorModel` of out-of-sample `errors` (points) at their `distances`."""
  if not errors:
    raise ValueError("calibrate needs at least one out-of-sample error")
  base, slope = fit_scale(errors, distances)
  model = ErrorModel(base, slope, 1.0, nominal, len(errors))
  scores = [abs(e) / model.scale(d) for e, d in zip(errors, distances)]
  return dataclasses.replace(model, quantile=conformal_quantile(scores, nominal))


def coverage(errors: list, half_widths: list) -> float:
  """Fraction of `errors` with |error| <= its half-width."""
  return sum(abs(e) <= w for e, w in zip(errors, half_widths)) / len(errors)


def cross_validated_coverage(groups: dict, nominal: float = 0.8) -> dict:
  """Coverage each group's errors reach under an `ErrorModel` calibrated on the other groups.

  `groups` maps a name (a protocol) to (errors, distances). Returns {name: coverage} and
  'pooled' (all held-out errors together). Groups share rows, so this is optimistic where a
  row's error in one protocol resembles its error in another.
  """
  out, hits, total = {}, 0, 0
  for name, (errs, dists) in groups.items():
    others = [(e, d) for other, (es, ds) in groups.items() if other != name
              for e, d in zip(es, ds)]
    if not errs or not others:
      continue
    model = calibrate([e for e, _ in others], [d for _, d in others], nominal)
    widths = [model.half_width(d) for d in dists]
    out[name] = coverage(errs, widths)
    hits += sum(abs(e) <= w for e, w in zip(errs, widths))
    total += len(errs)
  out["pooled"] = hits / total if total else math.nan
  return out
