"""The fault drill's accounting (experiments/drill_accounting.py: every second of the fault
run's wall time in exactly one part, per fault and per restart, on runs whose parts are known)
and its side-by-side runs (experiments/fault_drill.py)."""
import json
import os

from experiments import drill_accounting, fault_drill


def test_where_time_went_counts_each_second_once(tmp_path):
  """One restart (its first new step, step 3, takes 3 s: inside restart_s and the training time
  both) and a slowdown (step 5 takes 1.5 s: inside the steps' time over steady). Wall time:
  start-up 5, steps 1-4 (4), detection 2, restart 7 (4 of start + step 3), steps 4-6 (3.5),
  evaluation 2, checkpoint stall 1 and 0.7 s nothing measured."""
  lengths = {1: 1.0, 2: 1.0, 3: 3.0, 4: 1.0, 5: 1.5, 6: 1.0}   # each step's last run
  (tmp_path / "timeline").mkdir()
  with open(tmp_path / "timeline" / "rank0.jsonl", "w") as f:
    f.write(json.dumps({"meta": {"rank": 0}}) + "\n")
    for step in (1, 2, 3, 4):   # the first attempt's runs, then the restart's
      f.write(json.dumps({"name": "sync", "step": step, "start": 0, "end": 1.0,
                          "track": "loop"}) + "\n")
    f.write(json.dumps({"name": "checkpoint_stall", "step": 2, "start": 0, "end": 1,
                        "track": "loop"}) + "\n")
    f.write(json.dumps({"meta": {"rank": 0}}) + "\n")
    for step in (3, 4, 5, 6):
      f.write(json.dumps({"name": "sync", "step": step, "start": 10, "end": 10 + lengths[step],
                          "track": "loop"}) + "\n")
    f.write(json.dumps({"name": "eval", "step": 6, "start": 0, "end": 2, "track": "loop"}) + "\n")
  report = {"attempts": [{"started": 100.0}], "wall_s": 25.2}
  run = {s: {"step": s, "time": 106.0 if s == 1 else 200.0, "step_time_s": 1.0} for s in lengths}
  rows = [{"restart_s": 7.0, "detection_latency_s": 2.0, "restore_step": 2,
           "phases": {"replay_s": 2.0}},
          {"phases": {"slowdown_s": 0.5}}]   # contend: no restart of its own
  split = drill_accounting.where_time_went(report, run, rows, str(tmp_path), iteration_s=1.0)
  assert split["startup_s"] == 5.0 and split["training_s"] == 6.0
  other = split["other_split"]
  assert (other["checkpoint_stall_s"], other["evaluation_s"]) == (1.0, 2.0)
  assert other["steps_slower_than_steady_s"] == 2.5   # step 3's 2 s over steady, step 5's 0.5
  assert other["of_which"] == {"first_new_steps_in_restart_s": 3.0, "rolled_back_steps_s": 0.0,
                               "slowdown_in_steps_slower_s": 0.5}
  assert abs(other["unaccounted_s"] - 0.7) < 1e-9, other


def _write_timeline(path, lines):
  path.mkdir(parents=True, exist_ok=True)
  with open(path / "rank0.jsonl", "w") as f:
    for line in lines:
      f.write(json.dumps(line) + "\n")


def _span(name, step, start, end):
  return {"name": name, "step": step, "start": start, "end": end, "track": "loop"}


def test_a_nan_rolled_back_in_process_is_one_row_and_its_discarded_steps_count_once(tmp_path):
  """NaN fired before step 7 (at t=106, steps 1 s each from t=100); the loop found it at step 8
  and restored step 4's checkpoint (t=108.0-108.5), then ran steps 5-8 again. Steps 5-8's first
  runs are left out of the training steps and summed apart."""
  spec = "nan:step=7"
  (tmp_path / "resilience" / "faults").mkdir(parents=True)
  (tmp_path / "resilience" / "faults" / "0-nan-rank0.json").write_text(
      json.dumps({"fault": spec, "rank": 0, "step": 7, "time": 106.0}))
  (tmp_path / "logs").mkdir()
  (tmp_path / "logs" / "attempt0-rank0.log").write_text(
      "W step 7: loss nan ...\nW rolled back to step 4; the data goes on after step 7's batch\n")
  first_runs = [_span("sync", s, 99.0 + s, 100.0 + s) for s in range(1, 9)]   # 1 s each
  restore = {**_span("restore", 8, 108.0, 108.5)}
  replays = [_span("sync", s, 108.5 + 0.5 * (s - 5), 109.0 + 0.5 * (s - 5)) for s in range(5, 9)]
  _write_timeline(tmp_path / "timeline", [{"meta": {"rank": 0, "attempt": 0}}, *first_runs,
                                          restore, *replays])
  run = {s: {"step": s, "time": 110.0 if s == 5 else 200.0, "step_time_s": 0.5}
         for s in range(1, 9)}
  report = {"attempts": [{"attempt": 0, "started": 95.0}], "failures": []}
  (row,) = drill_accounting.per_fault_rows([spec], report, run, str(tmp_path), iteration_s=0.5)
  assert row["in_process"] and row["detected"] and row["restore_step"] == 4
  assert "rollback" in row["recovered"] and "no restart" in row["recovered"]
  assert row["detection_latency_s"] == 2.0   # 106 -> the restore at 108
  assert row["restart_s"] == 2.0 and row["steps_lost"] == 2   # steps 5-6 (7 is in detection)
  assert row["phases"]["replay_s"] == 1.0
  totals = drill_accounting.timeline_totals(str(tmp_path), [5], [(row["restore_span"], 4)])
  assert totals["rolled_back_steps_s"] == 4.0   # steps 5-8's first runs
  assert totals["training_s"] == 4 * 1.0 + 4 * 0.5   # steps 1-4 once, 5-8 as replayed
  assert totals["first_new_steps_s"] == 0.5


def test_two_restarts_from_one_checkpoint_each_count_to_their_own_first_step(tmp_path):
  """As in the drill: bad_slot's divergence at step 110 (detected at t=865) and a kill at step
  111 (detected at 883) both restart from step 100, so step 101 ran three times (rank 0's
  timeline: t=811, 877 and 890; the metrics keep only the last, a restore truncates them).
  Each restart ends at its own run of step 101; that step's last run (0.5 s), in the training
  time once, is the first new step of the later restart only."""
  lines = [{"meta": {"rank": 0, "attempt": 0}}]
  lines += [_span("sync", s, 790.0 + s / 10, 800.0 + s / 10) for s in range(1, 111)]
  lines += [{"meta": {"rank": 0, "attempt": 2}}]
  lines += [_span("sync", s, 875.5 + s - 100, 876.0 + s - 100) for s in range(101, 111)]
  lines += [{"meta": {"rank": 0, "attempt": 3}}]
  lines += [_span("sync", s, 888.5 + s - 100, 889.0 + s - 100) for s in range(101, 121)]
  _write_timeline(tmp_path / "timeline", lines)
  run = {s: {"step": s, "time": 889.0 + s - 100, "loss": 1.0, "step_time_s": 0.5}
         for s in range(101, 121)}
  failures = [{"injected": spec, "kind": kind, "rank": 0, "attempt": attempt, "detail": "",
               "detected_at": at, "detection_latency_s": 1.0, "restore_step": 100,
               "steps_lost": 10}
              for spec, kind, attempt, at in (("bad_slot:slot=1:step=105", "replica_divergence",
                                               0, 865.0),
                                              ("kill:rank=1:step=111:at=step", "exited", 2, 883.0))]
  report = {"attempts": [{"attempt": a, "started": 799.0} for a in range(4)],
            "failures": failures, "wall_s": 120.0}
  rows = drill_accounting.per_fault_rows([f["injected"] for f in failures], report, run,
                                         str(tmp_path), iteration_s=0.5)
  assert [r.get("restart_s") for r in rows] == [877.0 - 865.0, 890.0 - 883.0], rows
  split = drill_accounting.where_time_went(report, run, rows, str(tmp_path), iteration_s=0.5)
  assert split["other_split"]["of_which"]["first_new_steps_in_restart_s"] == 0.5


def test_an_io_error_recovered_in_process_is_one_row_without_restart(tmp_path):
  """The driver's report lists the refused save apart from its failures (no restart): the row
  says so, has no restart or replay, and where_time_went counts no restart for it."""
  spec = "io_error:rank=0:step=30:seconds=0.0"
  (tmp_path / "resilience" / "faults").mkdir(parents=True)
  (tmp_path / "resilience" / "faults" / "0-io_error-driver.json").write_text(
      json.dumps({"fault": spec, "rank": 0, "step": 31, "time": 150.0, "by": "driver"}))
  refused = {"kind": "save_refused", "ranks": [0, 1], "attempt": 0, "step": 40,
             "detail": "checkpoint step 40 could not be written ...", "injected": spec,
             "detection_latency_s": 4.5}
  report = {"attempts": [{"attempt": 0, "started": 95.0}], "failures": [], "wall_s": 60.0,
            "recovered_in_process": [refused]}
  run = {s: {"step": s, "time": 100.0 + s, "step_time_s": 1.0} for s in range(1, 51)}
  (row,) = drill_accounting.per_fault_rows([spec], report, run, str(tmp_path), iteration_s=1.0)
  assert row["in_process"] and row["detected"] and row["kind"] == "save_refused"
  assert row["injected_step"] == 31 and row["refused_step"] == 40 and row["steps_lost"] == 0
  assert row["restart_s"] is None and "no restart" in row["recovered"]
  assert row["detection_latency_s"] == 4.5
  split = drill_accounting.where_time_went(report, run, [row], str(tmp_path), iteration_s=1.0)
  assert split["restart_s"] == split["detection_s"] == split["replayed_steps_s"] == 0


def test_restart_phases_split_each_restart(tmp_path):
  """Detected at 50, the new group started at 51, its timeline at 55 (2 s of which the
  self-check), restore 55-56, compile 56-59, first step ended at 60 (9 s after the start)."""
  _write_timeline(tmp_path / "timeline", [
      {"meta": {"rank": 0, "attempt": 0, "wall0": 0.0}}, _span("sync", 1, 1.0, 2.0),
      {"meta": {"rank": 0, "attempt": 1, "wall0": 55.0}},
      {"name": "restore", "step": None, "start": 55.0, "end": 56.0, "track": "loop"},
      {"name": "compile", "step": None, "start": 56.0, "end": 59.0, "track": "loop"},
      _span("sync", 11, 59.0, 59.7), _span("host", 11, 59.7, 60.0), _span("sync", 12, 60, 61)])
  report = {"attempts": [{"attempt": 0, "started": 0.0},
                         {"attempt": 1, "started": 51.0, "warm_processes": 2}],
            "failures": [{"attempt": 0, "kind": "exited", "injected": "kill:rank=1:step=12",
                          "detected_at": 50.0, "diagnosis": {"seconds": 2.0}}]}
  (phases,) = drill_accounting.restart_phases(report, str(tmp_path))
  assert phases == {"attempt": 1, "after": "kill:rank=1:step=12", "warm_processes": 2,
                    "teardown_s": 1.0, "process_start_s": 2.0, "self_check_s": 2.0,
                    "restore_s": 1.0, "compile_or_cache_load_s": 3.0, "first_step_s": 1.0,
                    "start_to_first_step_s": 9.0}


def test_compare_says_how_far_the_losses_are_equal():
  reference = {s: float(s) for s in range(1, 11)}
  run = {**reference, 7: 6.5, 9: 1.0}
  result = drill_accounting.compare(reference, run)
  assert result["equal_through_step"] == 6 and not result["bitwise_equal"]
  assert result["same_steps"] and result["max_abs_diff"] == 8.0
  assert drill_accounting.compare(reference, dict(reference))["equal_through_step"] == 10


def test_side_by_side_runs_jobs_together_and_a_twin_until_the_last_ends():
  import time
  events = []

  def work(name, seconds):
    def fn():
      events.append((name, "start", time.monotonic()))
      time.sleep(seconds)
      events.append((name, "end", time.monotonic()))
      return name
    return fn

  def twin(stop, out):
    out["load_twin"] = {"started": time.monotonic()}
    stop.wait()
    out["load_twin"]["ended"] = time.monotonic()

  ran = fault_drill.side_by_side({"short": work("short", 0.1), "long": work("long", 0.6)}, twin)
  assert (ran["short"], ran["long"]) == ("short", "long")
  at = {(name, what): t for name, what, t in events}
  assert at[("long", "start")] < at[("short", "end")]   # together
  assert at[("short", "end")] <= ran["load_twin"]["started"] < at[("long", "end")]
  assert ran["load_twin"]["ended"] >= at[("long", "end")]


def test_straggler_flags_of_every_driver_come_from_the_workdir(tmp_path):
  """After kill_driver the report is the second driver's; stragglers.jsonl holds both's."""
  report = {"observability": {"straggler_flags": []}}
  assert drill_accounting.straggler_flags(str(tmp_path), report) == []
  (tmp_path / "resilience").mkdir()
  flags = [{"rank": 1, "metric": "runq_wait_share", "time": 5.0},
           {"rank": 0, "metric": "host", "time": 9.0}]
  (tmp_path / "resilience" / "stragglers.jsonl").write_text(
      "".join(json.dumps(f) + "\n" for f in flags))
  assert drill_accounting.straggler_flags(str(tmp_path), report) == flags


def test_a_restart_after_a_failed_self_check_counts_from_that_attempts_end(tmp_path):
  _write_timeline(tmp_path / "timeline", [
      {"meta": {"rank": 0, "attempt": 0, "wall0": 0.0}}, _span("sync", 1, 1.0, 2.0),
      {"meta": {"rank": 0, "attempt": 2, "wall0": 64.0}},
      {"name": "restore", "step": None, "start": 64.0, "end": 65.0, "track": "loop"},
      {"name": "compile", "step": None, "start": 65.0, "end": 70.0, "track": "loop"},
      _span("sync", 11, 70.0, 71.0)])
  report = {"attempts": [{"attempt": 0, "started": 0.0},
                         {"attempt": 1, "started": 51.0, "ended": 60.0,
                          "failure": "self_check_failed"},
                         {"attempt": 2, "started": 61.0}],
            "failures": [{"attempt": 0, "kind": "exited", "injected": "kill:rank=1:step=12",
                          "detected_at": 50.0, "diagnosis": {"seconds": 4.0}}]}
  (phases,) = drill_accounting.restart_phases(report, str(tmp_path))   # attempt 1: no timeline
  assert (phases["attempt"], phases["after"], phases["teardown_s"]) == (2, "self_check_failed",
                                                                          1.0)
  assert phases["self_check_s"] is None and phases["process_start_s"] == 3.0
  assert (phases["compile_or_cache_load_s"], phases["first_step_s"]) == (5.0, 1.0)


def test_reference_gain_counts_the_reference_steps_run_while_the_fault_run_was_down():
  run = {s: {"time": float(s), "step_time_s": 1.0} for s in range(1, 6)}
  run.update({s: {"time": 10.0 + s, "step_time_s": 1.0} for s in range(6, 9)})   # down 5 -> 16
  reference = {s: {"time": 0.5 * s, "step_time_s": 0.8 if 5 < 0.5 * s <= 16 else 1.0}
               for s in range(1, 37)}
  gain = drill_accounting.reference_gain(reference, run)
  assert gain["gaps"] == 1 and gain["gaps_s"] == 11.0
  assert gain["reference_steps_in_gaps"] == 22   # times 5.5 ... 16.0
  assert abs(gain["reference_saved_s"] - 22 * 0.2) < 1e-9


def test_how_the_train_step_was_served_is_read_from_rank_0s_newest_log(tmp_path):
  """The three ways compile_cache.load_or_lower serves a program, as the trainer logs them;
  the newest rank-0 log decides (an older attempt's or another rank's says nothing)."""
  logs = tmp_path / "logs"
  logs.mkdir()
  line = "I1126 20:00:32.523756 139 train.py:327] {} the train step in 0.5 s\n"
  (logs / "attempt5-rank1.log").write_text(line.format("compiled"))
  for n, served in enumerate(("compiled", "loaded", "loaded before lowering")):
    path = logs / f"attempt{n}-rank0.log"
    path.write_text("[train] gpt_tiny: 34,432 parameters\n" + line.format(served))
    os.utime(path, (1000 + n, 1000 + n))
    assert drill_accounting.train_step_served(str(tmp_path)) == served
  newest = logs / "attempt9-rank0.log"
  newest.write_text("[train] gpt_tiny: 34,432 parameters\n")
  os.utime(newest, (2000, 2000))
  assert drill_accounting.train_step_served(str(tmp_path)) == "unknown"
