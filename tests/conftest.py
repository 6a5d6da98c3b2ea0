"""Every test sees 8 simulated CPU devices: enough for any data x fsdp x stage x tensor layout.

Test shapes are tiny, so compilation dominates: XLA:CPU compiles with experiments/job.py's
TEST_XLA (no expensive LLVM passes, the classic fusion emitters; the multi-process jobs' workers
get the same), which cuts compile times by about two thirds and changes no result beyond float
rounding, and each pytest process keeps a fresh persistent compilation cache, so that a program
several tests build (the same tiny trainer, say) compiles once per process. A worker that XLA
aborts is reported with XLA's message and the Python stack (tests/test_crash_report.py).
"""
import atexit
import contextlib
import faulthandler
import os
import shutil
import tempfile

from experiments.job import TEST_XLA

_FLAGS = f"--xla_force_host_platform_device_count=8 {TEST_XLA}"
if _FLAGS not in os.environ.get("XLA_FLAGS", ""):     # xdist's workers inherit the controller's
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAGS}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU runs a device's ready collectives on its intra-op thread pool (NPROC threads where
# set; 8 with 8 devices on a 2-core machine), where each blocks its thread until its peers
# join. When every thread waits on peers queued behind them, nothing moves, and XLA
# aborts the process 60 s later ("Termination timeout ... Exiting to ensure a consistent
# program state"): test_pipeline's programs did so now and then on a loaded 2-core machine
# (executing its selective-recompute variants in a loop there, jax 0.10 and 0.11: 5 aborts in
# 5 tries with 8 threads, within 700 executions; no stalled collective in 24,000 with 32). A
# wider pool avoids it; it is XLA's to fix. Test processes only (and the jobs they start).
os.environ["NPROC"] = "32"
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
if os.environ.get("MSCALE_TEST_CACHE_OF", _WORKER) != _WORKER or \
    "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  # One folder per pytest process, not inherited from xdist's controller (workers write no
  # common files); subprocesses that a test starts inherit it. Removed when the process ends.
  _cache = tempfile.mkdtemp(prefix=f"mscale-jax-test-cache-{_WORKER}-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, MSCALE_TEST_CACHE_OF=_WORKER,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")

import pytest  # noqa: E402

# A worker that dies (XLA aborts the process on a failed CHECK or a fatal log line) takes its
# captured output with it, and xdist reports only "worker 'gw1' crashed". So while a test runs
# in a worker, the process's stderr goes to a file of that worker's, copied back into pytest's
# capture when the test ends; faulthandler writes the Python stack there too. If the worker
# dies, the controller adds the file to the crash report.
if "MSCALE_TEST_CRASH_LOGS" not in os.environ:
  _logs = tempfile.mkdtemp(prefix="mscale-jax-test-crash-")
  atexit.register(shutil.rmtree, _logs, ignore_errors=True)
  os.environ["MSCALE_TEST_CRASH_LOGS"] = _logs


def _crash_log(worker: str) -> str:
  return os.path.join(os.environ["MSCALE_TEST_CRASH_LOGS"], f"{worker}.log")


@pytest.hookimpl(trylast=True)           # after pytest's faulthandler plugin, which it replaces
def pytest_configure(config):
  if _WORKER != "main":
    config._crash_log = open(_crash_log(_WORKER), "w+b", buffering=0)
    faulthandler.enable(config._crash_log, all_threads=True)


@contextlib.contextmanager
def _stderr_to_crash_log(item):
  log = getattr(item.config, "_crash_log", None)
  if log is None or {"capfd", "capfdbinary"} & set(item.fixturenames):   # those read fd 2
    yield
    return
  log.seek(0)
  log.truncate()
  captured = os.dup(2)                   # pytest's capture of this test's stderr
  os.dup2(log.fileno(), 2)
  try:
    yield
  finally:
    os.dup2(captured, 2)
    os.close(captured)
    log.seek(0)
    os.write(2, log.read())


@pytest.hookimpl(wrapper=True, trylast=True)   # inside pytest's capture of the phase
def pytest_runtest_setup(item):
  with _stderr_to_crash_log(item):
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item):
  with _stderr_to_crash_log(item):
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item):
  with _stderr_to_crash_log(item):
    return (yield)


@pytest.hookimpl(optionalhook=True)     # xdist's hook
def pytest_handlecrashitem(crashitem, report):
  """Adds what the dead worker wrote to stderr in its last test (XLA's message, the Python
  stack) to xdist's crash report."""
  with contextlib.suppress(OSError):
    with open(_crash_log(report.node.gateway.id), errors="replace") as f:
      text = f.read()
    if len(text) > 40000:                # XLA's message comes first, the Python stack last
      text = f"{text[:10000]}\n[...]\n{text[-30000:]}"
    report.sections.append((f"stderr of the crashed worker {report.node.gateway.id}", text))


# Test files that take longest in a full run, run first: with two workers taking whole files in
# this order, neither is left alone with a long file at the end. test_slurm mostly waits on
# Slurm; the others in order of CPU-seconds (fast and slow tests, their subprocesses included).
SLOWEST_FIRST = ("test_slurm", "test_pipeline", "test_multiprocess", "test_os_faults_multiprocess",
                 "test_notebooks", "test_hostile_input", "test_sdp4bit_train", "test_tp_comm",
                 "test_flash_attention", "test_collective_matmul", "test_kernel_bench",
                 "test_observability", "test_model", "test_convergence", "test_cli", "test_train",
                 "test_prepared_data", "test_pipeline_eval", "test_sdp4bit", "test_sample",
                 "test_optim", "test_lamb",
                 "test_kernel_wiring", "test_resilience", "test_driver_policy", "test_callbacks",
                 "test_perf_intervals", "test_generate", "test_perf_plan", "test_minder",
                 "test_layer_norm", "test_schedule")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: files stay whole


@pytest.fixture
def program_counts(monkeypatch):
  """Counts this test's compilations (`Lowered.compile`) and the compile cache's
  deserialisations: `counts.compiles`, `counts.loads` (lists, one entry per call)."""
  import types
  import jax
  from mscale_jax import compile_cache
  counts = types.SimpleNamespace(compiles=[], loads=[])
  compile_ = jax.stages.Lowered.compile
  monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: (
      counts.compiles.append(1), compile_(self, *a, **k))[1])
  load = compile_cache.serialize_executable.deserialize_and_load
  monkeypatch.setattr(compile_cache.serialize_executable, "deserialize_and_load",
                      lambda *a, **k: (counts.loads.append(1), load(*a, **k))[1])
  return counts


@pytest.fixture
def tiny_config():
  """A factory for small, fast run configs: `tiny_config(model={...}, mesh={...}, ...)`."""
  from mscale_jax.config import Config

  def make(**sections):
    base = Config(name="test").replace(
        model=dict(num_layers=2, hidden=32, num_heads=4, mlp_dim=64, seq_len=32,
                   attention_window=8),
        mesh=dict(data=2, tensor=4),
        optimizer=dict(warmup_steps=2),
        data=dict(kind="stdlib", prefetch=0),
        train=dict(steps=6, global_batch=4, log_every=2, eval_every=6, eval_batches=1,
                   checkpoint_every=4, async_checkpoint=True))
    return base.replace(**sections)

  return make


@pytest.fixture
def cuda_target():
  """A context in which Pallas kernels lower for CUDA on this CPU-only machine: JAX 0.11 takes
  the GPU's kind (for Triton's compute capability) from the abstract mesh, an H100 here; 0.10
  needs nothing."""
  import contextlib
  import jax
  if jax.__version_info__ < (0, 11):
    return contextlib.nullcontext()
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
  device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
  return use_abstract_mesh(AbstractMesh((1,), ("gpu",), (AxisType.Auto,),
                                        abstract_device=device))
