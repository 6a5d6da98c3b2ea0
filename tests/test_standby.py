"""Warm standby workers: a standby runs `python -m MODULE ARGV` with the env and log it is given."""
import json
import os
import sys
import time

from mscale_jax.resilience.driver.standby import StandbyPool, module_of

TARGET = '''
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "rank": os.environ["MSCALE_PROCESS_ID"],
                  "name": __name__, "jax_loaded": "jax" in sys.modules}))
'''


def test_module_of_only_serves_python_dash_m():
  assert module_of([sys.executable, "-m", "experiments.train", "--x=1"]) == "experiments.train"
  assert module_of([sys.executable, "train.py"]) is None


def test_a_standby_runs_its_orders_and_an_idle_one_is_killed(tmp_path):
  (tmp_path / "target_module.py").write_text(TARGET)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
  pool = StandbyPool([sys.executable, "-m", "target_module"], 2, env, str(tmp_path))
  try:
    pool.fill()
    assert len(pool.procs) == 2
    worker = pool.take()
    log = tmp_path / "worker.log"
    assert pool.order(worker, ["--a=1", "b"], {"MSCALE_PROCESS_ID": "7"}, str(log))
    assert worker.wait(timeout=120) == 0
    said = json.loads(log.read_text().strip().splitlines()[-1])
    # Run as `python -m target_module --a=1 b` would be, after the libraries were imported.
    assert said == {"argv": ["--a=1", "b"], "rank": "7", "name": "__main__", "jax_loaded": True}
    pool.fill()   # back to two waiting
    assert len(pool.procs) == 2
    idle = list(pool.procs)
  finally:
    pool.close()
  assert all(p.poll() is not None for p in idle) and pool.procs == []


def test_a_dead_standby_takes_no_orders(tmp_path):
  pool = StandbyPool([sys.executable, "-m", "no_such_module_here"], 1, dict(os.environ),
                     str(tmp_path))
  pool.fill()
  proc = pool.take()
  proc.kill()
  proc.wait()
  assert not pool.order(proc, [], {}, str(tmp_path / "log"))
  assert pool.take() is None


def _nice_of_threads(pid: int) -> list[int]:
  """The nice value of each live thread of `pid` (field 19 of /proc/PID/task/TID/stat)."""
  values = []
  for tid in os.listdir(f"/proc/{pid}/task"):
    try:
      with open(f"/proc/{pid}/task/{tid}/stat") as f:
        values.append(int(f.read().rsplit(")", 1)[1].split()[16]))
    except FileNotFoundError:   # the thread ended meanwhile
      pass
  return values


def test_a_standby_imports_at_low_priority_and_its_worker_runs_at_normal(tmp_path):
  """The imports ran on a thread at nice 19 (its own reading of its priority); once they are
  done no thread of the process is left below the priority it started at, so the worker it becomes (and
  every thread that worker starts) competes as a cold-started one would."""
  (tmp_path / "target_module.py").write_text(TARGET)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
  pool = StandbyPool([sys.executable, "-m", "target_module"], 1, env, str(tmp_path))
  try:
    pool.fill()
    (proc,) = pool.procs
    log = tmp_path / "standby0.log"
    deadline = time.time() + 120
    while "[standby] preloaded" not in log.read_text() and time.time() < deadline:
      assert proc.poll() is None, log.read_text()
      time.sleep(0.2)
    line = [x for x in log.read_text().splitlines() if x.startswith("[standby] preloaded")]
    assert line and " at nice 19 in " in line[0], log.read_text()
    time.sleep(0.5)   # the thread returns right after its line
    normal = os.getpriority(os.PRIO_PROCESS, 0)   # what this test runs at (nice under CI)
    assert _nice_of_threads(proc.pid) and set(_nice_of_threads(proc.pid)) == {normal}
  finally:
    pool.close()
