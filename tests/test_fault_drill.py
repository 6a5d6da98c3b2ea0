"""The fault drill's accounting (experiments/fault_drill.py where_time_went): every second of
the fault run's wall time in exactly one part, on a run whose parts are known."""
import json

from experiments import fault_drill


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
  split = fault_drill.where_time_went(report, run, rows, str(tmp_path), iteration_s=1.0)
  assert split["startup_s"] == 5.0 and split["training_s"] == 6.0
  other = split["other_split"]
  assert (other["checkpoint_stall_s"], other["evaluation_s"]) == (1.0, 2.0)
  assert other["steps_slower_than_steady_s"] == 2.5   # step 3's 2 s over steady, step 5's 0.5
  assert other["of_which"] == {"first_new_steps_in_restart_s": 3.0,
                               "slowdown_in_steps_slower_s": 0.5}
  assert abs(other["unaccounted_s"] - 0.7) < 1e-9, other
