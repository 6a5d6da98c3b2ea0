"""Per-rank timeline: what each process's training loop is doing, span by span (MegaScale §5).

The loop is a state machine: `Timeline.phase(name)` closes the open span and opens the next, so
the spans of one rank tile its time without gaps or overlaps. The hot path costs one
`time.perf_counter()` and one list append per phase change (measured in
experiments/timeline_overhead.py); a background thread writes the buffer every few seconds to
WORKDIR/timeline/rank{R}.jsonl (one JSON object per line, a `meta` line first per process
start). `trace.py` merges the ranks' files into one Chrome trace.

Loop phases (per iteration `step`, in order):

  data_wait        next(data iterator): waiting for this process's rows of the batch
  host_to_device   the rows -> a global jax.Array (make_array_from_process_local_data)
  dispatch         calling the compiled step (on GPU/TPU it returns once the step is
                   enqueued; XLA:CPU runs most of the step before returning)
  sync             fetching the previous step's loss/finiteness: blocks until that step is
                   done on the devices, including waiting for peers in its collectives. This
                   is where the loop already synchronises (one step late): no extra sync.
  host             host work after the fetch (heartbeat bookkeeping, injected slowness, ...)
  log, eval        a logged step's metrics and the held-out evaluation
  checkpoint_stall the save's device-to-host stage (the loop is blocked)

and, outside the loop: restore, compile, profile. Background checkpoint writes are spans on a
second track of the same rank ('checkpoint'). Timestamps are this host's wall clock
(`time.time()`, read once at start; spans are perf_counter offsets from it); the driver
measures each worker's clock offset from its heartbeats and the merge applies it.
"""
import collections
import json
import os
import resource
import socket
import threading
import time

import numpy as np

LOOP, CHECKPOINT = "loop", "checkpoint"      # the tracks of one rank
# Phases in which the loop may wait for something outside this process: the devices and,
# through their collectives, the other ranks. `sync` always; `dispatch` when the runtime runs
# the step before returning (XLA:CPU here does) or its queue is full. The rest is own work.
WAIT_PHASES = ("dispatch", "sync")
LOOP_PHASES = ("data_wait", "host_to_device", "dispatch", "sync", "host", "log", "eval",
               "checkpoint_stall")


class Timeline:
  """Buffered span recorder of one rank; `enabled=False` makes every call a cheap no-op.

  Args:
    directory: where rank{R}.jsonl goes (WORKDIR/timeline).
    rank: this process's index; attempt: which (re)start of the job this process is.
    meta: extra fields for the meta line (e.g. this rank's mesh coordinates).
    flush_every_s: period of the background writer.
  """

  def __init__(self, directory: str, rank: int = 0, *, attempt: int = 0, meta=None,
               flush_every_s: float = 2.0, enabled: bool = True):
    self.enabled = enabled
    self.rank, self.attempt = rank, attempt
    self.path = os.path.join(directory, f"rank{rank}.jsonl")
    self._wall0, self._perf0 = time.time(), time.perf_counter()
    self._buffer = collections.deque()        # (name, step, start, end, track), perf seconds
    self._open = (None, None, self._perf0)    # (phase, step, since)
    self._step_phases: dict[str, float] = {}
    self._step_of_phases = None
    self.completed = collections.deque(maxlen=512)   # (step, {phase: seconds}) per iteration
    self._saves: list[tuple[dict, float]] = []        # (checkpointer save entry, stall end)
    self._probe_at = (time.process_time(), time.perf_counter())
    self._probe_matrix = None
    self._stop = threading.Event()
    self._thread = None
    if not enabled:
      return
    os.makedirs(directory, exist_ok=True)
    header = {"meta": {"rank": rank, "attempt": attempt, "host": socket.gethostname(),
                       "pid": os.getpid(), "wall0": self._wall0, **(meta or {})}}
    with open(self.path, "a") as f:
      f.write(json.dumps(header) + "\n")
    self._thread = threading.Thread(target=self._run, args=(flush_every_s,), name="timeline",
                                    daemon=True)
    self._thread.start()

  # -- the hot path ------------------------------------------------------------------------

  def phase(self, name: str, step: int | None = None) -> None:
    """Closes the open span now and opens `name` (for loop iteration `step`; None: the same)."""
    if not self.enabled:
      return
    open_name, open_step, since = self._open
    if step is None:
      step = open_step
    if name == open_name and step == open_step:
      return
    now = time.perf_counter()
    if open_name is not None:
      self._buffer.append((open_name, open_step, since, now, LOOP))
      if open_step is not None and open_name in LOOP_PHASES:
        if open_step != self._step_of_phases:
          self._end_iteration()
          self._step_of_phases = open_step
        self._step_phases[open_name] = self._step_phases.get(open_name, 0.0) + now - since
    self._open = (name, step, now)

  def _end_iteration(self) -> None:
    if self._step_of_phases is not None:
      self.completed.append((self._step_of_phases, self._step_phases))
    self._step_phases = {}

  def checkpoint_saved(self, entry: dict) -> None:
    """A save's stall just ended; `entry` (Checkpointer.saves[-1]) gets its `write_s` from
    orbax's callback later, and the writer thread then records the background write span."""
    if self.enabled:
      self._saves.append((entry, time.perf_counter()))

  # -- what the heartbeat carries ----------------------------------------------------------

  def where(self) -> list:
    """[phase, step, seconds in it] of the loop right now."""
    name, step, since = self._open
    return [name, step, round(time.perf_counter() - since, 3)]

  def drain(self) -> list:
    """Per-iteration phase seconds completed since the last call: [[step, {phase: s}], ...]."""
    out = []
    while self.completed:
      step, phases = self.completed.popleft()
      out.append([step, {k: round(v, 6) for k, v in phases.items()}])
    return out

  def host_metrics(self) -> dict:
    """Host probes: a small local matmul's time, this process's CPU share, resident memory."""
    if self._probe_matrix is None:
      self._probe_matrix = np.random.default_rng(0).standard_normal((160, 160), np.float32)
    a, best = self._probe_matrix, float("inf")
    for _ in range(3):
      start = time.perf_counter()
      a @ a
      best = min(best, time.perf_counter() - start)
    cpu, wall = time.process_time(), time.perf_counter()
    cpu_frac = (cpu - self._probe_at[0]) / max(wall - self._probe_at[1], 1e-9)
    self._probe_at = (cpu, wall)
    return {"probe_ms": round(1e3 * best, 4), "cpu_frac": round(cpu_frac, 3),
            "rss_mb": round(_rss_bytes() / 2**20, 1)}

  # -- the writer --------------------------------------------------------------------------

  def _run(self, every_s: float) -> None:
    while not self._stop.wait(every_s):
      self.flush()

  def flush(self) -> None:
    """Writes the buffered spans (and finished background writes) to the rank's file."""
    if not self.enabled:
      return
    pending = []
    for entry, stall_end in self._saves:
      if entry.get("write_s") is not None:
        self._buffer.append(("checkpoint_write", entry.get("step"), stall_end,
                             stall_end + entry["write_s"], CHECKPOINT))
      else:
        pending.append((entry, stall_end))
    self._saves = pending
    spans = [self._buffer.popleft() for _ in range(len(self._buffer))]   # thread-safe
    if not spans:
      return
    offset = self._wall0 - self._perf0
    with open(self.path, "a") as f:
      f.writelines(json.dumps({"name": n, "step": s, "start": round(t0 + offset, 6),
                               "end": round(t1 + offset, 6), "track": track}) + "\n"
                   for n, s, t0, t1, track in spans)

  def close(self, final_phase: str | None = None) -> None:
    """Closes the open span, writes everything, stops the writer."""
    if not self.enabled:
      return
    self.phase(final_phase or "done")
    self._open = (None, None, time.perf_counter())
    self._end_iteration()
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    self.flush()


def _rss_bytes() -> int:
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_rank_file(path: str) -> tuple[list[dict], list[dict]]:
  """(meta lines, spans) of one rank's file; a torn last line (a killed process) is skipped."""
  metas, spans = [], []
  with open(path) as f:
    for line in f:
      try:
        obj = json.loads(line)
      except ValueError:
        continue
      (metas.append(obj["meta"]) if "meta" in obj else spans.append(obj))
  return metas, spans


def mesh_coordinates(mesh, process_index: int) -> dict[str, list[int]]:
  """{axis: sorted indices along it} of the devices `process_index` holds in `mesh`."""
  devices = np.asarray(mesh.devices)
  mine = np.argwhere(np.vectorize(lambda d: d.process_index == process_index)(devices))
  return {axis: sorted({int(i) for i in mine[:, k]}) for k, axis in enumerate(mesh.axis_names)}


def start_for_trainer(workdir: str, mesh, hooks, *, enabled: bool = True) -> Timeline:
  """The trainer's timeline: WORKDIR/timeline/rank{R}.jsonl with this rank's mesh coordinates,
  wired into the heartbeat (`hooks.timeline`), and a SIGUSR1 stack dump for hang localisation
  (WORKDIR/resilience/stacks/attempt{A}-rank{R}.txt)."""
  import jax
  from mscale_jax.resilience import hang
  rank, attempt = jax.process_index(), hooks.beat.attempt
  meta = {"mesh_axes": list(mesh.axis_names), "mesh_shape": [int(n) for n in mesh.devices.shape],
          "coords": mesh_coordinates(mesh, rank)}
  timeline = Timeline(os.path.join(workdir, "timeline"), rank, attempt=attempt, meta=meta,
                      enabled=enabled)
  hooks.timeline = timeline if enabled else None
  hang.install_stack_dump(os.path.join(workdir, "resilience", "stacks",
                                       f"attempt{attempt}-rank{rank}.txt"))
  return timeline
