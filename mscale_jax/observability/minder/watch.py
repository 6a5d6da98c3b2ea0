"""Minder in the driver: per-rank monitoring samples in, flags out.

Workers send one sample per second (resilience/worker/monitor.py, `Heartbeat.monitor`). The
watch lines them up on whole seconds (a rank that missed a second repeats its previous sample,
for up to `max_gap_s`), trains Minder's per-metric models on the job's own first `fit_s` seconds
(the paper trains on normal data; a job's first minutes are the normal data at hand, so a fault
present from the very start is missed), in a background thread, and from then on runs
`MinderDetector` every `stride` seconds on the last `window` seconds of every rank.

Needs 3 or more ranks: with two, each is as far from the other as the other from it.
"""
import collections
import threading

import numpy as np

def _default_config():
  from mscale_jax.observability.minder.detector import MinderConfig
  from mscale_jax.observability.minder.vae import VAEConfig
  # MinderConfig's thresholds (made fit for the job's size in `_on_second`); fewer VAE steps
  # than the fleet evaluation's, so that training beside the driver takes seconds.
  return MinderConfig(vae=VAEConfig(steps=200))


WATCH_METRICS = ("step_time_s", "data_wait_s", "cpu_frac", "rss_mb", "hb_rtt_ms",
                 "io_write_mb_s", "device_mem_mb", "runq_wait_frac", "runq_wait_share",
                 "nivcsw_per_s", "majflt_per_s", "sample_lag_ms")


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


class MinderWatch:
  """Args:
    fit_s: seconds of aligned samples (all ranks) to train on before detecting.
    config: the MinderConfig (None: its defaults, with 200 VAE steps); applied through
      `for_machines(number of ranks)`.
    say: the driver's print, for progress lines.
  """

  def __init__(self, *, fit_s: int = 120, config=None, say=print, max_gap_s: int = 3):
    self.config = config or _default_config()
    self.fit_s, self.say, self.max_gap_s = fit_s, say, max_gap_s
    self.minder = None
    self._fitting = None
    self.reset()

  def reset(self) -> None:
    """A new group (restart): forget samples and streaks; keep the trained models."""
    self._samples: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    self._grid: list[tuple[int, dict[int, dict]]] = []     # (second, {rank: sample})
    self._next = None
    self.detector = None
    if self.minder is not None:
      from mscale_jax.observability.minder.detector import MinderDetector
      self.detector = MinderDetector(self.minder)

  def add(self, rank: int, samples: list[dict]) -> None:
    """A heartbeat's samples; anything not shaped like one (a dict with a finite time and
    numbers or None for the metrics) is skipped: heartbeats come from the network."""
    for s in samples or ():
      if not isinstance(s, dict) or not _number(s.get("t")):
        continue
      clean = {m: float(s[m]) if _number(s.get(m)) else None for m in WATCH_METRICS}
      self._samples[rank][int(s["t"])] = clean

  def update(self, ranks: list[int]) -> list:
    """Aligns new whole seconds for `ranks`; fits or checks. Returns new flags with `rank`
    set to the job's rank (MinderFlag)."""
    ranks = sorted(ranks)
    if len(ranks) < 3 or not all(self._samples.get(r) for r in ranks):
      return []
    last = min(max(self._samples[r]) for r in ranks)
    start = self._next if self._next is not None else max(min(self._samples[r]) for r in ranks)
    flags = []
    for sec in range(start, last + 1):
      row = {}
      for r in ranks:
        got = next((s for k in range(self.max_gap_s + 1)
                    if (s := self._samples[r].get(sec - k)) is not None), None)
        if got is None:
          break
        row[r] = got
      if len(row) < len(ranks):
        continue
      self._grid.append((sec, row))
      flags += self._on_second(sec, ranks)
    self._next = last + 1
    for r in ranks:                                   # keep what a window needs, and a margin
      for old in [s for s in self._samples[r] if s < last - 2 * self.config.window]:
        del self._samples[r][old]
    return flags

  def wait_trained(self) -> bool:
    """Blocks until the training under way (if any) ends; whether Minder is trained. For a
    replay of recorded samples, which, unlike a live job, has nothing to do meanwhile."""
    if self._fitting is not None:
      self._fitting.join()
    return self.minder is not None

  def _arrays(self, rows, ranks) -> dict[str, np.ndarray]:
    out = {}
    for m in WATCH_METRICS:
      a = np.array([[row[r].get(m) if row[r].get(m) is not None else np.nan for _, row in rows]
                    for r in ranks], np.float64)
      if np.isfinite(a).any():
        out[m] = np.nan_to_num(a, nan=float(np.nanmedian(a)))
    return out

  def _on_second(self, sec: int, ranks: list[int]) -> list:
    cfg = self.config
    if self.minder is None:
      if self._fitting is None and len(self._grid) >= self.fit_s:
        data = self._arrays(self._grid[-self.fit_s:], ranks)
        self.config = self.config.for_machines(len(ranks))
        self._fitting = threading.Thread(target=self._fit, args=(data,), daemon=True)
        self._fitting.start()
        self.say(f"[minder] training on the first {self.fit_s} s of {len(ranks)} ranks "
                 f"({', '.join(data)})")
      self._grid = self._grid[-max(self.fit_s, cfg.window):]
      return []
    if self.detector is None:
      from mscale_jax.observability.minder.detector import MinderDetector
      self.detector = MinderDetector(self.minder)
    self._grid = self._grid[-cfg.window:]
    if len(self._grid) < cfg.window or sec % cfg.stride:
      return []
    windows = {m: a for m, a in self._arrays(self._grid, ranks).items()
               if m in self.minder.models}
    flag = self.detector.check(float(sec), windows)
    if flag is None:
      return []
    flag.rank = ranks[flag.rank]
    return [flag]

  def _fit(self, data: dict) -> None:
    from mscale_jax.observability.minder.detector import Minder
    minder = Minder.fit({m: [a] for m, a in data.items()}, self.config)
    self.minder = minder
    self.say(f"[minder] trained; watching {', '.join(minder.priority)}")
