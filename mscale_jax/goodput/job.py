"""What a simulated training job is: its size, how its nodes fail, what recovery costs, how it
checkpoints. Plain frozen dataclasses; `validate` rejects impossible values with a ConfigError.

Units: seconds for every duration, failures per node-hour for every rate. "Work" is training
progress measured in seconds of fault-free iteration time (iterations x `iteration_s`).
"""
import dataclasses
import math

from mscale_jax.errors import ConfigError

DETECTORS = ("exit", "hang", "straggler", "planned")


@dataclasses.dataclass(frozen=True)
class FailureKind:
  """One way a node interrupts the job, at `per_node_hour` failures per node and hour of wall time.

  detected_by: 'exit' (a process dies or raises: the driver sees it), 'hang' (no progress: found
    when the hang timeout expires), 'straggler' (a slow machine: found by the straggler detector
    after `Detection.straggler_s` of training) or 'planned' (maintenance: the job checkpoints,
    stops and restarts, losing no work).
  replace_node: the failed node is evicted and replaced (hardware) rather than restarted in place.
  slowdown: for 'straggler' kinds, how much slower every iteration runs until the machine is
    found and evicted (the job runs at its slowest machine's pace).
  """
  name: str
  per_node_hour: float
  detected_by: str
  replace_node: bool
  slowdown: float = 1.0


@dataclasses.dataclass(frozen=True)
class Detection:
  """Seconds from a failure to the driver knowing of it, by detector."""
  exit_s: float                  # a process exited or raised
  hang_s: float                  # the hang timeout (no new step for this long)
  straggler_s: float = 0.0       # straggler detector latency, counted in training time

  def seconds(self, detected_by: str) -> float:
    """The latency of the detector named `detected_by` (0 for planned stops)."""
    return {"exit": self.exit_s, "hang": self.hang_s, "straggler": 0.0,
            "planned": 0.0}[detected_by]


@dataclasses.dataclass(frozen=True)
class Recovery:
  """What a restart costs after detection, in the order it happens.

  self_check_s: diagnosis (self-check tests that find the faulty node).
  warm_spares: healthy nodes kept ready; a used one is back in the pool `spare_restock_s` later.
  spare_swap_s / cold_replace_s: handing the job a warm spare / waiting for a node from the
    scheduler when no spare is left.
  restart_s: process start, collective initialisation and compilation (or a cache hit).
  restore_s: reading the latest durable checkpoint (storage tier).
  """
  self_check_s: float
  restart_s: float
  restore_s: float
  warm_spares: int = 0
  spare_swap_s: float = 0.0
  cold_replace_s: float = 0.0
  spare_restock_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Checkpointing:
  """Periodic checkpoints, every `every_s` of work (rounded to whole iterations).

  stall_s: the synchronous part that stops training (device to host copy, or the whole save).
  persist_s: the background part; a checkpoint is durable, and usable for recovery, only then.
    A save due while the previous one still persists waits for it (the stall grows).
  first_stall_s: the first save after each (re)start, when it costs more (None: `stall_s`).
  memory_every_s: an in-memory tier (checkpoints in host memory replicated on peer nodes, as
    Gemini does) every this much work, stalling `memory_stall_s` and restored in
    `memory_restore_s`; None for none. A single-node failure never loses it.
  """
  every_s: float
  stall_s: float
  persist_s: float = 0.0
  first_stall_s: float | None = None
  memory_every_s: float | None = None
  memory_stall_s: float = 0.0
  memory_restore_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Job:
  """One synchronous training job on `nodes` nodes (any node's failure stops all of them).

  overhead_per_iteration_s: fault-free wall time per iteration outside `iteration_s` (periodic
    evaluation, logging), charged to every iteration run, replayed ones included. Negative
    (above -iteration_s) when the iterations ran faster than `iteration_s` says: a drill fed the
    fault-free run's iteration time whose own steps ran faster.
  """
  nodes: int
  iteration_s: float
  kinds: tuple
  detection: Detection
  recovery: Recovery
  checkpointing: Checkpointing
  startup_s: float = 0.0
  overhead_per_iteration_s: float = 0.0
  gpus_per_node: int = 8

  @property
  def gpus(self) -> int:
    return self.nodes * self.gpus_per_node

  @property
  def failures_per_hour(self) -> float:
    """Interruptions per hour of wall time, all kinds, the whole job."""
    return self.nodes * sum(k.per_node_hour for k in self.kinds)

  @property
  def mtbf_s(self) -> float:
    """Mean time between interruptions of the whole job (inf without failures)."""
    rate = self.failures_per_hour
    return math.inf if rate == 0 else 3600.0 / rate

  @property
  def checkpoint_every(self) -> int:
    """Iterations between storage checkpoints."""
    return max(1, round(self.checkpointing.every_s / self.iteration_s))

  @property
  def memory_every(self) -> int | None:
    """Iterations between in-memory checkpoints (None without that tier)."""
    every = self.checkpointing.memory_every_s
    return None if every is None else max(1, round(every / self.iteration_s))


def _nonnegative(obj, prefix: str) -> None:
  for field in dataclasses.fields(obj):
    value = getattr(obj, field.name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value < 0 or math.isnan(value)):
      raise ConfigError(f"{prefix}.{field.name}", value, "a number >= 0")


def validate(job: Job) -> Job:
  """Returns `job` if it can be simulated; raises ConfigError naming the first bad field."""
  if not isinstance(job.nodes, int) or job.nodes < 1:
    raise ConfigError("nodes", job.nodes, "a positive integer")
  if not job.iteration_s > 0:
    raise ConfigError("iteration_s", job.iteration_s, "a duration > 0 seconds")
  for obj, prefix in ((job.detection, "detection"), (job.recovery, "recovery"),
                      (job.checkpointing, "checkpointing")):
    _nonnegative(obj, prefix)
  if job.startup_s < 0:
    raise ConfigError("startup_s", job.startup_s, "a duration >= 0")
  if not job.overhead_per_iteration_s > -job.iteration_s:
    raise ConfigError("overhead_per_iteration_s", job.overhead_per_iteration_s,
                      f"seconds > -iteration_s ({-job.iteration_s:g}): iterations take time")
  if not job.checkpointing.every_s > 0:
    raise ConfigError("checkpointing.every_s", job.checkpointing.every_s, "a duration > 0")
  if job.checkpointing.memory_every_s is not None and not job.checkpointing.memory_every_s > 0:
    raise ConfigError("checkpointing.memory_every_s", job.checkpointing.memory_every_s,
                      "None or a duration > 0")
  names = [k.name for k in job.kinds]
  if len(set(names)) != len(names):
    raise ConfigError("kinds", names, "distinct failure kind names")
  for k in job.kinds:
    if k.detected_by not in DETECTORS:
      raise ConfigError(f"kinds[{k.name}].detected_by", k.detected_by, f"one of {DETECTORS}")
    if not k.per_node_hour >= 0:
      raise ConfigError(f"kinds[{k.name}].per_node_hour", k.per_node_hour, "a rate >= 0")
    if k.slowdown < 1 or (k.detected_by == "straggler") != (k.slowdown > 1):
      raise ConfigError(f"kinds[{k.name}].slowdown", k.slowdown,
                        "> 1 for a 'straggler' kind and 1 for any other")
  return job
