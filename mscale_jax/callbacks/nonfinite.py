"""What follows a step whose loss or gradient norm is not finite (`train.on_nonfinite`).

The step itself applied no update (mscale_jax/step.py), so the state is still good; the loop
finds out one step late and asks its policy, a strategy with one method:

  stop       raise NonFiniteError (experiments.train exits with status 3; the driver restarts)
  skip_step  go on with the next batch
  rollback   restore the latest checkpoint (or start afresh) and go on with the batch after
             the offending one; after MAX_ROLLBACKS in one run, give up as `stop` does
"""
import logging

from mscale_jax.errors import NonFiniteError

log = logging.getLogger("mscale_jax")

# train.on_nonfinite='rollback' gives up (NonFiniteError) after this many rollbacks in a run.
MAX_ROLLBACKS = 3


def _detail(checked) -> str:
  return f"loss {checked.loss}, gradient norm {checked.grad_norm}"


class Stop:
  def handle(self, run, checked) -> None:
    raise NonFiniteError(checked.step, _detail(checked))


class SkipStep:
  def handle(self, run, checked) -> None:
    log.warning("step %d: %s; its update was not applied (skip_step)", checked.step,
                _detail(checked))


class Rollback:
  def handle(self, run, checked) -> None:
    """Rewinds `run` to the latest checkpoint, with the data moved past the offending batch."""
    log.warning("step %d: %s; its update was not applied (rollback)", checked.step,
                _detail(checked))
    trainer = run.trainer
    run.phase("checkpoint_stall")   # waits for a save being written: io_timeout_s applies
    trainer.checkpointer.wait()
    step = trainer.checkpointer.latest_step() or 0
    run.rollbacks += 1
    if run.rollbacks > MAX_ROLLBACKS:
      raise NonFiniteError(checked.step, f"still non-finite after {MAX_ROLLBACKS} rollbacks")
    run.phase("restore")
    state = trainer.restore(step) if step else trainer.init_state()
    trainer.train_iter.set_state({**trainer.train_iter.get_state(), "step": checked.data_pos})
    log.warning("rolled back to step %d; the data goes on after step %d's batch",
                step, checked.step)
    run.rewind(state, step, checked.data_pos)


POLICIES = {"stop": Stop, "skip_step": SkipStep, "rollback": Rollback}


def policy(name: str):
  """The policy object of `train.on_nonfinite` = `name`."""
  return POLICIES[name]()
