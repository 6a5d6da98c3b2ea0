"""The loop's observability: its timeline on disk, the profiler window, a stack dump on signal."""
import os

from mscale_jax.callbacks.base import Callback
from mscale_jax.observability import hang
from mscale_jax.observability.profiler import ProfilerWindow
from mscale_jax.observability.timeline import Timeline, mesh_coordinates


class TimelineRecorder(Callback):
  """WORKDIR/timeline/rank{R}.jsonl: every span of the loop's phases, with this rank's mesh
  coordinates in its meta line (`train.timeline=false` turns it off)."""

  def __init__(self, attempt: int = 0):
    self.attempt = attempt
    self.timeline = None

  def on_run_start(self, run):
    t = run.trainer
    mesh, rank = t.mesh, t.process_index
    meta = {"mesh_axes": list(mesh.axis_names), "mesh_shape": [int(n) for n in mesh.devices.shape],
            "coords": mesh_coordinates(mesh, rank)}
    self.timeline = Timeline(os.path.join(t.workdir, "timeline"), rank, attempt=self.attempt,
                             meta=meta)
    run.phases.sink = self.timeline

  def on_save(self, run, step):
    saves = run.trainer.checkpointer.saves   # a refused save was dropped: nothing to record
    if saves and saves[-1]["step"] == step:
      self.timeline.checkpoint_saved(saves[-1])

  def on_loop_end(self, run):
    if self.timeline is not None:
      run.phase("done")
      run.phases.end_iteration()
      run.phases.sink = None
      self.timeline.close()


class Profiler(Callback):
  """`train.profile_steps='START:END'`: a jax.profiler trace of those steps (profiler.py)."""
  window = None

  def on_run_start(self, run):
    t = run.trainer
    self.window = ProfilerWindow(t.config.train.profile_steps, t.config.train.steps, t.workdir,
                                 t.process_index, phase=run.phase)

  def on_step_start(self, run, step):
    self.window.before_step(step)

  def on_step_dispatched(self, run, step, metrics):
    self.window.after_step(step, metrics)

  def on_loop_end(self, run):
    if self.window is not None:
      self.window.stop()


class StackDump(Callback):
  """On SIGUSR1 this process's main stack goes to
  WORKDIR/resilience/stacks/attempt{A}-rank{R}.txt (hang localisation; `kill -USR1 PID`)."""

  def __init__(self, attempt: int = 0):
    self.attempt = attempt

  def on_run_start(self, run):
    t = run.trainer
    hang.install_stack_dump(os.path.join(t.workdir, "resilience", "stacks",
                                         f"attempt{self.attempt}-rank{t.process_index}.txt"))
