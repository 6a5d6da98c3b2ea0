"""Who is to blame for what the driver sees: the failure it files, and on which rank.

A failure shows itself to the driver in several ways at once, and the rank that shows it first
is often not the one at fault: when one worker dies or stops, its peers' collectives and JAX's
coordination service complain too. The order of evidence, strongest first:

  killed by a signal      the killed rank (an abort over a coordination error: the peer it names)
  reported failure        what a worker said about itself in its last heartbeat (a replica
                          divergence: the rank whose copies differ from the majority's)
  non-zero exit           the exiting rank (status 2: a bad configuration; see supervisor.py)
  fatal log line          the logging rank, or the peer a coordination-service error names
  hang                    the rank the localiser names (observer.localize_hang), not the one
                          that happened to advance least recently

Everything here runs inside the driver's poll, so nothing blocks: a coordination error is
judged once the lines after it (which name the lost peer) had time to arrive, at a later poll.
"""
import os
import re
import signal

from mscale_jax.resilience import events

# Seconds a coordination-service fatal line is left to be followed by the lines naming its peer.
SETTLE_S = 0.3

_TASK = re.compile(r"/task:(\d+)|stopped sending heartbeats\):\s*(\d+)|"
                   r"Task (\d+) heartbeat timeout")


def blamed_task(text: str, rank: int, count: int) -> int:
  """The peer a coordination-service error names (a task that stopped sending heartbeats or
  a '/task:N' it lost), else `rank` itself (`count`: processes in the group)."""
  for match in _TASK.finditer(text):
    task = int(next(g for g in match.groups() if g is not None))
    if task < count and task != rank:
      return task
  return rank


def log_tail(path: str, size: int = 16384) -> str:
  """The last `size` bytes of a log ('' if it cannot be read)."""
  try:
    with open(path, "rb") as f:
      f.seek(max(os.path.getsize(path) - size, 0))
      return f.read().decode(errors="replace")
  except OSError:
    return ""


def killed_by_signal(codes: list, logs: list[str],
                     reported: frozenset = frozenset()) -> events.Failure | None:
  """The failure of the first worker killed by a signal (`codes`: the workers' exit statuses,
  None while running; `logs`: their log files), or None if none was.

  A worker that aborted (SIGABRT) on a coordination-service error lost a peer (one stopped,
  killed or silent): the peer the error names is at fault, as when that line is read before the
  exit (FatalLogs). The abort can reach the driver first, so its finished log is read here;
  and a worker killed by another signal is blamed before one that aborted. An abort of a rank
  in `reported` (it reported a failure of its own, then died on the way out: its peers left
  mid-collective) is not a failure of its own: what it reported decides (`reported()`).
  An abort with no such explanation carries its log's first fatal line, if any.
  """
  killed = [r for r, code in enumerate(codes) if code is not None and code < 0
            and not (code == -signal.SIGABRT and r in reported)]
  for rank in sorted(killed, key=lambda r: codes[r] == -signal.SIGABRT):
    detail = f"killed by signal {-codes[rank]}"
    if codes[rank] == -signal.SIGABRT:
      tail = log_tail(logs[rank])   # the worker has exited: its log is complete
      line = next((l.strip()[:300] for l in tail.splitlines()
                   if events.from_coordination_service(l) and events.fatal_pattern(l)), None)
      if line and (peer := blamed_task(tail, rank, len(codes))) != rank:
        return events.Failure(events.FATAL_LOG, peer, f"{line} (rank {rank} aborted on it)")
      first = next((l.strip()[:300] for l in tail.splitlines() if events.fatal_pattern(l)), None)
      if first:
        detail += f" after: {first}"
    return events.Failure(events.EXITED, rank, detail)
  return None


def reporting_ranks(beats: dict) -> frozenset:
  """The ranks whose latest heartbeat reports a failure (`beats`: {rank: (heartbeat, arrival)})."""
  return frozenset(rank for rank, (beat, _) in beats.items() if beat.failure)


def reported(beats: dict, count: int) -> events.Failure | None:
  """The first failure a worker reported about itself (`beats`: {rank: (heartbeat, arrival)};
  `count`: ranks in the group). An error of the coordination service that names a peer it lost
  (e.g. a checkpoint barrier failing on 'Task 1 heartbeat timeout' after rank 1 was stopped) is
  that peer's, filed as the fatal line would be."""
  for rank, (beat, _) in sorted(beats.items()):
    if beat.failure:
      f = beat.failure
      peer = (blamed_task(f["detail"], rank, count)
              if events.from_coordination_service(f["detail"]) else rank)
      if peer != rank:
        return events.Failure(events.FATAL_LOG, peer, f"{f['detail'][:300]} (rank {rank} "
                              f"reported it)", step=f.get("step"))
      if f["kind"] == events.REPLICA_DIVERGENCE and f.get("rank") in range(count):
        rank = f["rank"]   # the rank whose replicas differ from the majority's
      return events.Failure(f["kind"], rank, f["detail"], step=f.get("step"))
  return None


def exited(codes: list) -> events.Failure | None:
  """The first worker that exited non-zero, filed by its status (non-finite stop, failed
  self-check, anything else)."""
  for rank, code in enumerate(codes):
    if code not in (None, 0):
      kind = {events.EXIT_NONFINITE: events.NONFINITE,
              events.EXIT_SELF_CHECK_FAILED: events.SELF_CHECK_FAILED}.get(code, events.EXITED)
      return events.Failure(kind, rank, f"exit status {code}")
  return None


class FatalLogs:
  """Reads the group's worker logs (`logs`: one path per rank, appended as they start) a poll
  at a time for known fatal lines (events.FATAL_LOG_PATTERNS), without ever waiting.

  A plain fatal line fails its own rank at once. A coordination-service one is held for
  `settle_s` (or until its rank exits) so that the tail after it, which names the lost peer, is
  in the log: the failure is then filed on that peer.
  """

  def __init__(self, logs: list[str], settle_s: float = SETTLE_S):
    self.logs, self.settle_s = logs, settle_s
    self._offsets: dict[int, int] = {}
    self._held: dict[int, tuple[str, float]] = {}   # rank: (coordination line, first seen)

  def poll(self, codes: list, now: float) -> events.Failure | None:
    """The fatal-log failure due now, if any (`codes`: exit statuses, None while running)."""
    for rank, path in enumerate(self.logs):
      if codes[rank] == 0:   # what a finished worker printed while its peers shut down
        continue
      if rank not in self._held:
        line = self._new_fatal_line(rank, path)
        if line is None:
          continue
        if not events.from_coordination_service(line):
          return events.Failure(events.FATAL_LOG, rank, line)
        self._held[rank] = (line, now)
      line, seen = self._held[rank]
      if now - seen >= self.settle_s or codes[rank] is not None:
        del self._held[rank]
        return events.Failure(events.FATAL_LOG,
                              blamed_task(log_tail(path), rank, len(codes)), line)
    return None

  def _new_fatal_line(self, rank: int, path: str) -> str | None:
    try:
      with open(path, "rb") as f:
        f.seek(self._offsets.get(rank, 0))
        chunk = f.read()
    except OSError:
      return None
    end = chunk.rfind(b"\n") + 1   # whole lines only
    self._offsets[rank] = self._offsets.get(rank, 0) + end
    for line in chunk[:end].decode(errors="replace").splitlines():
      if events.fatal_pattern(line):
        return line.strip()[:300]
    return None


def localised_hang(failure: events.Failure, found: dict | None) -> None:
  """Files a declared hang on the rank the localiser names (`found`: observer.localize_hang's
  result), rather than on the rank that advanced least recently (in a collective every rank
  waits: who reported last is chance). Changes `failure` in place."""
  odd = (found or {}).get("odd_ranks") or []
  if odd and failure.rank not in odd:
    failure.detail += f" (first seen on rank {failure.rank}; localised to rank(s) {odd})"
    failure.rank = odd[0]
