"""The training loop's phases: one state machine that the timeline, the heartbeat and the driver
all read (MegaScale §5).

The loop says what it does next (`PhaseMachine.phase(name, step)`); that closes the open span
and opens the next, so the spans of one rank tile its time without gaps or overlaps. The hot
path is one `time.perf_counter()`, a tuple, a dict update and the listeners' calls per phase
change (measured in experiments/timeline_overhead.py). Consumers:

  the timeline   (timeline.py) records every closed span to WORKDIR/timeline/rank{R}.jsonl;
  the heartbeat  carries each finished iteration's phase seconds (`drain`, for straggler
                 detection), where the loop is now (`where`, for hang localisation), and the
                 coarse phase (`COARSE`) that the driver's hang rule reads.

Loop phases (per iteration `step`, in order):

  data_wait        next(data iterator): waiting for this process's rows of the batch
  host_to_device   the rows -> a global jax.Array (make_array_from_process_local_data)
  dispatch         calling the compiled step (on GPU/TPU it returns once the step is
                   enqueued; XLA:CPU runs most of the step before returning)
  sync             fetching the previous step's loss/finiteness: blocks until that step is
                   done on the devices, including waiting for peers in its collectives. This
                   is where the loop already synchronises (one step late): no extra sync.
  host             host work after the fetch (heartbeat bookkeeping, injected slowness, ...)
  log, eval        a logged step's metrics and the held-out evaluation
  checkpoint_stall the save's device-to-host stage (the loop is blocked)

and, outside the loop: restore, compile, profile, done.
"""
import collections
import time

from mscale_jax.resilience import events

LOOP, CHECKPOINT = "loop", "checkpoint"      # the timeline tracks of one rank
# Phases in which the loop may wait for something outside this process: the devices and,
# through their collectives, the other ranks. `sync` always; `dispatch` when the runtime runs
# the step before returning (XLA:CPU here does) or its queue is full. The rest is own work.
WAIT_PHASES = ("dispatch", "sync")
LOOP_PHASES = ("data_wait", "host_to_device", "dispatch", "sync", "host", "log", "eval",
               "checkpoint_stall")
# The driver's coarse phase (events.PHASES) of each loop phase; 'done' has none: the worker
# says 'done' or 'failed' itself once its run has ended.
COARSE = {**{name: events.TRAINING for name in LOOP_PHASES + ("profile",)},
          "eval": events.EVALUATING, "checkpoint_stall": events.CHECKPOINTING,
          "restore": events.RESTORING, "compile": events.COMPILING}


class PhaseMachine:
  """What one rank's loop is doing: the open phase, its loop iteration and since when.

  `sink.append((name, step, start, end, track))` receives every closed span (a Timeline, or
  None); `listeners` are called `f(name, step)` on every change.
  """

  def __init__(self, sink=None, listeners=()):
    self.sink = sink
    self.listeners = list(listeners)
    self._open = (None, None, time.perf_counter())    # (phase, step, since), perf seconds
    self._step_phases: dict[str, float] = {}
    self._step_of_phases = None
    self.completed = collections.deque(maxlen=512)    # (step, {phase: seconds}) per iteration

  def phase(self, name: str, step: int | None = None) -> None:
    """Closes the open span now and opens `name` (for loop iteration `step`; None: the same)."""
    open_name, open_step, since = self._open
    if step is None:
      step = open_step
    if name == open_name and step == open_step:
      return
    now = time.perf_counter()
    if open_name is not None:
      if self.sink is not None:
        self.sink.append((open_name, open_step, since, now, LOOP))
      if open_step is not None and open_name in LOOP_PHASES:
        if open_step != self._step_of_phases:
          self.end_iteration()
          self._step_of_phases = open_step
        self._step_phases[open_name] = self._step_phases.get(open_name, 0.0) + now - since
    self._open = (name, step, now)
    for listener in self.listeners:
      listener(name, step)

  def end_iteration(self) -> None:
    """Files the phase seconds of the iteration being accumulated (it is complete)."""
    if self._step_of_phases is not None:
      self.completed.append((self._step_of_phases, self._step_phases))
    self._step_phases = {}

  def where(self) -> list:
    """[phase, step, seconds in it] of the loop right now."""
    name, step, since = self._open
    return [name, step, round(time.perf_counter() - since, 3)]

  def drain(self) -> list:
    """Per-iteration phase seconds completed since the last call: [[step, {phase: s}], ...]."""
    out = []
    while self.completed:
      step, phases = self.completed.popleft()
      out.append([step, {k: round(v, 6) for k, v in phases.items()}])
    return out
