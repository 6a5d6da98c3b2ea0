"""Questions an operator asks of the simulator: the best checkpoint interval, and throughput
once failures are counted (tokens per wall-clock second)."""
import dataclasses
import math

from mscale_jax.goodput import analytic, presets, simulate


def log_grid(low_s: float, high_s: float, n: int) -> tuple:
  """`n` intervals from `low_s` to `high_s`, evenly spaced in log."""
  ratio = (high_s / low_s) ** (1.0 / (n - 1))
  return tuple(low_s * ratio ** i for i in range(n))


@dataclasses.dataclass(frozen=True)
class Sweep:
  """Mean effective training time rate per checkpoint interval (same seeds for every interval)."""
  intervals: tuple
  spreads: tuple           # simulate.Spread per interval

  @property
  def means(self) -> tuple:
    return tuple(s.mean for s in self.spreads)

  @property
  def best(self) -> int:
    """Index of the interval with the highest mean rate."""
    return max(range(len(self.intervals)), key=lambda i: self.spreads[i].mean)

  @property
  def best_s(self) -> float:
    return self.intervals[self.best]

  def near_best(self) -> tuple:
    """(shortest, longest) interval whose mean is within one standard error of the best's."""
    top = self.spreads[self.best]
    ok = [t for t, s in zip(self.intervals, self.spreads) if s.mean >= top.mean - top.stderr]
    return min(ok), max(ok)


def sweep_intervals(make_job, intervals, seeds, hours: float) -> Sweep:
  """Simulates `make_job(interval_s)` for every interval over the same `seeds`."""
  return Sweep(tuple(intervals),
               tuple(simulate.spread(make_job(t), seeds, hours=hours) for t in intervals))


def first_order_interval(job) -> float:
  """Daly's interval for `job`'s synchronous stall and failure rate, never shorter than the
  background persist (a save cannot be durable faster than that)."""
  if math.isinf(job.mtbf_s):
    return 24 * 3600.0
  cp = job.checkpointing
  return max(analytic.daly_interval(cp.stall_s, job.mtbf_s), cp.persist_s)


@dataclasses.dataclass(frozen=True)
class Adjusted:
  """Throughput with and without failures, for one layout's iteration."""
  tokens_per_s: float
  rate: float              # mean effective training time rate
  interval_s: float

  @property
  def goodput_tokens_per_s(self) -> float:
    return self.tokens_per_s * self.rate


def adjusted_throughput(gpus: int, iteration_s: float, tokens_per_iteration: int,
                        seeds=range(8), hours: float = 30 * 24, rates: str = "llama3",
                        policy: presets.Policy = presets.BASELINE,
                        num_params: int | None = None) -> Adjusted:
  """Tokens per wall-clock second including failures, for an iteration of `iteration_s` on
  `gpus` GPUs of a model of `num_params` (175B if None) under MegaScale's recovery costs,
  checkpointing at `first_order_interval`."""
  job = presets.megascale_job(gpus, rates=rates, policy=policy, iteration_s=iteration_s,
                              num_params=num_params)
  interval = first_order_interval(job)
  job = dataclasses.replace(job, checkpointing=dataclasses.replace(job.checkpointing,
                                                                   every_s=interval))
  rate = simulate.spread(job, seeds, hours=hours).mean
  return Adjusted(tokens_per_iteration / iteration_s, rate, interval)
