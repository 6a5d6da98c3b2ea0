"""Faults of the operating system, injected by the driver from outside the training processes.

The training code takes no part: the injector acts on the workers' process ids, their CPU
affinity, the checkpoint files and the checkpoint directory's permissions, as a failing machine,
a noisy neighbour, bit rot or a full disk would (the kinds and their keys:
resilience/faults.py). A fault fires once the whole group has reached its step (`group_step`),
at most once per job: before acting, the injector writes a marker
into WORKDIR/resilience/faults/ as the worker-side injector does, so the driver reads when the
fault happened, and a restarted group (or a restarted driver) does not fire it again.
"""
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

from mscale_jax.files import checkpoint_steps, verify_manifest, write_json
from mscale_jax.resilience.faults import DRIVER, Fault

OS_KINDS = ("stop", "contend", "corrupt_checkpoint", "io_error", "kill_driver",
            "kill_coordinator")

# A busy loop for `contend`, as a separate program: it shares nothing with the workers but
# the core it is pinned to.
_BUSY = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n  pass\n"


def marker_path(state_dir: str, fault: Fault) -> str:
  """Where the driver records that `fault` fired (so a restarted driver does not fire it again)."""
  return os.path.join(state_dir, "faults", f"{fault.index}-{fault.kind}-driver.json")


def group_step(beats: dict, ranks: int) -> int:
  """The step every rank has reached: the lowest step of the ranks' latest heartbeats (`beats`:
  rank -> (heartbeat, time received)), 0 until all `ranks` have sent one. A rank that runs
  ahead while a peer is stopped does not move it, so a fault due later cannot fire (and be
  undone by the detection of the first) while an earlier failure is still undetected."""
  if len(beats) < ranks:
    return 0
  return min(beat.step for beat, _ in beats.values())


class OsInjector:
  """Fires the driver-injected OS faults of `faults` on the current worker group.

  `state_dir` is WORKDIR/resilience; `say` prints a driver line. Call `poll` from the driver's
  supervision loop and `failure_detected` when the driver has detected a failure or heard of one
  a worker recovered from (a refused save: driver/recovered.py); `close` undoes
  what is still in effect (a busy process, a read-only directory, pinned cores).
  """

  def __init__(self, faults, state_dir: str, say=print):
    self.faults = [f for f in faults if f.injected_by == DRIVER and f.kind in OS_KINDS]
    self.state_dir = state_dir
    self.checkpoints = os.path.join(os.path.dirname(state_dir), "checkpoints")
    self.say = say
    self._undo: list[tuple[float | None, object]] = []   # (when, how), None: at detection

  def poll(self, procs, step: int, now: float | None = None) -> None:
    """Fires every fault due at group step `step`; `procs` are the workers (rank order; none in
    watch mode, where the scheduler started them: nothing to act on)."""
    if not procs:
      return
    now = time.time() if now is None else now
    for when, undo in list(self._undo):
      if when is not None and now >= when:
        self._undo.remove((when, undo))
        undo()
    for fault in self.faults:
      if step >= fault.step and not os.path.exists(marker_path(self.state_dir, fault)):
        if fault.rank is not None and fault.rank >= len(procs):
          # The group shrank below the rank (a slot excluded, no spare left): recorded, not
          # fired, and never an error in the driver.
          self._mark(fault, step, skipped=f"rank {fault.rank} is not in the "
                                          f"{len(procs)}-process group")
          continue
        getattr(self, f"_{fault.kind}")(fault, procs, step)

  def failure_detected(self) -> None:
    """Undoes the faults that last until the failure they cause is detected (io_error)."""
    for when, undo in list(self._undo):
      if when is None:
        self._undo.remove((when, undo))
        undo()

  def close(self) -> None:
    """Undoes every fault still in effect."""
    for _, undo in self._undo:
      undo()
    self._undo = []

  # -- the faults ------------------------------------------------------------------------

  def _mark(self, fault: Fault, step: int, **detail) -> None:
    write_json(marker_path(self.state_dir, fault),
               {"fault": fault.spec, "rank": fault.rank, "step": step, "time": time.time(),
                "by": "driver", **detail})
    self.say(f"[fault] injecting {fault.spec} at step {step}"
             + "".join(f"; {k}: {v}" for k, v in detail.items()))

  def _stop(self, fault, procs, step):
    self._mark(fault, step, pid=procs[fault.rank].pid)
    os.kill(procs[fault.rank].pid, signal.SIGSTOP)

  def _kill_coordinator(self, fault, procs, step):
    self._mark(fault, step, pid=procs[0].pid)
    os.kill(procs[0].pid, signal.SIGKILL)

  def _kill_driver(self, fault, procs, step):
    self._mark(fault, step, pid=os.getpid())
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)

  def _contend(self, fault, procs, step):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(procs):
      self._mark(fault, step, skipped=f"{len(cores)} cores for {len(procs)} workers")
      return
    before = {p.pid: os.sched_getaffinity(p.pid) for p in procs}
    for rank, p in enumerate(procs):
      pin_process(p.pid, {cores[rank]})
    core = cores[fault.rank]
    busy = subprocess.Popen([sys.executable, "-c", _BUSY.format(seconds=fault.seconds)],
                            process_group=0)
    os.sched_setaffinity(busy.pid, {core})
    self._mark(fault, step, core=core, busy_pid=busy.pid)

    def undo():
      busy.kill()
      busy.wait()
      for pid, mask in before.items():
        try:
          pin_process(pid, mask)
        except ProcessLookupError:
          pass
    self._undo.append((time.time() + fault.seconds, undo))

  def _corrupt_checkpoint(self, fault, procs, step):
    newest = newest_verified_checkpoint(self.checkpoints)
    if newest is None:
      return   # not yet: wait for a committed checkpoint with its manifest
    path = flip_bytes(newest)
    self._mark(fault, step, checkpoint=os.path.basename(newest), file=path,
               pid=procs[fault.rank].pid)
    os.kill(procs[fault.rank].pid, signal.SIGKILL)

  def _io_error(self, fault, procs, step):
    os.makedirs(self.checkpoints, exist_ok=True)
    how = make_read_only(self.checkpoints)
    self._mark(fault, step, directory=self.checkpoints, how=how)
    when = time.time() + fault.seconds if fault.seconds else None
    self._undo.append((when, lambda: make_writable(self.checkpoints)))


def pin_process(pid: int, cores: set[int]) -> None:
  """Sets the CPU affinity of every thread of process `pid` (threads keep their own masks)."""
  for task in glob.glob(f"/proc/{pid}/task/*"):
    try:
      os.sched_setaffinity(int(os.path.basename(task)), cores)
    except (ProcessLookupError, OSError):
      pass


def newest_verified_checkpoint(directory: str) -> str | None:
  """The newest step folder under `directory` whose checksum manifest is written and holds."""
  for step in checkpoint_steps(directory):
    path = os.path.join(directory, str(step))
    if verify_manifest(path) is None and os.path.exists(os.path.join(path, "manifest.json")):
      return path
  return None


def flip_bytes(step_dir: str, count: int = 16) -> str:
  """Inverts `count` bytes in the middle of the largest array file of the checkpoint in
  `step_dir` (its train state); returns the file's path relative to `step_dir`."""
  files = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(step_dir, "state"))
           for name in names]
  path = max(files, key=os.path.getsize)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    data = f.read(count)
    f.seek(-len(data), os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in data))
  return os.path.relpath(path, step_dir)


def make_read_only(directory: str) -> str:
  """Makes `directory` refuse new entries, even to root (the immutable attribute); without root,
  takes its write permission away. Returns how."""
  if os.geteuid() == 0 and shutil.which("chattr") and \
      subprocess.run(["chattr", "+i", directory], capture_output=True).returncode == 0:
    return "chattr +i"
  os.chmod(directory, 0o555)
  return "chmod 555"


def make_writable(directory: str) -> None:
  """Undoes `make_read_only`."""
  if os.geteuid() == 0 and shutil.which("chattr"):
    subprocess.run(["chattr", "-i", directory], capture_output=True)
  os.chmod(directory, 0o755)
