"""Checkpointing: the loop says which steps are saved (`train.checkpoint_every` and the last);
this callback writes them with the trainer's Checkpointer (mscale_jax/checkpoint.py) and closes
it at the end, waiting for the last background write. A background write that failed is raised
at the next step (CheckpointWriteError), not one checkpoint interval later."""
import time

from mscale_jax import replicas
from mscale_jax.callbacks.base import Callback


class Checkpointing(Callback):
  """Saves the train state, the data iterator's position and the config at `on_save`, after
  checking that its replicated arrays agree on every replica (`train.check_replicas`,
  mscale_jax/replicas.py): a divergent state raises ReplicaDivergenceError and is not saved."""

  def on_save(self, run, step):
    t = run.trainer
    start = time.perf_counter()
    if t.config.train.check_replicas:
      replicas.check(run.state, step)
    checked_s = time.perf_counter() - start
    t.checkpointer.save(step, run.state, t.train_iter.get_state(), t.config,
                        layer_layout=t.layer_layout)
    if t.config.train.check_replicas:   # the summary's checkpoint_saves carry its cost
      t.checkpointer.saves[-1]["replica_check_s"] = checked_s

  def on_step_checked(self, run, checked):
    run.trainer.checkpointer.check()   # a background write that failed stops the run now

  def on_loop_end(self, run):
    run.trainer.checkpointer.close()
