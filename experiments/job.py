"""Running `experiments.launch` as a child job: the one way drills and tests drive the launcher.

  from experiments import job
  result = job.run("runs/x", ["--num_processes=2", "--fault=kill:rank=1:step=6"],
                   ["--config.train.steps=12"], timeout_s=300)
  result.status, result.output, result.report["failures"]

`run` starts the launcher in a session and process group of its own, with a hard timeout. Its
output goes to WORKDIR/launcher.log (and, with `echo`, to this process's stdout as it comes).
When the launcher has exited, or the timeout has passed, every process still left in its
session (the driver's workers and warm standbys lead process groups of their own inside it) is
killed; `Result.leftovers` names the ones that were still alive after a launcher that exited by
itself: a launcher that exits cleanly leaves none.
"""
import dataclasses
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A GPT of the main job's shape, small enough for a multi-process run on a few CPU cores (the
# multi-process tests and the observability drill).
TINY_GPT = ["--config=experiments/configs/gpt_tiny.py", "--config.model.hidden=32",
            "--config.model.mlp_dim=64", "--config.model.seq_len=32",
            "--config.train.global_batch=8", "--config.data.prefetch=0"]
# XLA flags that halve compile times of tiny programs without changing their results beyond
# float rounding (the drills' and experiments' tiny workers).
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# What the tests compile with, in-process (tests/conftest.py) and in the jobs they launch:
# FAST_XLA and XLA:CPU's classic fusion emitters instead of its MLIR ones, which cuts the
# rest by about a third. The latter only on the jaxlib it was measured on: XLA aborts the
# process on a flag in XLA_FLAGS it does not know.
def _jaxlib_version() -> str:
  try:
    return importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:     # e.g. a jaxlib built from source
    return ""


TEST_XLA = FAST_XLA + (" --xla_cpu_use_fusion_emitters=false"
                       if _jaxlib_version().startswith("0.10.") else "")


@dataclasses.dataclass
class Result:
  """What a launcher run left: its folder, exit status and output."""
  workdir: str
  status: int | None           # the launcher's exit status; None if it was killed at the timeout
  log: str                     # WORKDIR/launcher.log: its stdout and stderr
  output: str
  wall_s: float
  leftovers: list[int]         # processes of its session alive after it exited (now killed)
  session: int = 0             # its session id (end_session ends what keep_orphans kept)

  @property
  def timed_out(self) -> bool:
    return self.status is None

  @property
  def report(self) -> dict:
    """The driver's report, WORKDIR/resilience/report.json."""
    with open(os.path.join(self.workdir, "resilience", "report.json")) as f:
      return json.load(f)

  def tail(self, chars: int = 3000) -> str:
    return self.output[-chars:]


def command(workdir: str, launcher_flags, train_flags) -> list[str]:
  """The launcher's command line: its flags, then `--` and experiments.train's."""
  return [sys.executable, "-m", "experiments.launch", f"--workdir={os.path.abspath(workdir)}",
          *launcher_flags, "--", *train_flags]


def run(workdir: str, launcher_flags=(), train_flags=(), *, timeout_s: float,
        echo: bool = False, env: dict | None = None, keep_orphans: bool = False) -> Result:
  """Runs the launcher to its end (or `timeout_s`); kills what it leaves behind, except with
  `keep_orphans` after a launcher killed by a signal (the kill_driver fault: running the
  launcher again must end them; `Result.leftovers` lists them, `end_session` ends them)."""
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  log_path = os.path.join(workdir, "launcher.log")
  argv = command(workdir, launcher_flags, train_flags)
  if echo:
    print("[job] " + " ".join(argv[1:]), flush=True)
  environment = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
  start = time.time()
  proc = subprocess.Popen(argv, cwd=REPO, env=environment, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lines: list[str] = []
  reader = threading.Thread(target=_copy, args=(proc.stdout, log_path, lines, echo), daemon=True)
  reader.start()
  status, leftovers = None, []
  try:
    status = proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    pass
  finally:
    if status is not None:
      leftovers = [pid for pid in session_processes(proc.pid) if pid != proc.pid]
    if keep_orphans and status is not None and status < 0:
      proc.wait()
    else:
      _kill_session(proc)
    reader.join(timeout=10)
  return Result(workdir, status, log_path, "".join(lines), time.time() - start, leftovers,
                proc.pid)


def _copy(stream, path: str, lines: list[str], echo: bool) -> None:
  with open(path, "a") as log:   # a launch run again in its workdir (a resume) adds to it
    for line in stream:
      lines.append(line)
      log.write(line)
      log.flush()
      if echo:
        sys.stdout.write(line)
        sys.stdout.flush()


def end_session(sid: int) -> None:
  """SIGKILLs every process left in session `sid` (a launcher's, kept with keep_orphans)."""
  for _ in range(50):
    alive = session_processes(sid)
    if not alive:
      return
    for pid in alive:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    time.sleep(0.05)


def _kill_session(proc: subprocess.Popen) -> None:
  """SIGKILLs the launcher's process group, then whatever is left in its session (scanned
  again until nothing is: a process may have started another meanwhile); reaps the launcher."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  end_session(proc.pid)
  proc.wait()


def session_processes(sid: int) -> list[int]:
  """Live (not zombie) processes whose session is `sid`."""
  pids = []
  for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if int(fields[3]) == sid and fields[0] != "Z":   # fields[3]: the session id
      pids.append(int(entry))
  return pids
