"""From raw per-second samples to the windows the LSTM-VAEs read.

Minder (§4.1) aligns every machine's samples of a metric on one time grid and min-max normalises
each metric, so that one model per metric serves machines and tasks whose raw scales differ. The
range comes from healthy data; values outside it (a faulty machine) go beyond [0, 1] and are
clipped at `CLIP` so that a wild sample cannot saturate the LSTM.
"""
import dataclasses

import numpy as np

CLIP = (-2.0, 3.0)   # normalised values are clipped to this range (3 ranges below/above healthy)


@dataclasses.dataclass(frozen=True)
class Normaliser:
  """Per-metric min-max scaling: (x - low) / (high - low), with low/high robust percentiles
  (0.5 and 99.5) of healthy samples, so one stray healthy sample does not set the scale."""
  low: float
  high: float

  @classmethod
  def fit(cls, healthy: np.ndarray) -> "Normaliser":
    """From any array of one metric's healthy samples."""
    values = np.asarray(healthy, np.float64).ravel()
    values = values[np.isfinite(values)]
    if values.size == 0:
      raise ValueError("Normaliser.fit needs at least one finite healthy sample")
    low, high = np.percentile(values, [0.5, 99.5])
    if high - low < 1e-9:
      high = low + max(abs(low), 1.0) * 1e-3
    return cls(float(low), float(high))

  def __call__(self, x: np.ndarray) -> np.ndarray:
    scaled = (np.asarray(x, np.float64) - self.low) / (self.high - self.low)
    return np.clip(np.nan_to_num(scaled, nan=0.0), *CLIP).astype(np.float32)


def sliding_windows(series: np.ndarray, window: int, stride: int = 1) -> np.ndarray:
  """[..., T] -> [..., n, window]: the windows ending at samples window-1, window-1+stride, ...
  (a view, no copy)."""
  series = np.asarray(series)
  if series.shape[-1] < window:
    raise ValueError(f"a series of {series.shape[-1]} samples has no window of {window}")
  views = np.lib.stride_tricks.sliding_window_view(series, window, axis=-1)
  return views[..., ::stride, :]
