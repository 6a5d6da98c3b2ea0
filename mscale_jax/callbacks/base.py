"""The training loop's callback protocol, and the `Run` its callbacks share.

`Trainer.train` is a short loop (fetch a batch, dispatch the step, check the step before one
step late, log, save) that says what happens at each point; everything else (metrics files,
TensorBoard, the progress bar, checkpoints, heartbeats, the timeline, the profiler window, fault
injection) is a `Callback`. A callback overrides the events it needs; `Callbacks` calls each
event on the callbacks that override it, in list order. The events, in the order a run meets
them:

  on_run_start(run)                  before the state is restored and the step compiled
  on_loop_start(run)                 the state is ready at run.step; the loop begins
  on_step_start(run, step)           before step `step` takes its batch (it may change
                                     run.state for this step)
  on_step_dispatched(run, step, metrics)   the step is running; `metrics` are device arrays
  on_step_checked(run, checked)      a step's result is on the host (one step late): `Checked`
  on_log(run, record)                a logged step's record (metrics.jsonl's line)
  on_save(run, step)                 step `step` is to be checkpointed (its result is checked)
  on_save_refused(run, step, error)  the file system refused save `step` (CheckpointWriteError);
                                     it was dropped and training goes on (callbacks/
                                     checkpointing.py)
  on_rewind(run, step)               the run went back to step `step` (a rollback)
  on_error(run, error)               the run is failing with `error` (before any cleanup)
  on_loop_end(run)                   always, at the end: close what you opened
  on_run_end(run, summary)           the run completed and its summary.json is written
  on_phase(run, name, step)          the loop entered phase `name` (observability/phases.py)

A callback may read anything on the `Run` (and through `run.trainer`, the config, mesh and
checkpointer); it changes only what its event says it may.
"""
import dataclasses
import functools
import time
from typing import Any

from mscale_jax.observability.phases import PhaseMachine


@dataclasses.dataclass(frozen=True)
class Checked:
  """A step whose result was fetched to the host."""
  step: int
  loss: float
  grad_norm: float
  finite: bool
  data_wait_s: float    # seconds the step waited for its batch
  data_pos: int         # global batches taken from the data iterator after this step's


class Callback:
  """Base class: every event is a no-op; override the ones you need."""

  def on_run_start(self, run: "Run") -> None: ...
  def on_loop_start(self, run: "Run") -> None: ...
  def on_step_start(self, run: "Run", step: int) -> None: ...
  def on_step_dispatched(self, run: "Run", step: int, metrics: dict) -> None: ...
  def on_step_checked(self, run: "Run", checked: Checked) -> None: ...
  def on_log(self, run: "Run", record: dict) -> None: ...
  def on_save(self, run: "Run", step: int) -> None: ...
  def on_save_refused(self, run: "Run", step: int | None, error: Exception) -> None: ...
  def on_rewind(self, run: "Run", step: int) -> None: ...
  def on_error(self, run: "Run", error: BaseException) -> None: ...
  def on_loop_end(self, run: "Run") -> None: ...
  def on_run_end(self, run: "Run", summary: dict) -> None: ...
  def on_phase(self, run: "Run", name: str, step: int | None) -> None: ...


EVENTS = tuple(name for name in vars(Callback) if name.startswith("on_"))


# Cleanup events: every callback gets its turn even when an earlier one raises (a callback
# that raised in on_loop_end would otherwise leave the later ones' files and threads open).
CLEANUP_EVENTS = ("on_error", "on_loop_end")


def _call_each(functions, *args) -> None:
  for f in functions:
    f(*args)


def _call_all(functions, *args) -> None:
  """Calls every function, then raises the first error any of them raised."""
  first = None
  for f in functions:
    try:
      f(*args)
    except BaseException as error:   # noqa: B036 (re-raised below)
      first = first or error
  if first is not None:
    raise first


class Callbacks:
  """A list of callbacks, called as one: `callbacks.on_log(run, record)` calls `on_log` of
  every callback that overrides it, in list order (the others cost nothing)."""

  def __init__(self, callbacks):
    self.callbacks = list(callbacks)
    self.listening = set()   # the events some callback overrides
    for event in EVENTS:
      functions = [getattr(cb, event) for cb in self.callbacks
                   if getattr(type(cb), event) is not getattr(Callback, event)]
      call = _call_all if event in CLEANUP_EVENTS else _call_each
      setattr(self, event, functools.partial(call, tuple(functions)))
      if functions:
        self.listening.add(event)

  def find(self, kind: type):
    """The first callback that is a `kind`, or None."""
    return next((cb for cb in self.callbacks if isinstance(cb, kind)), None)


@dataclasses.dataclass(eq=False)
class Pending:
  """A dispatched step whose result was not fetched yet."""
  step: int
  metrics: dict
  data_wait_s: float
  data_pos: int


@dataclasses.dataclass(eq=False)
class Run:
  """One call of `Trainer.train`: the loop's state, shared with its callbacks."""
  trainer: Any                 # the Trainer: config, workdir, mesh, checkpointer, data
  callbacks: Callbacks
  end: int                     # the last step this call runs
  phases: PhaseMachine = dataclasses.field(default_factory=PhaseMachine)
  state: Any = None            # the train state (run.state['step'] is on the devices)
  start: int = 0               # the step the state was restored (or created) at
  step: int = 0                # the last step dispatched and done with
  batch: Any = None            # the next step's batch, if already taken (the compile's)
  data_pos: int = 0            # global batches taken from the data iterator so far
  compile_s: float = 0.0
  pending: list[Pending] = dataclasses.field(default_factory=list)
  history: list[dict] = dataclasses.field(default_factory=list)      # logged records
  timed: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (steps, s)
  nonfinite_steps: list[int] = dataclasses.field(default_factory=list)
  rollbacks: int = 0
  refused_saves: list[dict] = dataclasses.field(default_factory=list)  # {step, error, time}
  rewinds: int = 0
  interval_start: float = 0.0  # throughput: the logged interval began then,
  interval_steps: int = 0      # and has this many steps so far

  def __post_init__(self):
    if "on_phase" in self.callbacks.listening:
      self.phases.listeners.append(functools.partial(self.callbacks.on_phase, self))

  @property
  def config(self):
    return self.trainer.config

  def phase(self, name: str, step: int | None = None) -> None:
    """The loop enters phase `name` (of iteration `step`; None: the same iteration)."""
    self.phases.phase(name, step)

  def restart_interval(self) -> None:
    self.interval_start, self.interval_steps = time.perf_counter(), 0

  def rewind(self, state, step: int, data_pos: int) -> None:
    """Goes back to `state` at `step` (data position `data_pos`): the steps after it are
    dropped from the logs and replayed; callbacks hear `on_rewind`."""
    self.state, self.step, self.data_pos = state, step, data_pos
    self.pending, self.batch = [], None
    self.history[:] = [r for r in self.history if r["step"] <= step]
    self.rewinds += 1
    self.restart_interval()
    self.callbacks.on_rewind(self, step)
