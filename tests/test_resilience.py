"""Resilience pieces in one process: fault specs, heartbeats over HTTP, self-check verdicts,
the trainer's non-finite policies and metrics de-duplication, launcher input errors."""
import glob
import json
import os
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from mscale_jax.errors import ConfigError
from mscale_jax.resilience import events
from mscale_jax.resilience.worker import selfcheck
from mscale_jax.resilience.faults import parse_fault, parse_faults
from mscale_jax.resilience.driver.server import HeartbeatServer
from mscale_jax.resilience.worker.heartbeat import HeartbeatClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- fault specs, fatal lines, self-check verdicts ---------------------------------------------

def test_fault_specs_parse_with_defaults():
  assert parse_fault("kill:rank=1:step=37").spec == "kill:rank=1:step=37:at=step"
  assert parse_fault("kill:step=8:at=save").rank == 0
  slow = parse_fault("slow:rank=1:factor=2")
  assert (slow.factor, slow.step) == (2.0, 1)
  assert [f.index for f in parse_faults(["nan:step=6", "bad_slot:slot=1"])] == [0, 1]


@pytest.mark.parametrize("spec,why", [
    ("explode:step=3", "a kind among"), ("kill:rank=1", "needs step"),
    ("hang:rank=0:step=5:when=now", "keys of 'hang'"), ("slow:rank=0:factor=0.5", "factor > 1"),
    ("kill:step=3:at=eval", "at=step or at=save"), ("nan:step=x", "integer"),
    ("exception:rank=-1:step=2", "rank >= 0"),
])
def test_bad_fault_specs_name_what_is_valid(spec, why):
  with pytest.raises(ConfigError, match=why):
    parse_fault(spec)


def test_fatal_log_patterns():
  assert events.fatal_pattern("F1123 Check failed: status.ok()")
  assert events.fatal_pattern("Fatal Python error: Segmentation fault")
  assert events.fatal_pattern("[gloo] Connection closed by peer")
  assert events.fatal_pattern("step 10 loss 3.2") is None


def _probe(rank, rate, wrong=(), ok=True):
  return {"rank": rank, "matmul_gflops": rate, "allgather": {"wrong_ranks": list(wrong)},
          "write": {"ok": ok}}


def test_self_check_verdicts_name_the_bad_slot():
  healthy = selfcheck.judge({0: _probe(0, 50), 1: _probe(1, 48), 2: _probe(2, 52)})
  assert healthy == {0: None, 1: None, 2: None}
  verdict = selfcheck.judge({0: _probe(0, 50, wrong=[2]), 1: _probe(1, 48, wrong=[2]),
                             3: _probe(2, 52, wrong=[2])})   # slot 3 runs as rank 2
  assert [s for s, why in verdict.items() if why] == [3] and "corrupt" in verdict[3]
  slow = selfcheck.judge({0: _probe(0, 50), 1: _probe(1, 10), 2: _probe(2, 52)})
  assert "matmul rate" in slow[1] and not slow[0]
  assert "write" in selfcheck.judge({0: _probe(0, 50, ok=False), 1: _probe(1, 50)})[0]
  assert "no self-check result" in selfcheck.judge({0: _probe(0, 50), 1: None})[1]


@pytest.mark.parametrize("corrupt", [False, True])
def test_the_group_self_check_runs_every_probe_and_agrees_on_a_verdict(tmp_path, corrupt):
  # One process here: its all-gather of results and its verdict are the group's.
  verdict, results = selfcheck.run_in_group(str(tmp_path / "out"), str(tmp_path / "ckpt"),
                                            slot=3, corrupt=corrupt)
  assert list(results) == [3] and results[3]["matmul_gflops"] > 0
  assert results[3]["write"]["ok"] and results[3]["allgather"]["gbytes_per_s"] > 0
  assert results[3]["allgather"]["wrong_ranks"] == ([0] if corrupt else [])
  assert (verdict[3] is not None and "corrupt" in verdict[3]) if corrupt else verdict == {3: None}
  written = json.loads((tmp_path / "out" / "verdict.json").read_text())
  assert written["excluded"] == ({"3": verdict[3]} if corrupt else {})
  assert json.loads((tmp_path / "out" / "slot3.json").read_text()) == results[3]


def test_a_restarted_groups_self_check_loads_its_collectives_from_the_compile_cache(
    tmp_path, monkeypatch, program_counts):
  """JAX's cache serves process 0 only: every other process compiled the probes' all-gathers
  at every restart. Each group here plays a new process (its in-memory programs dropped)."""
  import jax
  from mscale_jax import compile_cache
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
  compiles, loads = program_counts.compiles, program_counts.loads
  block = np.random.default_rng(3).normal(size=(5, 7)).astype(np.float32)
  try:
    for group, corrupt in enumerate([False, True]):
      monkeypatch.setattr(compile_cache, "_LIVE", {})
      monkeypatch.setattr(selfcheck, "_GATHERS", {})
      compiles.clear(), loads.clear()
      verdict, results = selfcheck.run_in_group(str(tmp_path / f"out{group}"),
                                                str(tmp_path / "ckpt"), slot=0, corrupt=corrupt)
      # Three all-gathers (barriers and results, the 1024-float block, the bandwidth block):
      # compiled by the first group, loaded by the restarted one.
      assert (len(compiles), len(loads)) == ((3, 0) if group == 0 else (0, 3))
      assert results[0]["allgather"]["wrong_ranks"] == ([0] if corrupt else [])
      assert (verdict[0] is not None) == corrupt
      np.testing.assert_array_equal(selfcheck.process_allgather(block), block[None])
  finally:
    jax.config.update("jax_compilation_cache_dir", previous)


def test_a_process_waits_for_the_coordinator_to_open_and_names_one_that_never_does():
  import threading
  from mscale_jax.resilience.worker.distributed import wait_for_coordinator
  probe = socket.socket()
  probe.bind(("127.0.0.1", 0))
  port = probe.getsockname()[1]
  probe.close()                           # nothing listens there yet
  with pytest.raises(ConfigError, match="coordinator"):
    wait_for_coordinator(f"127.0.0.1:{port}", timeout_s=0.3)
  listener, accepted = socket.socket(), []

  def open_late():
    time.sleep(0.3)                       # the coordinator opens while the other one polls
    listener.bind(("127.0.0.1", port))
    listener.listen()
    listener.settimeout(10)
    accepted.append(listener.accept()[0])

  opener = threading.Thread(target=open_late)
  opener.start()
  try:
    wait_for_coordinator(f"127.0.0.1:{port}", timeout_s=10)
    opener.join()
    assert accepted                       # it returned because a connection went through
  finally:
    for s in accepted + [listener]:
      s.close()


# -- heartbeats over HTTP ----------------------------------------------------------------------

def test_a_steps_age_counts_from_the_last_phase_change_when_that_came_later():
  """The driver counts a step from (receipt - step_age_s): a save's phase whose own beat was
  lost must not make the step after it look old (an instant hang)."""
  server = HeartbeatServer()
  try:
    hooks = HeartbeatClient(rank=0, heartbeat_url=server.url, interval_s=60)
    hooks.phase(events.TRAINING)
    hooks.progress(3, 2.5, 0.9, 0.01)
    time.sleep(0.3)                         # the step's save (its beat never sent)
    hooks.phase(events.CHECKPOINTING)
    hooks.phase(events.TRAINING)
    hooks.post()
    beat, _ = server.latest()[0]
    assert beat.step == 3 and 0 <= beat.step_age_s < 0.25
  finally:
    server.close()


def test_heartbeats_reach_the_server_and_carry_the_failure():
  server = HeartbeatServer()
  try:
    hooks = HeartbeatClient(rank=1, heartbeat_url=server.url, interval_s=60, attempt=2, slot=3)
    hooks.phase(events.TRAINING)
    hooks.progress(7, 2.5, 0.9, 0.01)
    hooks.post()
    beat, _ = server.latest()[1]
    assert (beat.rank, beat.attempt, beat.slot, beat.phase, beat.step, beat.loss) == \
        (1, 2, 3, events.TRAINING, 7, 2.5)
    time.sleep(0.2)
    hooks.post()   # a later heartbeat, no new step: how long ago step 7 was checked
    beat, _ = server.latest()[1]
    assert beat.step == 7 and beat.step_age_s >= 0.2
    assert beat.pid == os.getpid() and beat.host == socket.gethostname()
    hooks.failure(events.EXCEPTION, "RuntimeError: boom", step=8)
    beat, _ = server.latest()[1]
    assert beat.phase == events.FAILED and beat.failure["kind"] == events.EXCEPTION
    assert beat.failure["detail"] == "RuntimeError: boom" and beat.failure["step"] == 8
    import urllib.request
    status = json.loads(urllib.request.urlopen(server.url.replace("heartbeat", "status")).read())
    assert status["1"]["step"] == 7 and "received" in status["1"]
  finally:
    server.close()


def test_a_failure_report_is_sent_again_when_the_driver_did_not_answer(monkeypatch):
  """A loaded driver may not answer a post in time; a periodic beat is then simply lost, but the
  failure report (the worker exits next) is sent again until it arrives."""
  import http.server
  import threading
  from mscale_jax.resilience.worker import heartbeat
  monkeypatch.setattr(heartbeat, "FAILURE_TIMEOUT_S", 0.5)
  bodies = []

  class DropFirst(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
      body = self.rfile.read(int(self.headers["Content-Length"]))
      bodies.append(json.loads(body))
      if len(bodies) <= 2:   # hang up without an answer, as a starved server times out
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)
        return
      self.send_response(204)
      self.end_headers()

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DropFirst)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    url = f"http://127.0.0.1:{server.server_address[1]}/heartbeat"
    client = HeartbeatClient(rank=0, heartbeat_url=url, interval_s=60)
    assert not client.post()   # dropped: a plain beat is not sent again
    client.failure(events.EXCEPTION, "RuntimeError: boom", step=3)   # dropped, then answered
    assert [b["failure"] and b["failure"]["detail"] for b in bodies] == \
        [None, "RuntimeError: boom", "RuntimeError: boom"]
  finally:
    server.shutdown()
    server.server_close()


# -- the trainer's non-finite policies (in-process, fault-injected NaN) ---------------------------

def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _tensorboard_steps(workdir, tag="loss"):
  """(tag, step)s TensorBoard shows: a SessionLog START at step s purges earlier steps >= s."""
  from tensorboardX.proto import event_pb2
  shown = []
  for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.*"))):
    data = open(path, "rb").read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      if event.HasField("session_log") and event.session_log.status == 1:
        shown = [s for s in shown if s < event.step]
      elif event.HasField("summary") and any(v.tag == tag for v in event.summary.value):
        shown.append(event.step)
  return shown


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """The policy tests compile the same step several times: let JAX's disk cache serve them."""
  import jax
  saved = (jax.config.jax_compilation_cache_dir,
           jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  yield
  from jax._src import compilation_cache
  compilation_cache.reset_cache()   # later modules compile as they did before
  jax.config.update("jax_compilation_cache_dir", saved[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def _train(config, workdir, faults=()):
  from mscale_jax.callbacks.worker import FaultInjection
  from mscale_jax.train import Trainer
  return Trainer(config, str(workdir), callbacks=[FaultInjection(parse_faults(faults))],
                 show_progress=False)


def _policy_config(tiny_config, policy):
  return tiny_config(train=dict(steps=8, global_batch=4, log_every=2, eval_every=8,
                                checkpoint_every=4, on_nonfinite=policy))


@pytest.mark.slow   # a whole trainer run or two: the full suite, not the fast tier
def test_nonfinite_stop_then_resume_logs_each_step_once(tiny_config, tmp_path):
  from mscale_jax.errors import NonFiniteError
  config = _policy_config(tiny_config, "stop")
  trainer = _train(config, tmp_path, ["nan:step=7"])
  with pytest.raises(NonFiniteError, match="step 7"):   # found one step late, at step 8
    trainer.train()
  assert trainer.checkpointer.latest_step() == 4        # no checkpoint after the bad step
  assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 4, 6]
  # The restarted run (the fault fired once) replays steps 5..8 from the step-4 checkpoint
  # and logs its first step (5) and every second one: step 6 appears once.
  summary = _train(config, tmp_path, ["nan:step=7"]).train()
  records = _metrics(tmp_path)
  assert [r["step"] for r in records] == [1, 2, 4, 5, 6, 8]
  assert all(np.isfinite(r["loss"]) for r in records) and summary["nonfinite_steps"] == []
  assert sorted(_tensorboard_steps(tmp_path)) == [1, 2, 4, 5, 6, 8]
  assert summary["restore_s"] > 0 and summary["start_step"] == 4
  saves = summary["checkpoint_saves"]
  assert [s["step"] for s in saves] == [8] and saves[0]["stall_s"] > 0
  assert saves[0]["write_s"] is not None and saves[0]["write_s"] >= 0


@pytest.mark.slow   # one of the fast tier's heaviest (a trainer run or a full search)
def test_nonfinite_skip_step_applies_no_update(tiny_config, tmp_path):
  config = _policy_config(tiny_config, "skip_step")
  trainer = _train(config, tmp_path, ["nan:step=6"])
  summary = trainer.train()
  assert summary["nonfinite_steps"] == [6] and summary["rollbacks"] == 0
  records = {r["step"]: r for r in _metrics(tmp_path)}
  assert np.isnan(records[6]["loss"]) and np.isfinite(records[8]["loss"])
  import jax
  leaves = jax.tree.leaves(jax.device_get(trainer.final_state))
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
  assert int(trainer.final_state["step"]) == 8


@pytest.mark.slow   # one of the fast tier's heaviest (a trainer run or a fleet replay)
def test_nonfinite_rollback_restores_and_skips_the_batch(tiny_config, tmp_path):
  from mscale_jax.checkpoint import Checkpointer
  config = _policy_config(tiny_config, "rollback")
  summary = _train(config, tmp_path, ["nan:step=5"]).train()
  assert summary["nonfinite_steps"] == [5] and summary["rollbacks"] == 1
  assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 4, 6, 8]
  assert sorted(_tensorboard_steps(tmp_path)) == [1, 2, 4, 6, 8]
  # Steps 5..8 ran on batches 5..8: the poisoned batch 4 (0-based) was skipped.
  data_state = Checkpointer(str(tmp_path / "checkpoints")).restore_data_state(8)
  assert data_state["step"] == 9


# -- launcher and worker input errors ------------------------------------------------------------

def _run(module, *args, env=None, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **(env or {}))
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _one_error_line(result, text):
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and text in lines[0], result.stderr[-2000:]
  assert "Traceback" not in result.stderr


def test_launcher_bad_input_is_one_line_and_exit_2(tmp_path):
  busy = socket.socket()
  busy.bind(("127.0.0.1", 0))
  busy.listen()
  port = busy.getsockname()[1]
  cases = [
      (["--fault=explode:step=3"], "--fault='explode:step=3'"),
      (["--num_processes=16", "--devices_per_process=1", "--", "--config.mesh.data=2",
        "--config.mesh.tensor=4", "--config.mesh.shrink_to_fit=False"],
       "--num_processes=16 is invalid: 16 processes x 1 devices do not suit the configured mesh"),
      ([f"--coordinator_port={port}"], f"--coordinator_port='127.0.0.1:{port}'"),
      (["--coordinator_host=192.0.2.1"], "--coordinator_host='192.0.2.1'"),
      (["--fault=kill:rank=2:step=3"], "a rank below 2"),
  ]
  try:
    for i, (args, text) in enumerate(cases):
      workdir = tmp_path / f"run{i}"
      _one_error_line(_run("experiments.launch", f"--workdir={workdir}", *args), text)
      assert not workdir.exists()
  finally:
    busy.close()


def test_worker_with_an_unreachable_coordinator_is_one_line_and_exit_2(tmp_path):
  port = socket.socket()
  port.bind(("127.0.0.1", 0))
  address = f"127.0.0.1:{port.getsockname()[1]}"   # bound, never listening: refused
  try:
    result = _run("experiments.train", f"--workdir={tmp_path / 'run'}",
                  env={"MSCALE_COORDINATOR": address, "MSCALE_NUM_PROCESSES": "2",
                       "MSCALE_PROCESS_ID": "1", "MSCALE_COORDINATOR_TIMEOUT_S": "1"})
  finally:
    port.close()
  _one_error_line(result, f"coordinator='{address}'")
  assert not (tmp_path / "run").exists()


def test_faults_fire_once_on_their_rank_and_slow_ranks_sleep(tmp_path):
  import time
  from mscale_jax.resilience.worker.faults import FaultInjector
  faults = parse_faults(["nan:step=3", "exception:rank=1:step=2", "slow:rank=1:factor=3:step=4"])
  rank0 = FaultInjector(faults, 0, str(tmp_path))
  rank1 = FaultInjector(faults, 1, str(tmp_path))
  rank0.before_step(2)                       # the exception is rank 1's
  with pytest.raises(RuntimeError, match="injected fault exception"):
    rank1.before_step(2)
  rank1.before_step(2)                       # fired once: a replayed step 2 passes
  assert [rank0.poisons(s) for s in (2, 4)] == [False, False]
  assert rank0.poisons(3) and not rank0.poisons(3)
  marker = json.load(open(tmp_path / "0-nan-rank0.json"))
  assert marker["step"] == 3 and marker["fault"] == "nan:step=3"
  rank1.slow_down(3)                         # before its first step: starts the clock
  step_start = time.perf_counter()
  while time.perf_counter() - step_start < 0.05:   # a 50 ms "step" of work
    pass
  rank1.slow_down(4)                         # sleeps (factor - 1) x the step's own time
  assert time.perf_counter() - step_start >= 0.05 + 2 * 0.05


@pytest.mark.parametrize("second_rate, excluded", [(78.0, False), (21.0, True)])
def test_a_slot_found_slow_is_probed_again_before_it_fails(tmp_path, monkeypatch, second_rate,
                                                           excluded):
  """A busy host can starve one process through its whole first matmul probe: the slot is
  probed again, longer, and fails only if the better of its two rates is still slow (a drill
  at load 20 excluded a healthy slot). Here a second slot (7) plays a healthy peer."""
  rates = iter([20.0, second_rate])
  calls = []

  def probe(size=384, repeats=10):
    calls.append(repeats)
    return next(rates)

  def share_with_peer(mine):
    peer = {"slot": 7, "rate": 80.0} if "rate" in mine else {
        "slot": 7, "rank": 1, "matmul_gflops": 80.0, "write": {"ok": True},
        "allgather": {"wrong_ranks": [], "gbytes_per_s": 1.0}}
    return [mine, peer]
  monkeypatch.setattr(selfcheck, "probe_matmul", probe)
  monkeypatch.setattr(selfcheck, "share", share_with_peer)
  verdict, results = selfcheck.run_in_group(str(tmp_path / "out"), str(tmp_path / "ckpt"),
                                            slot=3)
  assert calls == [10, selfcheck.CONFIRM_REPEATS]
  assert results[3]["matmul_gflops_first"] == 20.0
  assert results[3]["matmul_gflops"] == max(20.0, second_rate)
  assert (verdict[3] is not None and "matmul rate" in verdict[3]) == excluded
  assert verdict[7] is None


def test_a_group_with_no_slow_slot_probes_once(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(selfcheck, "probe_matmul",
                      lambda size=384, repeats=10: calls.append(repeats) or 75.0)
  verdict, _ = selfcheck.run_in_group(str(tmp_path / "out"), str(tmp_path / "ckpt"), slot=3)
  assert calls == [10] and verdict == {3: None}
