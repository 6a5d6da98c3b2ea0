"""Hang localisation (MegaScale §5.2): every live worker says where it is; the odd one is named.

A worker installs `install_stack_dump(path)`: on SIGUSR1, Python's faulthandler writes the
main thread's stack to `path` from C, so it works even while that thread is blocked inside XLA
waiting on a collective (Linux hands a process-directed signal to the main thread first). Only
the signalled thread is dumped: walking the other, running threads' frames from a signal
handler left a worker dead mid-dump in a drill (faulthandler calls it unsafe). When the driver
declares a hang it signals every live worker, reads the dumps, adds each rank's last reported
loop phase and step (its heartbeat) and its mesh coordinates, and `localize()` names the ranks
that are not where the others are. Also handy by hand: `kill -USR1 <pid>` dumps a running
worker's main stack into WORKDIR/resilience/stacks/.
"""
import collections
import dataclasses
import faulthandler
import os
import re
import signal

DUMP_SIGNAL = signal.SIGUSR1
_open_files = []   # faulthandler needs the file kept open


def install_stack_dump(path: str) -> None:
  """On SIGUSR1, append the main thread's Python stack to `path` (this process, from now on)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  f = open(path, "a")
  _open_files.append(f)
  faulthandler.register(DUMP_SIGNAL, file=f, all_threads=False, chain=False)


ENTRY_POINTS = ("<module>", "_run_module_as_main")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def main_thread_frames(dump: str) -> list[tuple[str, int, str]]:
  """(file, line, function) of the main thread's stack in a faulthandler dump, innermost first.

  faulthandler writes 'Stack (most recent call first):', or with all threads 'Current
  thread 0x... (most recent call first):' and 'Thread 0x...' blocks; the main thread is the
  one whose outermost frame is the program's entry point (`<module>` of a script, runpy's
  `_run_module_as_main` under `python -m`). The last dump in the text wins.
  """
  blocks, current = [], None
  for line in dump.splitlines():
    if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent call first)")):
      current = []
      blocks.append(current)
    elif current is not None and (m := _FRAME.search(line)):
      current.append((m["file"], int(m["line"]), m["func"]))
  if not blocks:
    return []
  mains = [b for b in blocks if b and b[-1][2] in ENTRY_POINTS]
  return mains[-1] if mains else blocks[-1]


def where_in_code(frames: list[tuple[str, int, str]], packages=("mscale_jax", "experiments")
                  ) -> str:
  """The innermost frame in our own code, 'module.py:function' (line numbers left out, so two
  ranks in the same function on different lines still count as the same place)."""
  for file, _, func in frames:
    parts = file.replace(os.sep, "/").split("/")
    if any(p in parts for p in packages):
      return f"{parts[-1]}:{func}"
  return f"{os.path.basename(frames[0][0])}:{frames[0][2]}" if frames else "unknown"


# The code location of a live rank that did not answer the stack-dump signal in time.
NO_DUMP = "no stack dump"


@dataclasses.dataclass
class RankReport:
  """Where one rank is: its loop phase and step (heartbeat), its code location (stack dump),
  and its mesh coordinates {axis: [indices]}."""
  rank: int
  phase: str | None
  step: int | None
  code: str
  coords: dict = dataclasses.field(default_factory=dict)

  @property
  def place(self) -> tuple:
    return (self.phase, self.code)


def localize(reports: list[RankReport]) -> dict:
  """Names the ranks that are not where the others are.

  Ranks are grouped by place (loop phase, innermost frame of our code). The largest group is
  where the job is stuck waiting; ranks outside it are the odd ones. On a tie (2 ranks, or
  several equal groups) the odd ones are the ranks that did not answer the stack-dump signal
  while others did (a stopped process, or one stuck in the kernel), else the group(s) behind,
  by step, else those not waiting in 'sync' (a collective waits on them, not the other way
  round).
  Returns {'odd_ranks', 'groups': [{place, ranks, steps, coords}], 'reason'}.
  """
  groups = collections.defaultdict(list)
  for r in reports:
    groups[r.place].append(r)
  ordered = sorted(groups.items(), key=lambda kv: -len(kv[1]))
  described = [{"phase": place[0], "code": place[1], "ranks": [r.rank for r in members],
                "steps": sorted({r.step for r in members if r.step is not None}),
                "coords": {r.rank: r.coords for r in members}} for place, members in ordered]
  if len(ordered) < 2:
    return {"odd_ranks": [], "groups": described,
            "reason": "every rank is at the same place: a collective or the data source"}
  sizes = [len(m) for _, m in ordered]
  if sizes[0] > sizes[1]:
    odd = sorted(r.rank for _, members in ordered[1:] for r in members)
    return {"odd_ranks": odd, "groups": described,
            "reason": f"{sizes[0]} of {len(reports)} ranks are at {ordered[0][0]}; the rest "
                      f"are elsewhere"}
  silent = sorted(r.rank for r in reports if r.code == NO_DUMP)
  if 0 < len(silent) < len(reports):
    return {"odd_ranks": silent, "groups": described,
            "reason": f"no majority place; ranks {silent} did not answer the stack-dump signal "
                      f"while the others did (stopped, or stuck in the kernel)"}
  def lowest_step(members):
    return min((r.step for r in members if r.step is not None), default=float("inf"))
  low = min(lowest_step(m) for _, m in ordered)
  behind = [m for _, m in ordered if lowest_step(m) == low]
  if len(behind) < len(ordered):
    odd = sorted(r.rank for m in behind for r in m)
    return {"odd_ranks": odd, "groups": described,
            "reason": f"no majority place; ranks {odd} are behind (step {low}) the others"}
  waiting = [m for place, m in ordered if place[0] != "sync"]
  if 0 < len(waiting) < len(ordered):
    odd = sorted(r.rank for m in waiting for r in m)
    return {"odd_ranks": odd, "groups": described,
            "reason": f"no majority place; ranks {odd} are not waiting on a step result "
                      f"while the others are"}
  return {"odd_ranks": [], "groups": described,
          "reason": "ranks disagree but no group stands out"}


def format_coords(coords: dict) -> str:
  """'data 1, tensor 0-3' of {axis: [indices]}."""
  parts = []
  for axis, idx in coords.items():
    if not idx:
      continue
    text = str(idx[0]) if len(idx) == 1 else (f"{idx[0]}-{idx[-1]}"
                                              if idx == list(range(idx[0], idx[-1] + 1))
                                              else ",".join(map(str, idx)))
    parts.append(f"{axis} {text}")
  return ", ".join(parts)
