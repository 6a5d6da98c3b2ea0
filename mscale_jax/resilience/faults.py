"""The fault grammar for drills and tests: what a fault is, parsed from `--fault=SPEC`.

A spec is `KIND[:key=value]...`, e.g. `kill:rank=1:step=37`. Kinds, their keys (defaults in
parentheses) and who injects them:

  kill       rank (0), step, at ('step' | 'save')   worker: SIGKILL itself before step `step`,
                                                   or right after starting the save of step
                                                   `step` (the background write is in flight)
  hang       rank (0), step                        worker: block forever before step `step`
  nan        step                                  worker: step `step` runs on NaN parameters
                                                   (a separate program), so its loss and
                                                   gradients are NaN, on every rank
  exception  rank (0), step                        worker: raise RuntimeError before step `step`
  slow       rank (0), factor, step (1)            worker: from step `step` on, each step of
                                                   that rank takes `factor` times as long
  bad_slot   slot, step (1)                        driver (its env): from step `step` on,
                                                   the results of its cross-process collectives
                                                   arrive corrupt (training's parameter updates
                                                   and the self-check's all-gather alike); the
                                                   next save's replica check finds it

Faults of the operating system, injected from outside the training processes by the driver
(resilience/driver/injector.py) once every rank has reached step `step`:

  stop               rank (1), step                SIGSTOP the worker: a real hang, no Python
                                                   runs in it
  contend            rank (1), step, seconds (30)  pin each worker to a core of its own, then
                                                   run a busy process on `rank`'s core for
                                                   `seconds`: a real slow machine
  corrupt_checkpoint rank (0), step                flip bytes in an array file of the newest
                                                   committed checkpoint, then SIGKILL `rank`:
                                                   the restart must notice (checksums) and
                                                   restore the checkpoint before it
  io_error           rank (0), step, seconds (0)   the checkpoint directory turns read-only
                                                   (chattr +i as root, chmod otherwise) for
                                                   `seconds` (0: until the failure it causes is
                                                   detected): the next save is refused, dropped
                                                   in the process (train.max_refused_saves)
  kill_driver        step                          SIGKILL the driver itself; running the same
                                                   launch command again resumes the job
  kill_coordinator   step                          SIGKILL process 0 (the jax.distributed
                                                   coordination service) from outside

Steps are numbered as in metrics.jsonl: step N is the N-th update. Faults a worker injects live
in `resilience/worker/faults.py` (they fire once per run: see there), faults the driver injects
in `resilience/driver/injector.py`. A new kind is a row of `KINDS` plus its injector in one of
the two. This module is pure Python: the launcher validates specs before anything starts.
"""
import dataclasses
import os

from mscale_jax.errors import ConfigError

WORKER, DRIVER = "worker", "driver"   # who injects a kind

# kind: ({key: default, None if required}, who injects it)
KINDS = {
    "kill": ({"rank": 0, "step": None, "at": "step"}, WORKER),
    "hang": ({"rank": 0, "step": None}, WORKER),
    "nan": ({"step": None}, WORKER),
    "exception": ({"rank": 0, "step": None}, WORKER),
    "slow": ({"rank": 0, "factor": None, "step": 1}, WORKER),
    "bad_slot": ({"slot": None, "step": 1}, DRIVER),
    "stop": ({"rank": 1, "step": None}, DRIVER),
    "contend": ({"rank": 1, "step": None, "seconds": 30.0}, DRIVER),
    "corrupt_checkpoint": ({"rank": 0, "step": None}, DRIVER),
    "io_error": ({"rank": 0, "step": None, "seconds": 0.0}, DRIVER),
    "kill_driver": ({"step": None}, DRIVER),
    "kill_coordinator": ({"step": None}, DRIVER),
}
FLOAT_KEYS = ("factor", "seconds")


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
  seconds: float = 0.0

  @property
  def spec(self) -> str:
    keys = KINDS[self.kind][0]
    return ":".join([self.kind] + [f"{k}={getattr(self, k)}" for k in keys])

  @property
  def injected_by(self) -> str:
    return KINDS[self.kind][1]


def parse_fault(spec: str, index: int = 0) -> Fault:
  """`Fault` of a spec string; ConfigError naming the spec and the valid forms otherwise."""
  kind, *pairs = spec.strip().split(":")
  if kind not in KINDS:
    raise ConfigError("--fault", spec, f"a kind among {', '.join(KINDS)}, e.g. "
                      f"kill:rank=1:step=37 (see mscale_jax/resilience/faults.py)")
  values = dict(KINDS[kind][0])
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
    out = {k: (float(v) if k in FLOAT_KEYS else v if k == "at" else int(v))
           for k, v in values.items()}
  except ValueError:
    raise ConfigError("--fault", spec, "integer rank/step/slot and a number factor/seconds") \
        from None
  if out.get("at", "step") not in ("step", "save"):
    raise ConfigError("--fault", spec, "at=step or at=save")
  if min(out.get("step", 1), 1) < 1 or min(out.get("rank", 0), out.get("slot", 0)) < 0:
    raise ConfigError("--fault", spec, "step >= 1, rank >= 0 and slot >= 0")
  if kind == "slow" and not out["factor"] > 1:
    raise ConfigError("--fault", spec, "factor > 1")
  if out.get("seconds", 0.0) < 0 or (kind == "contend" and not out["seconds"] > 0):
    raise ConfigError("--fault", spec, "seconds > 0 (io_error: seconds >= 0, 0 meaning until "
                      "the failure it causes is detected)")
  return Fault(kind, index=index, **out)


def parse_faults(specs) -> list[Fault]:
  """Faults of a list of spec strings, indexed in order."""
  return [parse_fault(spec, i) for i, spec in enumerate(specs or ())]


def bad_slot_marker(workdir: str, slot: int) -> str:
  """The file saying slot `slot` has gone bad (written by its worker when training first reached
  the fault's step; the driver reads it to name a replica divergence's cause)."""
  return os.path.join(workdir, "resilience", "bad_slots", f"slot{slot}.json")
