"""The robust-training driver (MegaScale §4.1): start the worker group, watch it, restart it.

The driver carries no tensors. It starts one worker process per slot (each a JAX process with
its own devices; process 0 serves `jax.distributed`'s coordination service), receives their
heartbeats over HTTP/JSON, and declares a failure when a worker

  exits non-zero or is killed            (its exit status; kill -9 included)
  reports an exception, a NaN stop      (its last heartbeat, sent just before it dies)
    or replicas that disagree at a save
  logs a known fatal line                (events.FATAL_LOG_PATTERNS, in its log file)
  stops advancing                        (hang: no new step within the hang limit, or no
                                          heartbeat at all; compiling gets startup_timeout_s,
                                          a checkpoint save or evaluation io_timeout_s)

The hang limit adapts to the job (hang_limit.py): hang_timeout_s until its step time is known,
then hang_step_factor x its median step time, at least hang_floor_s.

It files the failure on the rank at fault (blame.py), kills the whole group and restarts it,
from warm standby processes when it has them (standby.py). The restarted group first runs the
self-checks (resilience/worker/selfcheck.py) on its slots; if a slot fails them, the group exits
and the driver starts it again without that slot (a spare takes its place; without spares the
job shrinks and the `data` mesh axis with it). A group that passes resumes from the latest
complete checkpoint with the same global batches. A failure that repeats at the same step, or a
bad configuration (a worker exits with status 2), ends the job. A save a worker saw refused and
went on from costs no restart (recovered.py). Everything lands in WORKDIR/resilience/report.json.
"""
import dataclasses
import itertools
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time

from mscale_jax.files import write_json
from mscale_jax.observability.observer import Observer
from mscale_jax.resilience import events
from mscale_jax.resilience.driver import blame, claim, hang_limit
from mscale_jax.resilience.driver.injector import OsInjector, group_step
from mscale_jax.resilience.driver.recovered import RecoveredLog
from mscale_jax.resilience.driver.server import HeartbeatServer, save_token
from mscale_jax.resilience.driver.standby import StandbyPool, kill_process_groups
from mscale_jax.resilience.driver.wake import Wake
from mscale_jax.resilience.faults import WORKER, Fault


@dataclasses.dataclass
class DriverOptions:
  """How to run and watch the worker group (the launcher's flags)."""
  worker_command: list[str]           # argv of one worker, without --workdir
  workdir: str
  num_processes: int = 2
  devices_per_process: int = 4
  spare_slots: int = 0
  coordinator_host: str = "127.0.0.1"
  coordinator_port: int = 0           # 0: a free port for each (re)start
  heartbeat_port: int = 0             # the driver's HTTP endpoint; 0: any free port
  heartbeat_token: str = ""           # the job's secret for that endpoint; "": a new one
  heartbeat_s: float = 2.0
  hang_timeout_s: float = 60.0       # the hang floor until the job's step time is known
  hang_floor_s: float = 10.0         # ... and once it is (see the module docstring)
  hang_step_factor: float = 20.0
  startup_timeout_s: float = 600.0
  io_timeout_s: float = 120.0         # allowed for one checkpoint save or evaluation
  max_restarts: int = 5
  self_check: bool = True             # restarted groups run the self-checks before training
  standby: bool = True                # keep warm standby processes for restarts
  faults: tuple[Fault, ...] = ()
  xla_flags: str = ""                 # extra XLA_FLAGS for the workers
  compile_cache: bool = True          # share JAX's persistent compilation cache across restarts
  compile_cache_dir: str = ""         # its folder (default WORKDIR/resilience/compile_cache)
  poll_s: float = 0.25
  # Observability (observer.py): straggler policy 'warn' | 'evict', the detector's threshold
  # (fraction of a step) and continuity window (steps), the status screen's period.
  straggler_policy: str = "warn"
  straggler_threshold: float = 0.1
  straggler_window: int = 10
  status_every_s: float = 30.0
  tokens_per_step: int = 0
  straggler_host_probes: bool = False
  # 'threshold' (step phases, straggler.py) or 'minder' (per-second monitoring samples; Minder
  # trains on the job's first `minder_fit_s` seconds), observer.DETECTORS.
  straggler_detector: str = "threshold"
  minder_fit_s: int = 120


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class _Group:
  """One start of the worker group: processes, their log files, what they last said."""

  def __init__(self, attempt: int, slots: list[int]):
    self.attempt, self.slots = attempt, slots
    self.procs: list[subprocess.Popen] = []
    self.logs: list[str] = []
    self.fatal_logs = blame.FatalLogs(self.logs)
    self.started = time.time()
    self.progress: dict[int, tuple[int, str, float]] = {}   # rank: (step, phase, since)
    self.warm = 0   # processes started from standbys
    self.first_step_at: float | None = None
    self.max_step = 0
    self.step_times: list[float] = []


class Driver:
  """Runs `options.worker_command` as a supervised, restartable multi-process job."""

  def __init__(self, options: DriverOptions, out=sys.stdout):
    self.o = options
    self.out = out
    self.workdir = os.path.abspath(options.workdir)
    self.state_dir = os.path.join(self.workdir, "resilience")
    self.slots = list(range(options.num_processes + options.spare_slots))
    self.excluded: dict[int, str] = {}
    self.failures: list[dict] = []
    self.attempts: list[dict] = []
    self._group: _Group | None = None
    self.injector = OsInjector(options.faults, self.state_dir, self.say)
    self.recovered = RecoveredLog(self.state_dir, self.injector, self.say)
    self._step_times: list[float] = []
    self.wake = Wake()   # polls come every poll_s, or at once after an exit or a report
    self.token = options.heartbeat_token or secrets.token_urlsafe(32)
    self.observer = Observer(self.workdir, self.say, policy=options.straggler_policy,
                             threshold=options.straggler_threshold,
                             window=options.straggler_window,
                             status_every_s=options.status_every_s,
                             tokens_per_step=options.tokens_per_step,
                             host_probes=options.straggler_host_probes,
                             detector=options.straggler_detector,
                             minder_fit_s=options.minder_fit_s)

  def say(self, message: str) -> None:
    print(f"[driver] {message}", file=self.out, flush=True)

  # -- the job ---------------------------------------------------------------------------

  def run(self) -> dict:
    """Runs the job to completion or until it cannot go on; returns (and writes) the report."""
    os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
    self._serve_heartbeats()
    start, attempt0 = self._resume()
    warm = self.o.standby and self.o.max_restarts > 0
    # Refilled once a group trains; a group whose self-check fails a slot exits before it does,
    # so with self-checks the pool holds the processes of the group after that one too.
    size = self.o.num_processes * (2 if self.o.self_check else 1) if warm else 0
    self.pool = StandbyPool(self.o.worker_command, size,
                            dict(os.environ, XLA_FLAGS=self._xla_flags()),
                            os.path.join(self.workdir, "logs"))
    outcome = "failed"
    restarts = self._restarts   # a restart that only drops slots failing a self-check is free
    try:
      for attempt in itertools.count(attempt0):
        active = [s for s in self.slots if s not in self.excluded][:self.o.num_processes]
        if not active:
          outcome = "no healthy slot left"
          break
        group = self._start(attempt, active)
        failure = self._supervise(group)
        if failure is not None and failure.kind == events.HANG:   # before the group is killed
          blame.localised_hang(failure, self.observer.localize_hang(failure))
        if failure is not None and failure.kind == events.STRAGGLER:
          self.excluded[active[failure.rank]] = failure.detail   # policy 'evict'
        self._stop(group)
        self._step_times += group.step_times
        self.attempts.append({"attempt": attempt, "slots": active, "started": group.started,
                              "ended": time.time(), "max_step": group.max_step,
                              "warm_processes": group.warm,
                              "failure": failure and failure.kind})
        self._claim([])
        excluded = self._take_diagnosis(group, failure)
        if self.failures and self.failures[-1].get("restart_s") is None \
            and group.first_step_at is not None:
          self.failures[-1]["restart_s"] = group.first_step_at - self.failures[-1]["detected_at"]
        if failure is None:
          outcome = "completed"
          break
        if failure.kind == events.SELF_CHECK_FAILED and excluded:
          continue   # start again without the slots that failed (at most once per slot)
        record = self._record(failure, group)
        if failure.kind == events.EXITED and failure.detail == "exit status 2":
          outcome = "bad configuration (a worker exited with status 2; see its log)"
          break
        if self._repeats(record):
          outcome = f"the same failure twice at step {record['step']}: not transient"
          break
        if restarts == self.o.max_restarts:
          outcome = f"restart budget ({self.o.max_restarts}) spent"
          break
        restarts = self._restarts = restarts + 1
        record["restore_step"] = claim.latest_checkpoint(self.workdir)
        record["steps_lost"] = max(record["last_step"] - record["restore_step"], 0)
        self.say(f"restarting from step {record['restore_step']} "
                 f"({record['steps_lost']} steps to replay)")
    finally:
      if self._group is not None:
        self._stop(self._group)
      self.injector.close()
      self.pool.close()
      self.server.close()
    self._claim([], outcome)
    report = self._report(outcome, time.time() - start)
    self.observer.finish(report)
    return report

  def _resume(self) -> tuple[float, int]:
    """(job start, first attempt): a new job's, or that of a job whose driver died (claim.py)."""
    self._restarts = 0
    previous = claim.read(self.state_dir)
    if previous is None or previous.get("outcome") is not None:
      self._started = time.time()
      return self._started, 0
    ended = claim.end_leftover_workers(previous)
    self._started = previous["started"]
    self.attempts, self.failures = previous["attempts"], previous["failures"]
    self.recovered.records = previous.get("recovered_in_process", [])
    self.excluded = {int(k): v for k, v in previous["excluded"].items()}
    self.observer.flags[:0] = previous.get("straggler_flags", [])
    self.observer.hangs[:0] = previous.get("hang_localisations", [])
    self._restarts = previous["restarts"] + 1
    if previous.get("group"):   # the dead driver's last group: its self-check verdict, if any
      self._take_diagnosis(_Group(previous["group"]["attempt"], previous["group"]["slots"]), None)
    record, attempt = claim.lost_driver(previous, ended, self.workdir)
    self.failures.append(record)
    self.attempts.append(attempt)
    self.say(f"resuming: {record['detail']}; from step {record['restore_step']}")
    return self._started, len(self.attempts)

  def _claim(self, procs, outcome: str | None = None) -> None:
    """Writes WORKDIR/resilience/driver.json: this driver, its workers, the job so far."""
    g = self._group
    claim.write(self.state_dir, [p.pid for p in procs], {
        "group": g and {"attempt": g.attempt, "slots": g.slots, "started": g.started},
        "started": self._started, "outcome": outcome, "restarts": self._restarts,
        "attempts": self.attempts, "failures": self.failures, "excluded": self.excluded,
        # What the observer found, and what was recovered in-process, for a later driver's report.
        "straggler_flags": self.observer.flags, "hang_localisations": self.observer.hangs,
        "recovered_in_process": self.recovered.records})

  def watch(self, attempt: int) -> dict:
    """Cluster mode: the scheduler started the workers; only their heartbeats are watched.

    Returns (and writes to resilience/report-attempt<attempt>.json) once every rank reports
    'done', or at the first failure detected: the job script then ends the worker step and
    starts the next attempt (cluster.py).
    """
    self._serve_heartbeats()
    self.server.clear(self.o.num_processes)
    self.say(f"watching {self.o.num_processes} workers (attempt {attempt}) at {self.server.url}")
    group = _Group(attempt, list(range(self.o.num_processes)))
    self.observer.start_group(group)
    start, outcome = time.time(), "failed"
    try:
      while True:
        beats = {r: b for r, (b, _) in self.server.latest().items() if b.attempt == attempt}
        if len(beats) == self.o.num_processes and \
            all(b.phase == events.DONE for b in beats.values()):
          outcome = "completed"
          break
        failure = self._poll(group)
        if failure is not None:
          self._record(failure, group)
          break
        self.wake.wait(self.o.poll_s)
    finally:
      self.server.close()
    self._step_times += group.step_times
    self.attempts.append({"attempt": attempt, "slots": group.slots, "started": group.started,
                          "ended": time.time(), "max_step": group.max_step,
                          "failure": self.failures[-1]["kind"] if self.failures else None})
    return self._report(outcome, time.time() - start, f"report-attempt{attempt}.json")

  def _serve_heartbeats(self) -> None:
    """Starts the heartbeat endpoint; its token goes to WORKDIR/resilience/heartbeat_token."""
    save_token(self.token, os.path.join(self.state_dir, "heartbeat_token"))
    self.server = HeartbeatServer(self.o.coordinator_host, self.o.heartbeat_port,
                                  token=self.token, say=self.say)
    self.server.listeners += [self.observer.receive, self.wake.on_heartbeat]

  def _start(self, attempt: int, slots: list[int]) -> _Group:
    o = self.o
    group = self._group = _Group(attempt, slots)
    self.server.clear(len(slots))
    self.observer.start_group(group, claim.latest_checkpoint(self.workdir))
    port = o.coordinator_port or free_port(o.coordinator_host)
    command = list(o.worker_command) + [f"--workdir={self.workdir}"]
    if len(slots) < o.num_processes:
      command.append("--config.mesh.data=-1")   # the data axis absorbs the lost processes
    self.say(f"attempt {attempt}: {len(slots)} processes x {o.devices_per_process} devices "
             f"on slots {slots}, coordinator {o.coordinator_host}:{port}")
    for rank, slot in enumerate(slots):
      env = self._worker_env(rank, slot, len(slots), port, attempt)
      path = os.path.join(self.workdir, "logs", f"attempt{attempt}-rank{rank}.log")
      proc = self.pool.take()
      if proc is not None and self.pool.order(proc, command[3:], env, path):
        group.warm += 1
      else:
        with open(path, "wb") as log_file:
          proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, **env), process_group=0)
      group.procs.append(proc)
      group.logs.append(path)
      self.wake.watch(proc)
    self._claim(group.procs)
    if group.warm:
      self.say(f"attempt {attempt}: {group.warm} of {len(slots)} processes from warm standbys")
    return group

  def _xla_flags(self) -> str:
    return (f"--xla_force_host_platform_device_count={self.o.devices_per_process} "
            f"{self.o.xla_flags}").strip()

  def _worker_env(self, rank: int, slot: int, count: int, port: int, attempt: int) -> dict:
    """The MSCALE_* variables (resilience/worker/) of rank `rank` on slot `slot`, and XLA_FLAGS."""
    o = self.o
    env = {"XLA_FLAGS": self._xla_flags(),
           "MSCALE_COORDINATOR": f"{o.coordinator_host}:{port}",
           "MSCALE_NUM_PROCESSES": str(count), "MSCALE_PROCESS_ID": str(rank),
           "MSCALE_HEARTBEAT_S": str(o.heartbeat_s), "MSCALE_ATTEMPT": str(attempt),
           "MSCALE_SLOT": str(slot), "MSCALE_HEARTBEAT_URL": self.server.url,
           "MSCALE_HEARTBEAT_TOKEN": self.token,
           "MSCALE_FAULTS": json.dumps([f.spec for f in o.faults if f.injected_by == WORKER]),
           "MSCALE_SELF_CHECK": "1" if o.self_check and attempt > 0 else "0",
           "MSCALE_BAD_SLOT": str(min([f.step for f in o.faults
                                       if f.kind == "bad_slot" and f.slot == slot], default=0))}
    if o.compile_cache:
      env["MSCALE_COMPILE_CACHE"] = o.compile_cache_dir or os.path.join(self.state_dir,
                                                                        "compile_cache")
    return env

  def _stop(self, group: _Group) -> None:
    """Kills every process of the group (and anything it started), then reaps them."""
    kill_process_groups(group.procs)
    if self._group is group:
      self._group = None

  # -- detection -------------------------------------------------------------------------

  def _supervise(self, group: _Group) -> events.Failure | None:
    """Watches the group until every worker exits 0 (None) or a failure is detected."""
    while True:
      if all(p.poll() == 0 for p in group.procs):
        self._note_progress(group, self._beats(group))   # the last step, sent before exiting
        return None
      marks = len(self.observer.flags) + len(self.recovered.records)
      failure = self._poll(group)
      if len(self.observer.flags) + len(self.recovered.records) > marks:
        self._claim(group.procs)   # a straggler flag or a recovered save outlives this driver
      if group.first_step_at is not None:
        self.pool.fill()   # standbys for the next restart, once this group's start is done
      if failure is not None:
        return failure
      self.wake.wait(self.o.poll_s)

  def _poll(self, group: _Group) -> events.Failure | None:
    now = time.time()
    # Exit statuses before heartbeats: a worker reports its own failure before it exits, so
    # read in this order an exit always comes with what the worker said about it.
    codes = [p.poll() for p in group.procs]
    beats = self._beats(group)
    self._note_progress(group, beats)
    self.recovered.note(group, beats)
    self.injector.poll(group.procs, group_step(beats, len(group.slots)))
    # Strongest evidence first (blame.py): a killed worker (its peers' errors follow from it),
    # what workers said about themselves, other exits, fatal log lines; then stragglers, hangs.
    return (blame.killed_by_signal(codes, group.logs, blame.reporting_ranks(beats))
            or blame.reported(beats, len(group.slots))
            or blame.exited(codes) or group.fatal_logs.poll(codes, now)
            or self.observer.observe(now) or self._check_progress(group, beats, codes, now))

  def _beats(self, group: _Group) -> dict:
    """rank -> (latest heartbeat of this group's attempt, time received)."""
    return {r: (b, t) for r, (b, t) in self.server.latest().items()
            if b.attempt == group.attempt}

  def _note_progress(self, group: _Group, beats) -> None:
    """Each rank's step and phase since when, and the group's first step (before failures)."""
    for rank, (beat, received) in beats.items():
      step, phase, since = group.progress.get(rank, (None, None, group.started))
      if (beat.step, beat.phase) != (step, phase):
        # A new step counts from when the worker checked it, not from when the (periodic)
        # heartbeat saying so came; a new phase from when it came (it is sent at once).
        age = (beat.step_age_s or 0.0) if beat.phase == phase else 0.0
        group.progress[rank] = (beat.step, beat.phase, max(received - age, since))
        if beat.step_time_s and beat.phase == events.TRAINING and beat.step != step:
          group.step_times.append(beat.step_time_s)
      if beat.step > group.max_step:
        group.max_step = beat.step
        if group.first_step_at is None and beat.attempt == group.attempt and \
            beat.phase == events.TRAINING:
          group.first_step_at = received

  def hang_limit(self, group: _Group) -> float:
    """Seconds without a new step that make a hang (hang_limit.py): step times from the
    heartbeats of this group and the earlier ones (the same job, the same steps)."""
    o = self.o
    # Each poll calls this and the lists grow all job long: copy only their last WINDOW.
    window = hang_limit.WINDOW
    times = (self._step_times[-window:] + group.step_times[-window:])[-window:]
    return hang_limit.limit_s(times, o.hang_timeout_s, o.hang_floor_s, o.hang_step_factor)

  def _check_progress(self, group: _Group, beats, codes: list,
                      now: float) -> events.Failure | None:
    o = self.o
    limit = self.hang_limit(group)
    # Ranks step together (every step has collectives), so a hang is the group's: no rank has
    # advanced within the allowance of the slowest phase any rank is in (ranks wait for a peer
    # that compiles or saves). The rank that advanced least recently is named.
    ranks, allowed = [], 0.0
    for rank in range(len(group.slots)):
      if (codes and codes[rank] == 0) or \
          (rank in beats and beats[rank][0].phase == events.DONE):
        continue
      step, phase, since = group.progress.get(rank, (0, events.STARTING, group.started))
      if group.first_step_at is None or phase in (events.STARTING, events.COMPILING,
                                                  events.RESTORING):
        allowed = max(allowed, o.startup_timeout_s)
      elif phase in (events.CHECKPOINTING, events.EVALUATING):
        allowed = max(allowed, limit, o.io_timeout_s)
      else:
        allowed = max(allowed, limit)
      ranks.append((max(since, group.first_step_at or since), rank, step, phase))
      last = beats.get(rank, (None, group.started))[1]
      if now - last > max(o.startup_timeout_s if group.first_step_at is None else limit,
                          3 * o.heartbeat_s + 10):
        return events.Failure(events.HANG, rank, f"no heartbeat for {now - last:.0f} s")
    if ranks and now - max(r[0] for r in ranks) > allowed:
      since, rank, step, phase = min(ranks)
      return events.Failure(events.HANG, rank, f"no step for {now - since:.0f} s (limit "
                            f"{allowed:.0f} s); rank {rank} last advanced, to step {step}, "
                            f"in phase {phase!r}", step=step)
    return None

  # -- after a failure -------------------------------------------------------------------

  def _record(self, failure: events.Failure, group: _Group) -> dict:
    self.injector.failure_detected()
    fired = claim.fired_since(self.state_dir, group.started)
    if fired is None and failure.kind == events.REPLICA_DIVERGENCE:
      fired = claim.bad_slot_fired(self.workdir, self.o.faults, group.slots)
    if fired:
      failure.happened_at = fired["time"]
      failure.step = failure.step or fired["step"]
    record = failure.to_json()
    record.update(attempt=group.attempt, slot=group.slots[failure.rank or 0],
                  last_step=max(group.max_step, (fired or {}).get("step", 1) - 1),
                  injected=fired and fired["fault"], restart_s=None,
                  detection_latency_s=(failure.detected_at - failure.happened_at
                                       if failure.happened_at else None))
    self.failures.append(record)
    latency = record["detection_latency_s"]
    self.say(f"detected {failure.kind} on rank {failure.rank}: {failure.detail}"
             + (f" ({latency:.1f} s after the fault)" if latency is not None else ""))
    return record

  def _repeats(self, record: dict) -> bool:
    if len(self.failures) < 2 or record.get("injected"):
      return False
    previous = self.failures[-2]
    return (previous["kind"], previous["step"]) == (record["kind"], record["step"]) and \
        record["step"] is not None

  def _take_diagnosis(self, group: _Group, failure: events.Failure | None) -> int:
    """Adds the group's self-check verdict (if it ran) to the failure that caused the restart.

    Slots the verdict fails are excluded (returns how many). A rank that died or hung in its
    self-check produced no result: its slot is excluded too.
    """
    path = os.path.join(self.state_dir, f"selfcheck-{group.attempt}", "verdict.json")
    verdict = None
    if os.path.exists(path):
      with open(path) as f:
        verdict = json.load(f)
    elif failure is not None and failure.kind in (events.EXITED, events.HANG) and \
        group.progress.get(failure.rank, (0, None, 0))[1] == events.SELF_CHECK:
      why = "no self-check result (the process crashed or hung)"
      verdict = {"seconds": time.time() - group.started, "results": {},
                 "excluded": {str(group.slots[failure.rank]): why}}
    if verdict is None or not self.failures:
      return 0
    for slot, why in verdict["excluded"].items():
      self.excluded[int(slot)] = why
      self.say(f"self-check: slot {slot} fails ({why}); excluded")
    if not verdict["excluded"]:
      self.say(f"self-check passed on slots {group.slots} in {verdict['seconds']:.1f} s")
    diagnosis = self.failures[-1].setdefault(
        "diagnosis", {"ran": True, "seconds": 0.0, "excluded": {}, "checks": []})
    diagnosis["seconds"] += verdict["seconds"]
    diagnosis["excluded"].update(verdict["excluded"])
    diagnosis["checks"].append({"attempt": group.attempt, "slots": group.slots,
                                "results": verdict["results"]})
    return len(verdict["excluded"])

  # -- the report ------------------------------------------------------------------------

  def _report(self, outcome: str, wall_s: float, name: str = "report.json") -> dict:
    steps = max([a["max_step"] for a in self.attempts], default=0)
    step_time = statistics.median(self._step_times) if self._step_times else None
    report = {"outcome": outcome, "completed": outcome == "completed", "wall_s": wall_s,
              "num_processes": self.o.num_processes,
              "devices_per_process": self.o.devices_per_process,
              "restarts": len(self.attempts) - 1, "final_step": steps,
              "median_step_time_s": step_time,
              # MegaScale's effective training time rate: iterations x iteration time / wall
              # time (iteration time: the median step time heartbeats reported).
              "effective_training_time_rate": steps * step_time / wall_s if step_time else None,
              "failures": self.failures, "recovered_in_process": self.recovered.records,
              "excluded_slots": self.excluded, "rejected_requests": dict(self.server.rejections),
              "attempts": self.attempts, "observability": self.observer.summary()}
    path = os.path.join(self.state_dir, name)
    write_json(path, report, indent=2, default=str)
    self.say(f"{outcome}: {len(self.failures)} failures, {report['restarts']} restarts, "
             f"{wall_s:.0f} s; report {path}")
    return report
