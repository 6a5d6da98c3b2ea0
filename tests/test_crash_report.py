"""tests/conftest.py's crash report: when XLA aborts a pytest-xdist worker, the report names the
test and carries XLA's fatal message and the Python stack (pytest's capture used to take them
down with the worker)."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A real XLA abort: device 0 sleeps before a collective-permute, the other 7 wait for it in
# XLA:CPU's rendezvous, which gives up after 1 s (warn) + 1 s (terminate) and exits the process.
STALLED_COLLECTIVE = textwrap.dedent("""
    import os, time
    os.environ["XLA_FLAGS"] += (" --xla_cpu_collective_call_warn_stuck_timeout_seconds=1"
                                " --xla_cpu_collective_call_terminate_timeout_seconds=1")
    import jax, numpy as np

    def _sleep_on_device_0(i):
      if int(i) == 0:
        time.sleep(10)
      return np.int32(0)

    def _step(x):
      i = jax.lax.axis_index("d")
      x = x + jax.experimental.io_callback(_sleep_on_device_0, jax.ShapeDtypeStruct((), "int32"), i)
      return jax.lax.ppermute(x, "d", [(k, (k + 1) % 8) for k in range(8)])

    def test_a_stalled_collective():
      mesh = jax.make_mesh((8,), ("d",))
      x = jax.device_put(np.arange(8, dtype=np.int32), jax.NamedSharding(mesh, jax.P("d")))
      step = jax.jit(jax.shard_map(_step, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d")))
      np.asarray(step(x))
""")


@pytest.mark.slow
def test_a_worker_that_xla_aborts_is_reported_with_xlas_message_and_the_python_stack(tmp_path):
  shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path)
  (tmp_path / "test_stall.py").write_text("import jax.experimental\n" + STALLED_COLLECTIVE)
  env = {k: v for k, v in os.environ.items()          # a fresh session, not this worker's
         if not k.startswith(("PYTEST_", "MSCALE_TEST_", "JAX_COMPILATION_CACHE"))}
  env["PYTHONPATH"] = REPO
  run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider",
                        "-q", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
  out = run.stdout + run.stderr
  assert run.returncode == 1, out
  assert "crashed while running 'test_stall.py::test_a_stalled_collective'" in out, out
  assert "Termination timeout for `collective permute" in out, out       # XLA's, from fd 2
  assert "Fatal Python error: Aborted" in out, out                       # faulthandler's
  assert "in test_a_stalled_collective" in out, out                      # the Python stack


def test_capfd_still_reads_what_a_test_writes_to_fd_2(capfd):
  # In an xdist worker, conftest sends fd 2 to the crash log, except under capfd.
  os.write(2, b"written to fd 2\n")
  assert capfd.readouterr().err == "written to fd 2\n"
