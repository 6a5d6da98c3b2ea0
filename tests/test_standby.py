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


NICE_TARGET = """
import json, os, sys, threading
import jax.numpy as jnp
threading.Thread(target=lambda: None).start()   # a thread the worker itself starts
jnp.ones(4).block_until_ready()                  # and the backend's
nice = []
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/stat") as f:
        nice.append(int(f.read().rsplit(")", 1)[1].split()[16]))
print(json.dumps({"nice": nice, "jax_loaded": "jax" in sys.modules}))
"""


def _run_nice_target(tmp_path, wait_for_preload: bool) -> tuple[dict, str]:
  """Fills a one-standby pool, optionally waits for its imports, orders it to run NICE_TARGET;
  returns what the worker reported and the standby's own log."""
  (tmp_path / "nice_target.py").write_text(NICE_TARGET)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
  pool = StandbyPool([sys.executable, "-m", "nice_target"], 1, env, str(tmp_path))
  try:
    pool.fill()
    standby_log = tmp_path / "standby0.log"
    deadline = time.time() + 120
    while wait_for_preload and "[standby] preloaded" not in standby_log.read_text():
      assert time.time() < deadline and pool.procs[0].poll() is None, standby_log.read_text()
      time.sleep(0.2)
    worker = pool.take()
    log = tmp_path / "worker.log"
    assert pool.order(worker, [], {}, str(log))
    assert worker.wait(timeout=120) == 0, log.read_text()
    return json.loads(log.read_text().strip().splitlines()[-1]), standby_log.read_text()
  finally:
    pool.close()


def test_a_standby_imports_at_low_priority_and_its_worker_runs_at_normal(tmp_path):
  """The imports ran on a thread at nice 19 (its own reading of its priority); the worker the
  standby becomes, and every thread it starts, runs at the priority the standby started at."""
  said, standby_log = _run_nice_target(tmp_path, wait_for_preload=True)
  line = [x for x in standby_log.splitlines() if x.startswith("[standby] preloaded")]
  assert line and " at nice 19 in " in line[0], standby_log
  normal = os.getpriority(os.PRIO_PROCESS, 0)   # what this test runs at (nice under CI)
  assert said["jax_loaded"] and len(said["nice"]) > 2 and set(said["nice"]) == {normal}


def test_orders_before_the_imports_end_run_at_normal_priority(tmp_path):
  """Orders sent at once stop the low-priority imports; the worker still has every library
  and no thread of it is left at nice 19."""
  said, _ = _run_nice_target(tmp_path, wait_for_preload=False)
  normal = os.getpriority(os.PRIO_PROCESS, 0)
  assert said["jax_loaded"] and set(said["nice"]) == {normal}
