"""`train.profile_steps='START:END'`: a `jax.profiler` trace of those steps on every process.

Each process writes its own trace under WORKDIR/profile/rank{R} (TensorBoard's profile plugin
layout, plugins/profile/<run>/<host>.xplane.pb, plus perfetto_trace.json.gz for Perfetto) and
prints the path. The window closes after step END's result is on the host (one extra sync,
only then).
"""
import os

import jax

from mscale_jax.config import profile_window


class ProfilerWindow:
  """Starts the trace before step START is dispatched, stops it once step END is done."""

  def __init__(self, spec: str, steps: int, workdir: str, rank: int, phase=None):
    self.window = profile_window(spec, steps)
    self.phase = phase   # the loop's PhaseMachine.phase: starting and stopping are 'profile'
    self.directory = os.path.join(workdir, "profile", f"rank{rank}")
    self.rank = rank
    self.active = False

  def before_step(self, step: int) -> None:
    if self.window and step == self.window[0] and not self.active:
      os.makedirs(self.directory, exist_ok=True)
      self._phase("profile")
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.active = True
      self._phase("host")

  def after_step(self, step: int, outputs) -> None:
    """Call after dispatching step `step`; `outputs` are what it returned (waited for at END)."""
    if self.active and step == self.window[1]:
      self._phase("profile")
      jax.block_until_ready(outputs)
      self.stop()
      self._phase("host")

  def _phase(self, name: str) -> None:
    if self.phase is not None:
      self.phase(name)

  def stop(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      first, last = self.window
      print(f"[profile] rank {self.rank}: jax.profiler trace of steps {first}-{last} in "
            f"{self.directory} (TensorBoard: tensorboard --logdir {self.directory}; Perfetto: "
            f"open plugins/profile/*/perfetto_trace.json.gz at ui.perfetto.dev)", flush=True)
