"""Per-rank timeline: the spans of each process's training loop, on disk (MegaScale §5).

A `Timeline` is the sink of the loop's `PhaseMachine` (phases.py, which names the phases): the
hot path is one deque append per closed span; a background thread writes the buffer every few
seconds to WORKDIR/timeline/rank{R}.jsonl (one JSON object per line, a `meta` line first per
process start). Background checkpoint writes are spans on a second track of the same rank
('checkpoint'). `trace.py` merges the ranks' files into one Chrome trace.

Timestamps are this host's wall clock (`time.time()`, read once at start; spans are
perf_counter offsets from it); the driver measures each worker's clock offset from its
heartbeats and the merge applies it.
"""
import collections
import json
import os
import socket
import threading
import time

import numpy as np

from mscale_jax.observability.phases import CHECKPOINT, LOOP, LOOP_PHASES, WAIT_PHASES


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
    self._saves: list[tuple[dict, float]] = []        # (checkpointer save entry, stall end)
    self._stop = threading.Event()
    self._thread = None
    # The hot path: records a closed span (name, step, start, end, track), perf seconds.
    self.append = self._buffer.append if enabled else (lambda span: None)
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

  def checkpoint_saved(self, entry: dict) -> None:
    """A save's stall just ended; `entry` (Checkpointer.saves[-1]) gets its `write_s` from
    orbax's callback later, and the writer thread then records the background write span."""
    if self.enabled:
      self._saves.append((entry, time.perf_counter()))

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

  def close(self) -> None:
    """Writes everything and stops the writer."""
    if not self.enabled:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    self.flush()


def read_rank_file(path: str) -> tuple[list[dict], list[dict]]:
  """(meta lines, spans) of one rank's file; a torn last line (a killed process) is skipped.

  Each process of a (re)start begins with a meta line; every span gets `segment`, the number of
  meta lines before it, so that a step replayed after a restart can be told from its first run.
  """
  metas, spans = [], []
  with open(path) as f:
    for line in f:
      try:
        obj = json.loads(line)
      except ValueError:
        continue
      if "meta" in obj:
        metas.append(obj["meta"])
      else:
        spans.append({**obj, "segment": len(metas)})
  return metas, spans


def per_iteration(spans: list[dict]) -> dict[int, dict[str, float]]:
  """{step: {phase: seconds}} of one rank's loop spans; a step replayed after a restart counts
  once, as its last run (the spans of the latest `segment` that ran it)."""
  out, segment_of = collections.defaultdict(dict), {}
  for s in spans:
    if s["track"] == LOOP and s["step"] is not None and s["name"] in LOOP_PHASES:
      segment = s.get("segment", 0)
      if segment > segment_of.setdefault(s["step"], segment):
        out[s["step"]], segment_of[s["step"]] = {}, segment   # a replay: its earlier run goes
      phases = out[s["step"]]
      phases[s["name"]] = phases.get(s["name"], 0.0) + s["end"] - s["start"]
  return dict(out)


def own_time(phases: dict[str, float]) -> float:
  """Seconds of an iteration this rank spent on its own work (not waiting for devices/peers),
  without the occasional log/eval/checkpoint (they would stripe every rank alike)."""
  return sum(v for k, v in phases.items()
             if k not in WAIT_PHASES + ("log", "eval", "checkpoint_stall"))


def mesh_coordinates(mesh, process_index: int) -> dict[str, list[int]]:
  """{axis: sorted indices along it} of the devices `process_index` holds in `mesh`."""
  devices = np.asarray(mesh.devices)
  mine = np.argwhere(np.vectorize(lambda d: d.process_index == process_index)(devices))
  return {axis: sorted({int(i) for i in mine[:, k]}) for k, axis in enumerate(mesh.axis_names)}
