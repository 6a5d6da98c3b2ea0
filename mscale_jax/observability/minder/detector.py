"""Minder's detector: per-metric denoising models, similarity, continuity and priority, online.

`Minder.fit` trains one LSTM-VAE per metric on healthy samples (the paper trains on normal data;
we use either the job's own first healthy minutes or a stored normal set). `MinderDetector` is
the online part: it is handed, every `stride` seconds, the last `window` seconds of every
machine's samples of each metric (arrays only: it never sees which machine is faulty), and
returns a `MinderFlag` when one machine has stayed the most distinct on some metric for
`continuity` checks in a row. Metrics are checked in the learned priority order (priority.py);
when several fire in the same check, the most indicative one names the machine.

Constants (MinderConfig) and where they come from:
  window 30 s, sampled every 1 s: the paper pulls second-level metrics and embeds fixed windows;
    30 s spans several training steps of a large job (MegaScale steps are seconds long).
  stride 5 s: how often the detector runs; the paper runs Minder periodically on pulled data and
    reports 3.6 s per detection call, so a check every few seconds is the cadence it affords.
  continuity 6 checks (30 s), ratio 4.0, floor 0.05: the paper gives no numbers we could use
    (its continuity is minutes-scale, chosen on its own traces). These are the values the
    evaluation chose on the validation split of the fleet traces (experiments/minder_eval.py,
    a seed apart from the test split; record results/minder_eval-cpu-20261126T064419.json).
    They are stated here once; the driver's watch and the real-run evaluation use them through
    `for_machines`, and minder_eval says in its record whether its validation still picks them.
  small jobs (`for_machines`, fewer than SMALL_JOB machines): a perfect outlier's ratio to the
    median machine is about machines - 1 (2 with 3 machines), so a ratio of 4 can never be met;
    there the ratio test is off and the floor is relative to each metric's healthy reference
    instead: score >= SMALL_JOB_FLOOR_SCALE x the 99th percentile of the most distinct
    machine's score over the training data (`MetricModel.healthy_score`).
"""
import collections
import dataclasses
import time

import numpy as np

from mscale_jax.observability.minder import continuity as continuity_lib
from mscale_jax.observability.minder import similarity
from mscale_jax.observability.minder import vae as vae_lib
from mscale_jax.observability.minder.windows import Normaliser, sliding_windows


SMALL_JOB = 8                 # machines: below this, `for_machines` swaps the ratio test
SMALL_JOB_FLOOR_SCALE = 2.0   # for a floor relative to the healthy reference


@dataclasses.dataclass(frozen=True)
class MinderConfig:
  """Minder's window, check stride, thresholds and VAE settings (where each comes from: the
  module docstring). One setting for the driver, the fleet and the real-run evaluations."""
  window: int = 30            # samples (seconds) per embedded window
  stride: int = 5             # seconds between checks
  continuity: int = 6         # consecutive checks the same machine must stand out
  ratio: float = 4.0          # its distance score vs the median machine's
  floor: float = 0.05         # its distance score, in embedding units
  floor_scale: float = 0.0    # also: score >= this x the metric's healthy reference (0: off)
  vae: vae_lib.VAEConfig = vae_lib.VAEConfig()

  def for_machines(self, machines: int) -> "MinderConfig":
    """The same setting for a job of `machines`: below SMALL_JOB the ratio test (unreachable
    there) gives way to a floor relative to each metric's healthy reference."""
    if machines >= SMALL_JOB:
      return self
    return dataclasses.replace(self, ratio=1.0, floor=0.0, floor_scale=SMALL_JOB_FLOOR_SCALE)


@dataclasses.dataclass
class MetricModel:
  """What one metric needs: its normalisation, its trained LSTM-VAE, and how far the most
  distinct machine stood out on the healthy training data (99th percentile of its score)."""
  normaliser: Normaliser
  vae: vae_lib.TrainedVAE
  healthy_score: float = 0.0


class Minder:
  """The fitted per-metric models, the metric priority and the config."""

  def __init__(self, models: dict[str, MetricModel], config: MinderConfig,
               priority: list[str] | None = None):
    self.models, self.config = models, config
    self.priority = list(priority or models)
    unknown = set(self.priority) - set(models)
    if unknown:
      raise ValueError(f"priority names metrics without a model: {sorted(unknown)}")

  @classmethod
  def fit(cls, healthy: dict[str, list[np.ndarray]], config: MinderConfig = MinderConfig(),
          *, max_windows: int = 20_000, log=None) -> "Minder":
    """Trains each metric's model on healthy traces: {metric: [array [machines, T], ...]}."""
    rng = np.random.default_rng(config.vae.seed)
    models = {}
    for metric, traces in healthy.items():
      traces = [np.asarray(t, np.float64) for t in traces]
      normaliser = Normaliser.fit(np.concatenate([t.ravel() for t in traces]))
      windows = np.concatenate([sliding_windows(normaliser(t), config.window,
                                                config.stride).reshape(-1, config.window)
                                for t in traces])
      windows = windows[rng.permutation(len(windows))[:max_windows]]
      model = vae_lib.train_vae(windows, config.vae)
      scores = []
      for t in traces:                    # every healthy second's most distinct machine
        per_check = sliding_windows(normaliser(t), config.window, 1)          # [M, n, W]
        emb = model.embed(per_check.reshape(-1, config.window)).reshape(
            *per_check.shape[:2], -1)
        scores += [c.score for i in range(emb.shape[1])
                   if (c := similarity.most_distinct(emb[:, i])) is not None]
      reference = float(np.percentile(scores, 99)) if scores else 0.0
      models[metric] = MetricModel(normaliser, model, reference)
      if log:
        log(f"minder: {metric}: VAE on {len(windows)} healthy windows, loss "
            f"{model.losses[0]:.4f} -> {np.mean(model.losses[-20:]):.4f}")
    return cls(models, config)

  def with_priority(self, priority: list[str]) -> "Minder":
    """The same models, metrics checked in the order `priority` (e.g. the tree's)."""
    return Minder(self.models, self.config, priority)

  def with_config(self, **changes) -> "Minder":
    """The same models with other thresholds (window and stride must stay: the models and
    their inputs depend on them)."""
    return Minder(self.models, dataclasses.replace(self.config, **changes), self.priority)

  def embed(self, metric: str, windows: np.ndarray) -> np.ndarray:
    """Raw windows [M, W] of `metric` -> embeddings [M, latent]."""
    model = self.models[metric]
    return model.vae.embed(model.normaliser(windows))

  def most_distinct(self, windows: dict[str, np.ndarray]
                    ) -> dict[str, similarity.Candidate | None]:
    """One check: per metric, the machine furthest from the others (thresholds not applied)."""
    return {m: similarity.most_distinct(self.embed(m, windows[m])) for m in self.priority
            if m in windows}


@dataclasses.dataclass
class MinderFlag:
  """Machine `rank` stood out on `metric` from time `since` to `at` (seconds)."""
  rank: int
  metric: str
  since: float
  at: float
  ratio: float          # its distance score over the median machine's, mean over the streak
  value: float          # its mean raw value of `metric` over the last window
  others: float         # the median of the other machines' means over that window

  def describe(self) -> str:
    """The driver's one-line message for this flag."""
    return (f"minder: rank {self.rank}: {self.metric} {self.value:.4g} vs {self.others:.4g} "
            f"median of the others; {self.ratio:.1f}x further from its peers than the median "
            f"machine for {self.at - self.since:.0f} s (since {_when(self.since)}, flagged at "
            f"{_when(self.at)})")

  def to_json(self) -> dict:
    """The flag's fields and its message, for records and the driver's report."""
    return {**dataclasses.asdict(self), "message": self.describe()}


def _when(t: float) -> str:
  """Wall-clock times (the driver's) as UTC time of day; trace seconds as t=N s."""
  if t > 1e9:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))
  return f"t={t:.0f} s"


class MinderDetector:
  """Online: `check(t, windows)` every `stride` seconds with the last `window` samples of each
  metric, [machines, window] raw values; returns a new flag or None.

  A flagged machine is not flagged again until it has been nobody's candidate for `continuity`
  checks (it was evicted, or recovered). `observe(t, sample)` does the windowing for a caller
  that has one sample per machine per second.
  """

  def __init__(self, minder: Minder):
    self.minder, self.config = minder, minder.config
    self._trackers = {m: continuity_lib.Continuity(self.config.continuity)
                      for m in minder.priority}
    self._calm: dict[int, int] = {}       # flagged machine: checks since it was a candidate
    self._buffer: dict[str, collections.deque] = {}
    self._samples = 0
    self.flags: list[MinderFlag] = []

  def check(self, t: float, windows: dict[str, np.ndarray]) -> MinderFlag | None:
    """One check on {metric: raw [machines, window]}: embed, compare, continue streaks."""
    tops = self.minder.most_distinct(windows)
    return self.decide(t, tops, {m: np.asarray(w, np.float64).mean(axis=1)
                                 for m, w in windows.items()})

  def decide(self, t: float, tops: dict[str, similarity.Candidate | None],
             means: dict[str, np.ndarray]) -> MinderFlag | None:
    """The thresholds, continuity and priority on one check's most distinct machines (what
    `Minder.most_distinct` gives) and each machine's mean of each metric over the window."""
    cfg = self.config
    fired, seen = [], set()
    for metric in self.minder.priority:
      if metric not in tops:
        continue
      top = tops[metric]
      floor = max(cfg.floor, cfg.floor_scale * self.minder.models[metric].healthy_score)
      candidate = top if top is not None and top.stands_out(ratio=cfg.ratio, floor=floor) \
          else None
      machine = candidate.machine if candidate else None
      if machine is not None:
        seen.add(machine)
      streak = self._trackers[metric].update(t, machine, candidate.ratio if candidate else 0.0)
      if streak is not None:
        fired.append((metric, streak))
    for machine in list(self._calm):
      self._calm[machine] = 0 if machine in seen else self._calm[machine] + 1
      if self._calm[machine] >= cfg.continuity:
        del self._calm[machine]
    for metric, streak in fired:          # priority order: the most indicative metric first
      if streak.machine in self._calm:
        continue
      series = np.asarray(means[metric], np.float64)
      others = np.delete(series, streak.machine)
      flag = MinderFlag(streak.machine, metric, streak.since, t, float(np.mean(streak.ratios)),
                        float(series[streak.machine]), float(np.median(others)))
      self._calm[streak.machine] = 0
      self.flags.append(flag)
      return flag
    return None

  def observe(self, t: float, sample: dict[str, np.ndarray]) -> MinderFlag | None:
    """One sample per machine per metric ({metric: [M]}), once a second; runs a check every
    `stride` samples once `window` samples are in."""
    for metric, values in sample.items():
      self._buffer.setdefault(metric, collections.deque(maxlen=self.config.window)).append(
          np.asarray(values, np.float64))
    self._samples += 1
    if self._samples < self.config.window or self._samples % self.config.stride:
      return None
    return self.check(t, {m: np.stack(list(b), axis=1) for m, b in self._buffer.items()})


def episode_features(minder: Minder, metrics: dict[str, np.ndarray]) -> np.ndarray:
  """Per metric, how strongly one machine stood out in a stretch {metric: [M, T]} of samples:
  the highest ratio that the same machine kept for `continuity` checks in a row (0 if no machine
  did). These are the decision tree's features (priority.py); labels are never read here."""
  cfg = minder.config
  out = []
  for metric in minder.priority:
    windows = sliding_windows(np.asarray(metrics[metric], np.float64), cfg.window, cfg.stride)
    tops = [similarity.most_distinct(minder.embed(metric, windows[:, i]))
            for i in range(windows.shape[1])]
    machines = np.array([c.machine if c else -1 for c in tops])
    ratios = np.array([c.ratio if c else 0.0 for c in tops])
    best, c = 0.0, cfg.continuity
    for i in range(len(tops) - c + 1):
      if machines[i] >= 0 and np.all(machines[i:i + c] == machines[i]):
        best = max(best, float(ratios[i:i + c].min()))
    out.append(best)
  return np.array(out)
