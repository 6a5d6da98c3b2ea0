"""The loop's side of the resilience worker room: heartbeats to the driver, injected faults.

Neither is a standard callback: experiments.train adds them when the driver's environment (or
`--fault`) asks for them (mscale_jax/resilience/worker/).
"""
import os

import jax

from mscale_jax.callbacks.base import Callback
from mscale_jax.errors import ConfigError, NonFiniteError
from mscale_jax.observability.phases import COARSE
from mscale_jax.replicas import ReplicaDivergenceError
from mscale_jax.resilience import events
from mscale_jax.files import write_json
from mscale_jax.resilience.worker.faults import (FaultInjector, bad_slot_marker,
                                                 corrupt_received, nan_program)


class Heartbeats(Callback):
  """Feeds a `HeartbeatClient`: the coarse phase, each checked step, rollbacks, refused saves,
  and this worker's own failure (a non-finite stop or an exception) before it exits."""

  def __init__(self, client):
    self.client = client
    self._coarse = None

  def on_run_start(self, run):
    self.client.start(phases=run.phases)

  def on_phase(self, run, name, step):
    coarse = COARSE.get(name)
    if coarse is not None and coarse != self._coarse:
      self._coarse = coarse
      self.client.phase(coarse)

  def on_step_checked(self, run, checked):
    self.client.progress(checked.step, checked.loss, checked.grad_norm, checked.data_wait_s)
    if not checked.finite:
      self.client.nonfinite(checked.step)

  def on_rewind(self, run, step):
    self.client.rewind(step)

  def on_save_refused(self, run, step, error):
    self.client.recovered(events.SAVE_REFUSED, str(error), step=step)

  def on_error(self, run, error):
    if isinstance(error, NonFiniteError):
      self.client.failure(events.NONFINITE, error.detail, step=error.step)
    elif isinstance(error, ReplicaDivergenceError):
      self.client.failure(events.REPLICA_DIVERGENCE, str(error), step=error.step,
                          at_fault=error.culprit)
    elif isinstance(error, Exception) and not isinstance(error, ConfigError):
      self.client.failure(events.EXCEPTION, f"{type(error).__name__}: {error}")

  def on_run_end(self, run, summary):
    self.client.close()


class FaultInjection(Callback):
  """Fires `faults` (resilience/faults.py) of this rank at the loop's fault points."""

  def __init__(self, faults):
    self.faults = list(faults)
    self.injector = None
    self._poison = None   # the `nan` fault's program, compiled if one is armed
    self._params = None   # the real parameters while a `nan` fault's step runs

  def on_run_start(self, run):
    t = run.trainer
    self.injector = FaultInjector(self.faults, t.process_index,
                                  os.path.join(t.workdir, "resilience", "faults"))

  def on_loop_start(self, run):
    if self.injector.armed("nan"):
      with jax.set_mesh(run.trainer.mesh):
        self._poison = nan_program(run.state["params"],
                                   run.trainer.state_shardings["params"], run.trainer.mesh)

  def on_step_start(self, run, step):
    self.injector.before_step(step)
    if self.injector.poisons(step):
      self._params = run.state["params"]
      with jax.set_mesh(run.trainer.mesh):
        run.state = {**run.state, "params": self._poison(self._params)}

  def on_step_dispatched(self, run, step, metrics):
    if self._params is not None:   # the step applied no update: its parameters were NaN
      run.state, self._params = {**run.state, "params": self._params}, None

  def on_step_checked(self, run, checked):
    self.injector.slow_down(checked.step)

  def on_save(self, run, step):
    self.injector.after_save_started(step)


class BadSlot(Callback):
  """The `bad_slot` fault on this process (resilience/faults.py): from step `step` on, the
  updated parameters this process holds after each step (what the gradient all-reduce delivered
  to it) are corrupted by `corrupt_received`, in its first parameter's local shards. Its replicas
  then differ from the other processes' copies: the next save's replica check refuses them
  (mscale_jax/replicas.py)."""

  def __init__(self, step: int, slot: int):
    self.step, self.slot = step, slot

  def on_step_dispatched(self, run, step, metrics):
    if step < self.step:
      return
    marker = bad_slot_marker(run.trainer.workdir, self.slot)
    if not os.path.exists(marker):
      write_json(marker, {"slot": self.slot, "step": step, "rank": run.trainer.process_index})
    leaves, treedef = jax.tree.flatten(run.state["params"])
    x = leaves[0]
    leaves[0] = jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [jax.device_put(corrupt_received(s.data), s.device)
                              for s in x.addressable_shards])
    run.state = {**run.state, "params": jax.tree.unflatten(treedef, leaves)}
