"""Observability: the per-rank timeline and its Chrome-trace merge, the heat-map, the profiler
window, the straggler detector and hang localisation (synthetic inputs and one tiny run)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments import job
from mscale_jax.config import profile_window
from mscale_jax.errors import ConfigError
from mscale_jax.observability import hang, straggler, trace
from mscale_jax.observability.phases import PhaseMachine
from mscale_jax.observability.timeline import Timeline, read_rank_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- timeline and merge ------------------------------------------------------------------------

def _loop(machine, steps, rng, slow_host=0.0):
  """Drives `machine` through `steps` iterations of the trainer's phases, with random waits."""
  for step in range(1, steps + 1):
    for phase, seconds in (("data_wait", 2e-4), ("host_to_device", 1e-4), ("dispatch", 3e-4),
                           ("host", 1e-4 + slow_host), ("sync", 5e-4), ("host", 0.0)):
      machine.phase(phase, step if phase == "data_wait" else None)
      end = time.perf_counter() + seconds * rng.uniform(0.5, 1.5)
      while time.perf_counter() < end:
        pass


def _assert_valid_trace(obj, ranks):
  text = json.dumps(obj)
  events = json.loads(text)["traceEvents"]
  names = {e["pid"]: e["args"]["name"] for e in events
           if e["ph"] == "M" and e["name"] == "process_name"}
  rank_pids = sorted(p for p in names if p != trace.DRIVER_PID)
  assert rank_pids == sorted(ranks) and all(names[r].startswith(f"rank {r}") for r in ranks)
  spans = [e for e in events if e["ph"] == "X"]
  assert spans and all(isinstance(e["ts"], int) and e["dur"] >= 0 for e in spans)
  tracks = {}
  for e in spans:
    tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
  for key, intervals in tracks.items():
    intervals.sort()
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
      assert start >= end, f"overlapping spans on track {key}"
  return spans


def test_timeline_spans_tile_each_rank_and_merge_into_a_valid_chrome_trace(tmp_path):
  rng = np.random.default_rng(0)
  for rank in (0, 1, 2):
    tl = Timeline(str(tmp_path / "timeline"), rank, meta={"coords": {"data": [rank]}},
                  flush_every_s=0.01)
    machine = PhaseMachine(sink=tl)
    machine.phase("compile")
    _loop(machine, 6, rng, slow_host=0.02 if rank == 2 else 0.0)   # well above preemption noise
    save = {"step": 6, "stall_s": 0.001, "write_s": None}
    machine.phase("checkpoint_stall")
    tl.checkpoint_saved(save)
    machine.phase("host")
    save["write_s"] = 0.05   # orbax's callback, later
    records = machine.drain()
    machine.phase("done")   # as the trainer's TimelineRecorder ends a run
    tl.close()
    assert [s for s, _ in records] == [1, 2, 3, 4, 5]   # iteration 6 is still open then
    assert set(records[0][1]) == {"data_wait", "host_to_device", "dispatch", "host", "sync"}
    metas, spans = read_rank_file(tl.path)
    assert metas[0]["coords"] == {"data": [rank]} and metas[0]["rank"] == rank
    loop = [s for s in spans if s["track"] == "loop"]
    assert all(a["end"] == b["start"] for a, b in zip(loop, loop[1:]))   # no gaps, no overlap
    assert [s["name"] for s in spans if s["track"] == "checkpoint"] == ["checkpoint_write"]
  data = trace.load(str(tmp_path))
  spans = _assert_valid_trace(trace.chrome_trace(data), [0, 1, 2])
  assert {e["tid"] for e in spans if e["name"] == "checkpoint_write"} == {1}
  summary = trace.summarize(data)
  assert summary["furthest_above_others"]["host"]["rank"] == 2
  assert summary["ranks"][2]["iterations"] == 6


def test_profile_steps_spec_is_validated():
  assert profile_window("", 10) is None
  assert profile_window("3:5", 10) == (3, 5) and profile_window("4:4", 4) == (4, 4)
  for bad in ("5", "a:b", "0:3", "5:3", "3:11", "3:5:7"):
    with pytest.raises(ConfigError, match="train.profile_steps.*START:END"):
      profile_window(bad, 10)


# -- straggler detection -----------------------------------------------------------------------

def _phases(rng, ranks, steps, slow=None, factor=0.0, start=0, spikes=0.0):
  """Per-step {rank: {phase: s}} of a 100 ms step; rank `slow` spends `factor` x step more in
  `host` from step `start` on; `spikes`: chance of a one-step 40 ms hiccup on any rank/phase."""
  for step in range(1, steps + 1):
    values = {}
    for r in range(ranks):
      v = {"data_wait": rng.gamma(4, 5e-4), "host_to_device": rng.gamma(4, 3e-4),
           "host": rng.gamma(4, 2e-4), "log": 0.0, "eval": 0.0, "checkpoint_stall": 0.0}
      if rng.random() < spikes:
        v[rng.choice(list(v))] += 0.04
      if r == slow and step >= start:
        v["host"] += factor * 0.1
      values[r] = v
    yield step, values, 0.1 * rng.uniform(0.9, 1.1)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_a_slow_rank_is_flagged_within_the_window_naming_its_phase(ranks):
  rng = np.random.default_rng(ranks)
  detector = straggler.StragglerDetector(window=10)
  flags = []
  for step, values, step_time in _phases(rng, ranks, 80, slow=1, factor=0.5, start=31,
                                         spikes=0.02):
    flags += detector.update(step, values, step_time)
  assert len(flags) == 1
  flag = flags[0]
  assert (flag.rank, flag.metric, flag.since) == (1, "host", 31) and flag.at <= 31 + 10
  assert flag.score == pytest.approx(0.5, rel=0.2)
  assert "straggler: rank 1" in flag.describe() and "host" in flag.describe()


@pytest.mark.parametrize("ranks", [2, 4, 16])
def test_clean_noisy_runs_flag_nobody(ranks):
  rng = np.random.default_rng(100 + ranks)
  detector = straggler.StragglerDetector(window=10)
  for step, values, step_time in _phases(rng, ranks, 300, spikes=0.05):
    assert detector.update(step, values, step_time) == []


def test_a_rank_hiccuping_shorter_than_the_window_is_not_flagged():
  # Smoothed over 4 steps, a slowdown of L steps looks abnormal for up to L + 3 updates: one
  # of 10 - 4 = 6 steps stays below the window of 10.
  detector = straggler.StragglerDetector(window=10, smooth=4)
  rng = np.random.default_rng(1)
  for step, values, step_time in _phases(rng, 4, 60, slow=3, factor=1.0, start=20):
    if not 20 <= step <= 25:   # slow for 6 steps (20..25), healthy before and after
      values[3]["host"] = values[0]["host"]
    if step > 40:
      break
    assert not detector.update(step, values, step_time)


def test_host_probes_flag_a_slow_machine_by_ratio():
  detector = straggler.StragglerDetector(threshold=1.0, window=3, unit="ratio", smooth=1)
  rng = np.random.default_rng(2)
  flags = []
  for beat in range(8):
    values = {r: {"probe_ms": rng.uniform(0.8, 1.2) * (3.0 if r == 2 and beat >= 2 else 1.0),
                  "rss_mb": 500 + rng.uniform(-20, 20)} for r in range(4)}
    flags += detector.update(beat, values)
  assert [(f.rank, f.metric, f.since, f.at) for f in flags] == [(2, "probe_ms", 2, 4)]


def test_step_table_waits_for_every_rank_and_skips_lost_steps():
  table = straggler.StepTable()
  table.add(0, 1, {"host": 0.1, "sync": 0.2})
  assert list(table.ready([0, 1])) == []
  table.add(1, 1, {"host": 0.3, "sync": 0.0})
  table.add(0, 2, {"host": 0.1})          # rank 1's step 2 was lost
  table.add(0, 3, {"host": 0.1})
  table.add(1, 3, {"host": 0.1})
  rows = list(table.ready([0, 1]))
  assert [s for s, *_ in rows] == [1, 3]
  step, own, totals, step_time = rows[0]
  assert own[1]["host"] == 0.3 and "sync" not in own[0]
  assert totals == pytest.approx({0: 0.3, 1: 0.3}) and step_time == pytest.approx(0.3)


# -- hang localisation -------------------------------------------------------------------------

def _report(rank, phase, step, code):
  return hang.RankReport(rank, phase, step, code, {"data": [rank // 2], "tensor": [rank % 2]})


def test_localize_names_the_rank_that_is_elsewhere():
  waiting = "train.py:_check"
  reports = [_report(r, "sync", 51, waiting) for r in (0, 1, 3)] + \
      [_report(2, "host", 50, "faults.py:before_step")]
  out = hang.localize(reports)
  assert out["odd_ranks"] == [2] and out["groups"][0]["ranks"] == [0, 1, 3]
  # Two ranks: no majority; the one behind is named, then the one not waiting on a result.
  assert hang.localize([_report(0, "host", 50, "faults.py:before_step"),
                        _report(1, "sync", 51, waiting)])["odd_ranks"] == [0]
  assert hang.localize([_report(0, "sync", 50, waiting),
                        _report(1, "data_wait", 50, "data.py:__next__")])["odd_ranks"] == [1]
  assert hang.localize([_report(r, "sync", 9, waiting) for r in range(4)])["odd_ranks"] == []
  # A stopped rank cannot dump its stacks: at the same phase and step, it is the odd one.
  stopped = hang.localize([_report(0, "sync", 4, waiting), _report(1, "sync", 4, hang.NO_DUMP)])
  assert stopped["odd_ranks"] == [1] and "did not answer" in stopped["reason"]
  assert hang.localize([_report(r, "sync", 4, hang.NO_DUMP) for r in range(2)])["odd_ranks"] == []
  assert hang.format_coords({"data": [1], "fsdp": [0], "tensor": [0, 1, 2, 3]}) == \
      "data 1, fsdp 0, tensor 0-3"


_BLOCKED = """
import sys, threading, time
from mscale_jax.observability import hang
hang.install_stack_dump(sys.argv[1])
def stuck_in_a_collective():
  print("ready", flush=True)
  threading.Event().wait()
threading.Thread(target=lambda: time.sleep(60), daemon=True).start()
stuck_in_a_collective()
"""


def _dumped(path) -> bool:
  frames = hang.main_thread_frames(path.read_text()) if path.exists() else []
  return bool(frames) and frames[-1][2] in hang.ENTRY_POINTS


def test_a_signal_dumps_a_blocked_process_stacks(tmp_path):
  path = tmp_path / "stacks" / "rank0.txt"
  proc = subprocess.Popen([sys.executable, "-c", _BLOCKED, str(path)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
                          text=True, start_new_session=True)
  try:
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, hang.DUMP_SIGNAL)
    deadline = time.monotonic() + 20
    while not _dumped(path):   # faulthandler writes line by line
      assert time.monotonic() < deadline and proc.poll() is None
      time.sleep(0.05)
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  frames = hang.main_thread_frames(path.read_text())
  assert frames[-2][2] == "stuck_in_a_collective" and frames[-1][2] == "<module>"
  assert hang.where_in_code(frames, packages=("<string>",)) == "<string>:stuck_in_a_collective"


# -- the driver, end to end: 2 processes x 4 devices -------------------------------------------

TRAIN_ARGS = job.TINY_GPT + [
    "--config.train.steps=16", "--config.train.log_every=1", "--config.train.eval_every=16",
    "--config.train.checkpoint_every=16", "--config.optimizer.warmup_steps=1",
    "--config.train.profile_steps=2:3"]


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
  """One supervised run: rank 1 is 1.5x slow from the start, rank 0 hangs before step 14; no
  restart, so the run ends after the hang is localised. Every process it started is killed."""
  workdir = tmp_path_factory.mktemp("drill")
  result = job.run(workdir, ["--heartbeat_s=0.5", f"--xla_flags={job.TEST_XLA}",
                             "--fault=slow:rank=1:factor=1.5", "--fault=hang:rank=0:step=14",
                             "--hang_timeout_s=8", "--hang_step_factor=3", "--max_restarts=0",
                             "--status_every_s=0"], TRAIN_ARGS, timeout_s=300)
  assert not result.timed_out and not result.leftovers, result.tail()
  return workdir, result.output, result.report


@pytest.mark.slow
def test_the_driver_flags_the_slow_rank_naming_its_phase(drill):
  workdir, output, report = drill
  flags = report["observability"]["straggler_flags"]
  assert [(f["rank"], f["metric"]) for f in flags] == [(1, "host")], output[-3000:]
  assert flags[0]["at"] <= 30 and flags[0]["unit"] == "step"
  assert "straggler: rank 1: host" in output
  with open(workdir / "resilience" / "stragglers.jsonl") as f:
    assert [json.loads(line)["rank"] for line in f] == [1]


@pytest.mark.slow
def test_the_driver_localises_the_hung_rank(drill):
  workdir, output, report = drill
  (failure,) = report["failures"]
  assert failure["kind"] == "hang" and failure["injected"] == "hang:rank=0:step=14"
  # Declared once no rank advanced for 8 s (the timeout; 3 step times are less), counted from
  # the injection, which may come a little after the last step was reported.
  assert 6 < failure["detection_latency_s"] < 8 + 5, failure
  (where,) = report["observability"]["hang_localisations"]
  assert where["odd_ranks"] == [0], output[-3000:]
  ranks = {r["rank"]: r for r in where["ranks"]}
  assert ranks[0]["code"] == "faults.py:before_step" and ranks[0]["step"] == 13
  assert ranks[0]["coords"]["data"] == [0] and ranks[1]["coords"]["data"] == [1]
  assert "not where the others are: rank 0 (data 0" in output


@pytest.mark.slow
def test_the_run_leaves_a_merged_trace_profiles_and_per_rank_scalars(drill):
  workdir, output, report = drill
  with open(workdir / "timeline" / "trace.json") as f:
    spans = _assert_valid_trace(json.load(f), [0, 1])
  names = {e["name"] for e in spans}
  assert {"restore", "compile", "data_wait", "host_to_device", "dispatch", "sync", "host",
          "profile", "attempt 0"} <= names
  for rank in (0, 1):
    profile = workdir / "profile" / f"rank{rank}"
    assert any(f.endswith(".xplane.pb") for _, _, files in os.walk(profile) for f in files)
    assert os.listdir(workdir / "tensorboard" / f"rank{rank}")
  with open(workdir / "timeline" / "heatmap.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert "jax.profiler trace of steps 2-3" in open(
      next((workdir / "logs").glob("attempt0-rank1.log"))).read()


# -- the driver's observer, without processes ----------------------------------------------------

class _Proc:
  def poll(self):
    return None


class _Group:
  attempt, slots, started = 0, [0, 3], 0.0
  procs = [_Proc(), _Proc()]


def _beat(rank, steps, host_s):
  from mscale_jax.resilience import events
  return events.Heartbeat(rank=rank, host="h", pid=1, phase=events.TRAINING, step=steps[-1],
                          step_phases=[[s, {"dispatch": 0.1, "sync": 0.05, "host": host_s,
                                            "data_wait": 0.001}] for s in steps],
                          where=["sync", steps[-1] + 1, 0.1])


@pytest.mark.parametrize("policy", ["warn", "evict"])
def test_observer_flags_a_straggler_from_heartbeats(tmp_path, policy):
  from mscale_jax.resilience import events
  from mscale_jax.observability.observer import Observer
  said = []
  observer = Observer(str(tmp_path), said.append, policy=policy, window=5, status_every_s=0,
                      tokens_per_step=256)
  observer.start_group(_Group())
  failure = None
  for first in range(1, 31, 3):   # heartbeats carrying 3 iterations each
    steps = list(range(first, first + 3))
    observer.receive(_beat(0, steps, 0.001), 0.0)
    observer.receive(_beat(1, steps, 0.08), 0.0)   # slot 3 spends 80 ms more in 'host'
    failure = failure or observer.observe(now=first)
  (flag,) = observer.flags
  assert (flag["rank"], flag["slot"], flag["metric"], flag["since"]) == (1, 3, "host", 1)
  assert any("straggler: rank 1: host" in line and "slot 3" in line for line in said)
  with open(tmp_path / "resilience" / "stragglers.jsonl") as f:
    assert json.loads(f.readline())["rank"] == 1
  if policy == "evict":
    assert failure.kind == events.STRAGGLER and failure.rank == 1 and failure.step == flag["at"]
  else:
    assert failure is None
  screen = observer.status(now=40.0)
  assert "STRAGGLER(host)" in screen.splitlines()[3] and "tokens/s" in screen.splitlines()[0]
  assert os.listdir(tmp_path / "tensorboard" / "rank1")
