"""Warm standby workers: a standby runs `python -m MODULE ARGV` with the env and log it is given."""
import json
import os
import sys

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
