"""Injecting faults inside a training process (drills and tests; off unless asked for).

`FaultInjector` is called at the training loop's fault points (through the `FaultInjection`
callback, mscale_jax/callbacks/worker.py). Every fault except `slow` fires once per run: before
firing, the worker writes a marker into WORKDIR/resilience/faults/ (the driver reads its time
as the moment the fault happened), so a restarted worker replaying step N does not fire it again.

The `nan` fault leaves the compiled train step alone: the poisoned step runs the production
program on NaN parameters made by a separate small program (`nan_program`), compiled only when
such a fault is armed; the real parameters are put back after the step. The step finds a non-finite
loss and gradient norm, applies no update, and the non-finite policy takes over, exactly as for
a NaN that arises in training.

The `bad_slot` fault (MSCALE_BAD_SLOT=N, set by the driver for the processes on that slot)
models a device or link that delivers wrong collective results from step N on: `corrupt_received`
is what it does to data it receives. Training's copy of the updated parameters (what the
gradient all-reduce delivered) and the self-check's all-gather pass through it alike, so the
self-check finds a fault that really hurts training rather than one made for it.
"""
import os
import signal
import threading
import time

from mscale_jax.files import write_json
from mscale_jax.resilience.faults import WORKER, Fault, bad_slot_marker


class FaultInjector:
  """The worker's side of fault injection: fires the faults of this rank at their points.

  `rank` is this process's index; `marker_dir` holds the fired markers (shared by all ranks).
  With no faults every call is a cheap no-op.
  """

  def __init__(self, faults, rank: int, marker_dir: str | None):
    self.faults = [f for f in faults if f.injected_by == WORKER]
    self.rank = rank
    self.marker_dir = marker_dir
    self._slow_since = None

  def _mine(self, kind: str, step: int, **match) -> Fault | None:
    for f in self.faults:
      if f.kind == kind and f.step == step and (kind == "nan" or f.rank == self.rank) and \
          all(getattr(f, k) == v for k, v in match.items()) and not self._fired(f):
        return f
    return None

  def _marker(self, fault: Fault) -> str:
    return os.path.join(self.marker_dir, f"{fault.index}-{fault.kind}-rank{self.rank}.json")

  def _fired(self, fault: Fault) -> bool:
    return self.marker_dir is not None and os.path.exists(self._marker(fault))

  def _fire(self, fault: Fault, step: int) -> None:
    if self.marker_dir is not None:
      write_json(self._marker(fault),
                 {"fault": fault.spec, "rank": self.rank, "step": step, "time": time.time()})
    print(f"[fault] rank {self.rank}: injecting {fault.spec}", flush=True)

  def before_step(self, step: int) -> None:
    """Fault point before step `step` (1-based) runs: kill, hang or raise, as asked."""
    if not self.faults:
      return
    if f := self._mine("kill", step, at="step"):
      self._fire(f, step)
      os.kill(os.getpid(), signal.SIGKILL)
    if f := self._mine("hang", step):
      self._fire(f, step)
      threading.Event().wait()
    if f := self._mine("exception", step):
      self._fire(f, step)
      raise RuntimeError(f"injected fault {f.spec}")

  def after_save_started(self, step: int) -> None:
    """Fault point right after the save of step `step` began (its write is in flight)."""
    if f := self._mine("kill", step, at="save"):
      self._fire(f, step)
      os.kill(os.getpid(), signal.SIGKILL)

  def armed(self, kind: str) -> bool:
    """Whether a fault of `kind` is still to fire on this rank in this run."""
    return any(f.kind == kind and (kind == "nan" or f.rank == self.rank) and not self._fired(f)
               for f in self.faults)

  def poisons(self, step: int) -> bool:
    """True (once) if a `nan` fault makes step `step` run on NaN parameters."""
    if self.faults and (f := self._mine("nan", step)):
      self._fire(f, step)
      return True
    return False

  def slow_down(self, step: int) -> None:
    """After step `step`: on a slow rank, sleeps (factor - 1) times the step's own time.

    The step's time is measured from the end of the previous call, so the sleeps do not
    compound.
    """
    now = time.perf_counter()
    work, self._slow_since = now - (self._slow_since or now), now
    for f in self.faults:
      if f.kind == "slow" and f.rank == self.rank and step >= f.step:
        time.sleep((f.factor - 1.0) * work)
        self._slow_since = time.perf_counter()


def corrupt_received(x):
  """`x` (a numpy or jax array) as a bad link delivers it: every 97th element off by 1 + |x|.

  Done on the host in numpy, a copy: the training loop calls it on each local shard after
  every step from the fault's on, and eager jnp ops would compile a small program per op and
  per device the first time (seconds on a loaded machine, long enough to read as a hang).
  """
  import numpy as np
  bad = np.array(x, copy=True)
  flat = bad.reshape(-1)   # a view of `bad`
  flat[::97] += (1 + np.abs(flat[::97])).astype(bad.dtype)
  return bad


def slot_is_bad(env, workdir: str) -> bool:
  """Whether this process's slot is bad now: MSCALE_BAD_SLOT=N and N <= 1 or training on this
  slot has reached step N (its marker exists)."""
  step = int(env.get("MSCALE_BAD_SLOT", "0") or 0)
  return step > 0 and (step <= 1 or os.path.exists(
      bad_slot_marker(workdir, int(env.get("MSCALE_SLOT", "0")))))


def nan_program(tree, shardings, mesh):
  """The separate program a `nan` fault runs: a copy of the array pytree `tree` (its shapes,
  as `shardings` lay it out on `mesh`) filled with NaN, ready now; the arrays it is given are
  left as they are.

  Served by this process's compile cache (compile_cache.py) where one is configured: it is
  made at the start of every run in which the fault is still armed, i.e. every restart before
  it fires, and JAX's own cache serves only process 0, so every other process compiled it
  again while process 0 waited for it at the first step.
  """
  import jax
  import jax.numpy as jnp
  from mscale_jax import compile_cache

  def nan_fill(t):
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), t)
  fill = jax.jit(nan_fill, out_shardings=shardings)
  program, _ = compile_cache.load_or_lower(fill.lower, (tree,), "nan_fill", mesh,
                                           f"nan fill, out_shardings {shardings!r}")
  return program
