"""Fault injection for drills and tests (off unless asked for): parse specs, fire them once.

A spec is `KIND[:key=value]...`, e.g. `kill:rank=1:step=37`. Kinds and their keys:

  kill       rank (0), step, at ('step' | 'save')   SIGKILL itself before step `step`, or
                                                   right after starting the save of step `step`
                                                   (the background write is then in flight)
  hang       rank (0), step                        block forever before step `step`
  nan        step                                  the loss (and so the gradients) of step
                                                   `step` become NaN, on every rank
  exception  rank (0), step                        raise RuntimeError before step `step`
  slow       rank (0), factor, step (1)            from step `step` on, each step of that rank
                                                   takes `factor` times as long
  bad_slot   slot                                  the self-check of that slot fails (driver)

Steps are numbered as in metrics.jsonl: step N is the N-th update. Every fault except `slow`
fires once per run: before firing, the worker writes a marker into WORKDIR/resilience/faults/,
so a restarted worker replaying step N does not fire it again.
"""
import dataclasses
import os
import signal
import threading
import time

from mscale_jax.errors import ConfigError
from mscale_jax.files import write_json

_KEYS = {
    "kill": {"rank": 0, "step": None, "at": "step"},
    "hang": {"rank": 0, "step": None},
    "nan": {"step": None},
    "exception": {"rank": 0, "step": None},
    "slow": {"rank": 0, "factor": None, "step": 1},
    "bad_slot": {"slot": None},
}
KINDS = tuple(_KEYS)


@dataclasses.dataclass(frozen=True)
class Fault:
  """One injected fault; `index` is its position in the run's list (names its marker)."""
  kind: str
  index: int = 0
  rank: int = 0
  step: int = 0
  at: str = "step"
  factor: float = 1.0
  slot: int = 0

  @property
  def spec(self) -> str:
    keys = _KEYS[self.kind]
    return ":".join([self.kind] + [f"{k}={getattr(self, k)}" for k in keys])


def parse_fault(spec: str, index: int = 0) -> Fault:
  """`Fault` of a spec string; ConfigError naming the spec and the valid forms otherwise."""
  kind, *pairs = spec.strip().split(":")
  if kind not in _KEYS:
    raise ConfigError("--fault", spec, f"a kind among {', '.join(KINDS)}, e.g. "
                      f"kill:rank=1:step=37 (see mscale_jax/resilience/faults.py)")
  values = dict(_KEYS[kind])
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or key not in values:
      raise ConfigError("--fault", spec, f"keys of {kind!r} are {', '.join(values)} "
                        f"(key=value, separated by ':')")
    values[key] = value
  missing = [k for k, v in values.items() if v is None]
  if missing:
    raise ConfigError("--fault", spec, f"{kind!r} needs {', '.join(missing)}=...")
  try:
    out = {k: (float(v) if k == "factor" else v if k == "at" else int(v))
           for k, v in values.items()}
  except ValueError:
    raise ConfigError("--fault", spec, "integer rank/step/slot and a number factor") from None
  if out.get("at", "step") not in ("step", "save"):
    raise ConfigError("--fault", spec, "at=step or at=save")
  if min(out.get("step", 1), 1) < 1 or min(out.get("rank", 0), out.get("slot", 0)) < 0:
    raise ConfigError("--fault", spec, "step >= 1, rank >= 0 and slot >= 0")
  if kind == "slow" and not out["factor"] > 1:
    raise ConfigError("--fault", spec, "factor > 1")
  return Fault(kind, index=index, **out)


def parse_faults(specs) -> list[Fault]:
  """Faults of a list of spec strings, indexed in order."""
  return [parse_fault(spec, i) for i, spec in enumerate(specs or ())]


class FaultInjector:
  """The trainer's side of fault injection: called at the loop's fault points.

  `rank` is this process's index; `marker_dir` holds the fired markers (shared by all ranks).
  With no faults every call is a cheap no-op.
  """

  def __init__(self, faults, rank: int, marker_dir: str | None):
    self.faults = [f for f in faults if f.kind != "bad_slot"]
    self.rank = rank
    self.marker_dir = marker_dir
    self._slow_since = None

  def _mine(self, kind: str, step: int, **match) -> Fault | None:
    for f in self.faults:
      if f.kind == kind and f.step == step and (kind == "nan" or f.rank == self.rank) and \
          all(getattr(f, k) == v for k, v in match.items()) and not self._fired(f):
        return f
    return None

  def _marker(self, fault: Fault) -> str:
    return os.path.join(self.marker_dir, f"{fault.index}-{fault.kind}-rank{self.rank}.json")

  def _fired(self, fault: Fault) -> bool:
    return self.marker_dir is not None and os.path.exists(self._marker(fault))

  def _fire(self, fault: Fault, step: int) -> None:
    if self.marker_dir is not None:
      write_json(self._marker(fault),
                 {"fault": fault.spec, "rank": self.rank, "step": step, "time": time.time()})
    print(f"[fault] rank {self.rank}: injecting {fault.spec}", flush=True)

  def before_step(self, step: int) -> None:
    """Fault point before step `step` (1-based) runs: kill, hang or raise, as asked."""
    if not self.faults:
      return
    if f := self._mine("kill", step, at="step"):
      self._fire(f, step)
      os.kill(os.getpid(), signal.SIGKILL)
    if f := self._mine("hang", step):
      self._fire(f, step)
      threading.Event().wait()
    if f := self._mine("exception", step):
      self._fire(f, step)
      raise RuntimeError(f"injected fault {f.spec}")

  def after_save_started(self, step: int) -> None:
    """Fault point right after the save of step `step` began (its write is in flight)."""
    if f := self._mine("kill", step, at="save"):
      self._fire(f, step)
      os.kill(os.getpid(), signal.SIGKILL)

  def loss_scale(self, step: int) -> float:
    """1.0, or NaN for the step a `nan` fault poisons (its loss and gradients become NaN)."""
    if self.faults and (f := self._mine("nan", step)):
      self._fire(f, step)
      return float("nan")
    return 1.0

  def slow_down(self, step: int) -> None:
    """After step `step`: on a slow rank, sleeps (factor - 1) times the step's own time.

    The step's time is measured from the end of the previous call, so the sleeps do not
    compound.
    """
    now = time.perf_counter()
    work, self._slow_since = now - (self._slow_since or now), now
    for f in self.faults:
      if f.kind == "slow" and f.rank == self.rank and step >= f.step:
        time.sleep((f.factor - 1.0) * work)
        self._slow_since = time.perf_counter()
