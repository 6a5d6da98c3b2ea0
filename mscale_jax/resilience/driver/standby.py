"""Warm standby workers: processes that start a restarted group without Python's start-up cost.

A worker's first seconds go to importing JAX, Flax, Optax, Orbax and the trainer. The driver
keeps a pool of standby processes that have paid that already (`StandbyPool`, filled once a
group is training, so the imports never compete with a group's start-up; two groups' worth when
restarted groups self-check, as one that fails a slot exits before it trains): each ran

  python -m mscale_jax.resilience.driver.standby MODULE

imported the libraries without touching a JAX backend (devices and `jax.distributed` are still
to be set up), and waits for one line of JSON on stdin, its orders:

  {"argv": [...], "env": {...}, "log": "path"}

It then sends its output to the log, takes the environment, and runs MODULE as `__main__` with
`argv`, exactly as `python -m MODULE ARGV...` would. A closed stdin without orders ends it.

The imports run at the lowest CPU priority (nice 19, on a thread of their own). A standby is
started while its group trains, and under Linux's autogroup scheduling the CPU a job's session
gets is shared among that session's processes: at normal priority the two standbys' ~2 CPU
seconds each came out of the training workers' share, and the fault drill's steps after every
restart ran slower until they were done. At nice 19 they yield to the workers, so a restart's
first seconds keep their CPU; the imports' CPU still comes out of the session, later
(experiments/standby_cost.py). The worker itself keeps normal priority: orders that come before
the imports are done stop the low-priority thread after its current module and the rest is
imported on the main thread (a restart soon after a restart waits for no nice-19 work), the
thread has ended before orders are run, and NumPy (whose BLAS starts its threads at import, and
they would inherit the thread's priority) is imported first on the main thread.
"""
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

# What every worker imports anyway (experiments.train's own module runs later, as __main__).
PRELOAD = ("jax", "jax.numpy", "numpy", "flax.nnx", "optax", "orbax.checkpoint", "grain",
           "ml_collections", "absl.app", "tqdm", "mscale_jax.train", "mscale_jax.callbacks.worker",
           "mscale_jax.resilience.worker.selfcheck")
LOW_PRIORITY = 19   # nice value of the preload thread


def module_of(command: list[str]) -> str | None:
  """MODULE if `command` is `python -m MODULE ...` (the form a standby can run), else None."""
  if len(command) >= 3 and command[1] == "-m":
    return command[2]
  return None


class StandbyPool:
  """Up to `size` warm standby processes for `command` (`python -m MODULE ...`).

  `take()` hands out one (or None: start the worker cold); `order()` starts it as a worker.
  Each standby leads its own process group, so the driver's group kill reaches what it starts.
  """

  def __init__(self, command: list[str], size: int, env: dict, log_dir: str):
    self.module = module_of(command)
    self.size = size if self.module else 0
    self.env, self.log_dir = env, log_dir
    self.procs: list[subprocess.Popen] = []
    self.spawned = 0

  def fill(self) -> None:
    """Starts standbys until `size` are alive."""
    self.procs = [p for p in self.procs if p.poll() is None]
    while len(self.procs) < self.size:
      path = os.path.join(self.log_dir, f"standby{self.spawned}.log")
      with open(path, "wb") as log_file:
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", __name__, self.module], stdin=subprocess.PIPE,
            stdout=log_file, stderr=subprocess.STDOUT, env=self.env, process_group=0))
      self.spawned += 1

  def take(self) -> subprocess.Popen | None:
    """A live standby, removed from the pool, or None."""
    while self.procs:
      proc = self.procs.pop(0)
      if proc.poll() is None:
        return proc
    return None

  @staticmethod
  def order(proc: subprocess.Popen, argv: list[str], env: dict, log: str) -> bool:
    """Sends `proc` its orders; False if it died before it could take them."""
    try:
      proc.stdin.write((json.dumps({"argv": argv, "env": env, "log": log}) + "\n").encode())
      proc.stdin.close()
      return True
    except OSError:   # BrokenPipeError: it is gone
      return False

  def close(self) -> None:
    """Kills every standby still waiting."""
    kill_process_groups(self.procs)
    self.procs = []


def kill_process_groups(procs: list[subprocess.Popen]) -> None:
  """SIGKILLs the process group each of `procs` leads (what it started dies too); reaps them."""
  for proc in procs:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for proc in procs:
    proc.wait()


def preload(names=PRELOAD) -> tuple[threading.Thread, threading.Event]:
  """Starts importing `names` on a thread at nice `LOW_PRIORITY` (Linux nice is per thread);
  returns (thread, stop): setting `stop` ends the thread after its current module. Prints one
  line when done, saying how many it imported."""
  import numpy   # noqa: F401 (its BLAS threads must start at the main thread's priority)
  stop = threading.Event()

  def load():
    start, cpu = time.time(), time.thread_time()
    me = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, me, LOW_PRIORITY)
    done = 0
    for name in names:
      if stop.is_set():
        break
      importlib.import_module(name)
      done += 1
    nice = os.getpriority(os.PRIO_PROCESS, me)
    print(f"[standby] preloaded {done} of {len(names)} modules at nice {nice} in "
          f"{time.time() - start:.1f} s ({time.thread_time() - cpu:.1f} CPU s)", flush=True)

  thread = threading.Thread(target=load, name="standby-preload", daemon=True)
  thread.start()
  return thread, stop


def main(module: str) -> None:
  import runpy
  loader, stop = preload()
  line = sys.stdin.readline()
  stop.set()      # orders (or none): no more imports at low priority
  loader.join()
  if not line:
    return
  for name in PRELOAD:   # what the thread had not reached, at normal priority
    importlib.import_module(name)
  orders = json.loads(line)
  fd = os.open(orders["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  sys.stdout.flush()
  sys.stderr.flush()
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)
  os.environ.update(orders["env"])
  sys.argv = [module, *orders["argv"]]
  runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main(sys.argv[1])
