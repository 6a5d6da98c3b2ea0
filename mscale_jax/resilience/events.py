"""The one definition of a heartbeat and of a failure, shared by the trainer and the driver.

A worker (one JAX process) reports `Heartbeat`s; the driver turns what it sees (heartbeats,
exit statuses, log lines) into `Failure`s. Both sides import these, so a field added here (say
a per-phase timing for straggler detection) reaches the trainer, the wire and the driver at once.
"""
import dataclasses
import re
import time
from typing import Any

# What a worker is doing. The driver's hang rule depends on it: compiling may take minutes.
STARTING, SELF_CHECK, COMPILING, TRAINING, CHECKPOINTING, EVALUATING, RESTORING, DONE, \
    FAILED = ("starting", "self_check", "compiling", "training", "checkpointing", "evaluating",
              "restoring", "done", "failed")
PHASES = (STARTING, SELF_CHECK, COMPILING, TRAINING, CHECKPOINTING, EVALUATING, RESTORING, DONE,
          FAILED)

# Kinds of failure the driver detects (Failure.kind).
EXITED = "exited"            # a worker exited with a non-zero status (or was killed: kill -9)
HANG = "hang"                # no step advance (or no heartbeat) within the hang timeout
NONFINITE = "nonfinite"      # a non-finite loss or gradient norm with train.on_nonfinite=stop
EXCEPTION = "exception"      # a Python exception in a worker
FATAL_LOG = "fatal_log"      # a log line matching FATAL_LOG_PATTERNS
STRAGGLER = "straggler"      # a rank flagged slow, with the driver's straggler policy 'evict'
SELF_CHECK_FAILED = "self_check_failed"   # a restarted group's self-check failed a slot
DRIVER_LOST = "driver_lost"  # the driver died; the same launch command, run again, resumed
REPLICA_DIVERGENCE = "replica_divergence"   # replicas disagreed before a save (replicas.py)
FAILURE_KINDS = (EXITED, HANG, NONFINITE, EXCEPTION, FATAL_LOG, STRAGGLER, SELF_CHECK_FAILED,
                 DRIVER_LOST, REPLICA_DIVERGENCE)

# Failures a worker recovers from in its own process, reported in its heartbeats
# (Heartbeat.recovered) and counted in the driver's report; no restart.
SAVE_REFUSED = "save_refused"   # the file system refused a checkpoint; dropped, training went on
RECOVERED_KINDS = (SAVE_REFUSED,)
# A heartbeat carries its worker's last this many of them.
MAX_RECOVERED = 10

# Exit statuses of experiments.train beyond 0 (done), 1 (exception) and 2 (bad input).
EXIT_NONFINITE = 3
EXIT_SELF_CHECK_FAILED = 4

# The largest heartbeat the driver accepts (JSON bytes); the client trims its log tail to fit.
MAX_HEARTBEAT_BYTES = 64 * 1024

# Log lines that mean a worker is beyond saving even if its process still lives.
FATAL_LOG_PATTERNS = tuple(re.compile(p) for p in (
    r"Fatal Python error",
    r"Check failed:",
    r"Segmentation fault",
    r"RESOURCE_EXHAUSTED",
    r"[Oo]ut of memory",
    r"NCCL (error|WARN .*failed)",
    r"[Gg]loo.*(Connection closed|[Tt]imed out|[Cc]onnection reset)",
    r"DEADLINE_EXCEEDED",
    r"coordination service.*(error|heartbeat)",
))


def from_coordination_service(text: str) -> bool:
  """Whether `text` (a log line, or an exception a worker reported) is an error of JAX's
  coordination service: the service's agent ('Polled an error from coordination service'), or
  an RPC it failed ('...CoordinationServiceError', '/xla.coordination.CoordinationService/...').
  Such an error usually names the peer that was lost rather than the process that printed it."""
  return "coordination" in text.lower()


def fatal_pattern(line: str) -> str | None:
  """The first fatal pattern `line` matches (its regex source), or None."""
  for pattern in FATAL_LOG_PATTERNS:
    if pattern.search(line):
      return pattern.pattern
  return None


@dataclasses.dataclass
class Heartbeat:
  """What one worker last said about itself (sent as JSON every few seconds).

  `step` is the last step whose result the worker has checked (loss fetched); `failure`, when
  set, is a `Failure` as a dict that the worker reports about itself just before it dies.
  """
  rank: int
  host: str
  pid: int
  attempt: int = 0
  slot: int = 0
  phase: str = STARTING
  step: int = 0
  loss: float | None = None
  grad_norm: float | None = None
  step_time_s: float | None = None     # mean seconds per step since the previous heartbeat
  data_wait_s: float | None = None     # mean seconds per step spent waiting for the batch
  step_age_s: float | None = None      # seconds since `step` was checked, when this was sent
  nonfinite_steps: int = 0
  time: float = dataclasses.field(default_factory=time.time)
  log_tail: list[str] = dataclasses.field(default_factory=list)
  failure: dict[str, Any] | None = None
  # Failures this worker recovered from in its process, its last MAX_RECOVERED:
  # [{kind, step, detail, time, seq}], seq counting them from 1 (the driver reads each once).
  recovered: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  # Observability (observability/: phases, straggler, hang): each loop iteration's phase seconds
  # since the previous heartbeat [[step, {phase: s}], ...], where the loop is now
  # [phase, step, seconds in it], and host probes {probe_ms, cpu_frac, rss_mb}.
  step_phases: list = dataclasses.field(default_factory=list)
  where: list | None = None
  host_metrics: dict[str, float] | None = None
  # Per-second monitoring samples since the previous heartbeat (worker/monitor.py, for Minder).
  monitor: list = dataclasses.field(default_factory=list)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, obj: dict[str, Any]) -> "Heartbeat":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in obj.items() if k in names})


@dataclasses.dataclass
class Failure:
  """A detected failure: what, where, when it happened (if known) and when it was noticed."""
  kind: str
  rank: int | None
  detail: str
  detected_at: float = dataclasses.field(default_factory=time.time)
  happened_at: float | None = None     # e.g. when an injected fault fired
  step: int | None = None

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)
