"""Checkpointing: the loop says which steps are saved (`train.checkpoint_every` and the last);
this callback writes them with the trainer's Checkpointer (mscale_jax/checkpoint.py) and closes
it at the end, waiting for the last background write. A background write that failed is raised
at the next step (CheckpointWriteError), not one checkpoint interval later."""
from mscale_jax.callbacks.base import Callback


class Checkpointing(Callback):
  """Saves the train state, the data iterator's position and the config at `on_save`."""

  def on_save(self, run, step):
    t = run.trainer
    t.checkpointer.save(step, run.state, t.train_iter.get_state(), t.config,
                        layer_layout=t.layer_layout)

  def on_step_checked(self, run, checked):
    run.trainer.checkpointer.check()   # a background write that failed stops the run now

  def on_loop_end(self, run):
    run.trainer.checkpointer.close()
