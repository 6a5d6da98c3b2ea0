"""Checkpointing: the loop says which steps are saved (`train.checkpoint_every` and the last);
this callback writes them with the trainer's Checkpointer (mscale_jax/checkpoint.py) and closes
it at the end, waiting for the last background write.

A save the file system refuses (a read-only or full disk: CheckpointWriteError), in `save`
itself or in its background write (found at the next step, not one interval later), is dropped:
no half checkpoint stays, the previous complete one stays the latest, the callbacks hear
`on_save_refused` (the heartbeat tells the driver) and training goes on; the next interval's
save tries again. `train.max_refused_saves` refusals in a row raise the error: the run stops
and the driver restarts it from the latest checkpoint. The last save, which the run ends on,
is not retried: its refusal is raised.
"""
import functools
import logging
import time

from mscale_jax import replicas
from mscale_jax.callbacks.base import Callback
from mscale_jax.checkpoint import CheckpointWriteError

log = logging.getLogger("mscale_jax")


class Checkpointing(Callback):
  """Saves the train state, the data iterator's position and the config at `on_save`, after
  checking that its replicated arrays agree on every replica (`train.check_replicas`,
  mscale_jax/replicas.py): a divergent state raises ReplicaDivergenceError and is not saved.
  The check's program is dispatched at the save and its verdict read on the save's launch
  thread before orbax starts (Checkpointer.save's `verify`), so the loop does not wait for it;
  a divergence is then raised at the next step (`check`) or save. The run's last save, with
  no step after it, reads the verdict at once."""

  def __init__(self):
    self.refused: list[int] = []   # refused saves since the newest complete checkpoint
    self.failing = False           # the run is failing (`on_error`)

  def on_save(self, run, step):
    t = run.trainer
    start, verify = time.perf_counter(), None
    if t.config.train.check_replicas and step >= run.end:
      replicas.check(run.state, step)
    elif t.config.train.check_replicas:
      verify = functools.partial(replicas.start_check(run.state), step)
    checked_s = time.perf_counter() - start
    for _ in range(2):   # the previous save's failed write is raised first, then this one runs
      try:
        t.checkpointer.save(step, run.state, t.train_iter.get_state(), t.config,
                            layer_layout=t.layer_layout, verify=verify)
        if step >= run.end:   # its whole write is waited for here (the loop's end waits for
          t.checkpointer.wait()   # it anyway), so any refusal of it is raised in the loop
      except CheckpointWriteError as error:
        self._refused(run, error.step, error)
        if error.step == step:
          return
        continue
      if t.config.train.check_replicas:   # the summary's checkpoint_saves carry its cost
        t.checkpointer.saves[-1]["replica_check_s"] = checked_s
      return

  def on_step_checked(self, run, checked):
    try:   # a background write that failed is found now
      run.trainer.checkpointer.check()
    except CheckpointWriteError as error:
      self._refused(run, error.step, error)

  def on_error(self, run, error):
    self.failing = True

  def on_loop_end(self, run):
    failing, self.failing = self.failing, False
    run.phase("checkpoint_stall")   # waits for the last write: the driver allows io_timeout_s
    try:
      run.trainer.checkpointer.close()
    except Exception as error:   # noqa: BLE001 (not raised over the error already unwinding)
      if not failing:
        raise
      log.error("while the run was failing, a checkpoint save also failed: %s", error)

  def _refused(self, run, step: int | None, error: CheckpointWriteError) -> None:
    """Drops refused save `step` and goes on, unless it is the `max_refused_saves`-th since
    the newest complete checkpoint or the run's last save."""
    limit = run.config.train.max_refused_saves
    checkpointer = run.trainer.checkpointer
    if step is not None:
      checkpointer.discard(step)
    newest = checkpointer.latest_step() or 0   # a refused save never counts as one
    self.refused = [s for s in self.refused if s > newest] + [step or newest + 1]
    if len(self.refused) >= limit or (step is not None and step >= run.end):
      raise error
    run.refused_saves.append({"step": step, "error": str(error), "time": time.time()})
    log.warning("%s; %d of %d refused in a row: training goes on, the next save tries again",
                error, len(self.refused), limit)
    run.callbacks.on_save_refused(run, step, error)
