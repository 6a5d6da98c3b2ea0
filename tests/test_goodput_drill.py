"""Replaying fault drill records (mscale_jax.goodput.drill): the committed records, and the
reader's tolerance of records with other fields and fault kinds."""
import dataclasses
import json
import os

import pytest

from mscale_jax.errors import ConfigError
from mscale_jax.goodput import drill, simulate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(REPO, "results", "fault_drill-*.json")


def test_every_committed_drill_record_is_replayed_and_falls_back_where_the_drill_did():
  cases, errors = drill.read_all(RECORDS)
  assert errors == [] and len(cases) >= 4
  for case in cases:
    pred = drill.predict(case)
    # Faults without a restart of their own are listed, not simulated: a slowdown (contend),
    # a bad slot (found by the self-check of another fault's restart), a refused save dropped
    # in the process (io_error since 2026-11-26 21:09).
    assert all(spec.split(":")[0] in ("contend", "bad_slot") or
               (spec.startswith("io_error") and "no restart to simulate" in why)
               for spec, why in case.unplaced), case.unplaced
    # The simulator works out each restart's checkpoint from the cadence, the fault's step,
    # whether it struck mid-save and whether it corrupted the newest checkpoint; the drill
    # recorded where its driver actually restored.
    assert pred.lost == case.recorded_lost, case.path
    # The fed costs come back in the drill's own accounting (restart includes the first step).
    for key in ("detection_s", "restart_s", "startup_s", "replayed_steps_s", "training_s"):
      if key in case.measured_breakdown:
        assert pred.breakdown[key] == pytest.approx(case.measured_breakdown[key], rel=1e-6), key
    assert 0 < pred.rate < 1 and 0 < pred.rate_events_only < 1
    if case.own_residual:   # fed its own measured residual: the target
      assert abs(pred.difference_points) <= 2.0, case.path


def _record(tmp_path, name, figures, **top):
  path = tmp_path / f"fault_drill-{name}.json"
  path.write_text(json.dumps({"name": "fault_drill-x", "figures": figures, **top}))
  return str(path)


def _figures(**extra):
  return {"steps": 60, "iteration_s": 0.5, "wall_s": 50.0, "effective_training_time_rate": 0.6,
          "checkpoint_saves": [{"step": 35, "stall_s": 1.0, "write_s": 0.1},
                               {"step": 40, "stall_s": 0.2, "write_s": 0.1}],
          "faults": [
              {"injected": "kill:rank=1:step=13", "kind": "exited", "detection_latency_s": 0.5,
               "diagnosis": {"self_check_s": 1.0}, "restart_s": 3.5, "steps_lost": 2},
              # a new kind with per-phase times and no injection step
              {"injected": "stop:rank=0:after_s=7", "kind": "hang", "restore_step": 20,
               "steps_lost": 3, "phases": {"detection": 6.0, "self_check": 0.5, "restore": 0.3,
                                           "process_start": 1.2}},
              # a slow machine that never forced a restart: nothing to replay
              {"injected": "contend:rank=1:step=40", "kind": "slow"},
              # found by the self-check of another fault's restart
              {"injected": "bad_slot:slot=1:step=9", "kind": "self_check_failed",
               "found_while_recovering_from": "kill:rank=1:step=13"}],
          **extra}


def test_the_reader_takes_other_field_names_and_new_fault_kinds(tmp_path):
  path = _record(tmp_path, "a", _figures(),
                 command="python experiments/fault_drill.py --checkpoint_every=5")
  case = drill.read_case(path)
  assert (case.checkpoint_every, case.first_stall_s, case.stall_s) == (5, 1.0, 0.2)
  assert case.persist_s == pytest.approx(0.1)
  first, second = case.faults
  assert (first.at_iteration, first.detection_s, first.diagnosis_s) == (12, 0.5, 1.0)
  assert first.restart_s == pytest.approx(3.5 - 1.0 - 0.5)   # less self-check and first step
  assert (second.at_iteration, second.detection_s, second.diagnosis_s) == (23, 6.0, 0.5)
  assert second.restart_s == pytest.approx(1.5) and second.name == "hang"
  assert case.unplaced == (
      ("contend:rank=1:step=40", "no detection or restart time recorded (no restart to simulate)"),
      ("bad_slot:slot=1:step=9", "found by the self-check of kill:rank=1:step=13's restart: its "
                                 "cost is in that restart"))
  assert case.reference_wall_s is None and case.startup_s == 0.0
  # No where_time_went: the measured split is worked out from the per-fault times as the drill
  # does (restart: self-check + restart + the first new step), start-up left in other_s.
  assert case.measured_breakdown == pytest.approx(
      {"training_s": 30.0, "detection_s": 6.5, "restart_s": 3.5 + 2.5, "replayed_steps_s": 2.5,
       "other_s": 50.0 - 30.0 - 6.5 - 6.0 - 2.5})
  pred = drill.predict(case)
  assert pred.lost == (2, 3) and pred.residual_per_step_s is None
  # By hand: 65 iterations run (60 + 2 + 3 replayed) at 0.5 s; saves at 5..60 stalling 1.0 s
  # for the first after each start (5, 15, 25) and 0.2 s otherwise (10, 20, 30..60);
  # detection 6.5 s, self-checks 1.5 s, restarts 3.5 s.
  wall = 65 * 0.5 + (3 * 1.0 + 9 * 0.2) + 6.5 + 1.5 + 3.5
  assert pred.rate == pytest.approx(30 / wall)


def test_measured_evaluations_or_a_sibling_reference_run_supply_the_residual(tmp_path):
  evaluated = drill.read_case(_record(
      tmp_path, "b", _figures(where_time_went={"startup_s": 2.0, "evaluation_s": 6.5}),
      command="--checkpoint_every=5"))
  pred = drill.predict(evaluated)
  assert pred.residual_per_step_s == pytest.approx(6.5 / 65)
  assert pred.rate == pytest.approx(30 / (48.8 + 6.5 + 2.0))
  with_ref = _record(tmp_path, "c", _figures(reference_wall_s=40.0),
                     reference_workdir="runs/ref", command="--checkpoint_every=5")
  without = _record(tmp_path, "d", _figures(), reference_workdir="runs/ref",
                    command="--checkpoint_every=5")
  other = _record(tmp_path, "e", _figures(iteration_s=0.6), reference_workdir="runs/ref",
                  command="--checkpoint_every=5")
  cases, errors = drill.read_all(str(tmp_path / "fault_drill-[cde].json"))
  assert errors == []
  by_path = {c.path: c for c in cases}
  assert by_path[without].reference_wall_s == 40.0
  assert by_path[without].reference_from == os.path.basename(with_ref)
  assert by_path[other].reference_wall_s is None      # another reference run: nothing lent
  # The fault-free run simulated: 60 x 0.5 s + saves (1.0 + 11 x 0.2 s) = 33.2 s; 40 s measured.
  assert drill.predict(by_path[without]).residual_per_step_s == pytest.approx((40 - 33.2) / 60)


def test_a_reference_start_up_beyond_the_runs_own_is_taken_out_of_the_residual(tmp_path):
  # The reference started cold (5 s), the faulty run warm (2 s): the 3 s are the reference's
  # start-up, not time the faulty run spends per step.
  def case(name, **reference):
    return drill.read_case(_record(
        tmp_path, name, _figures(reference_wall_s=45.0, where_time_went={"startup_s": 2.0},
                                 **reference), command="--checkpoint_every=5"))
  plain, cold = case("t"), case("u", reference_where_time_went={"startup_s": 5.0})
  assert (plain.reference_startup_s, cold.reference_startup_s) == (None, 5.0)
  assert any("reference run's start-up" in m for m in drill.missing_inputs(plain))
  assert not any("reference run's start-up" in m for m in drill.missing_inputs(cold))
  # Fault-free: 2 s start-up + 33.2 s (above) = 35.2 s simulated; 45 s measured.
  assert drill.predict(plain).residual_per_step_s == pytest.approx((45 - 35.2) / 60)
  assert drill.predict(cold).residual_per_step_s == pytest.approx((45 - 3 - 35.2) / 60)


def test_records_the_reader_cannot_use_are_reported_not_guessed(tmp_path):
  bad = _figures()
  del bad["iteration_s"]
  _record(tmp_path, "f", bad)
  no_cadence = _figures(checkpoint_saves=[])
  _record(tmp_path, "g", no_cadence)
  cases, errors = drill.read_all(str(tmp_path / "fault_drill-*.json"))
  assert cases == [] and len(errors) == 2
  assert "iteration_s" in errors[0][1] and "cadence" in errors[1][1]


def test_faults_are_placed_where_they_struck(tmp_path):
  # A fault from outside fires once a rank reports its step done (here 23, asked for 20); a
  # worker's fires before its step runs.
  figures = _figures(faults=[
      {"injected": "stop:rank=1:step=20", "injected_step": 23, "by": "driver", "kind": "hang",
       "detection_latency_s": 9.0, "restart_s": 4.0, "steps_lost": 3},
      {"injected": "kill:rank=1:step=40", "injected_step": 40, "by": "worker",
       "kind": "exited", "detection_latency_s": 0.2, "restart_s": 3.0, "steps_lost": 4}])
  case = drill.read_case(_record(tmp_path, "h", figures, command="--checkpoint_every=5"))
  assert [f.at_iteration for f in case.faults] == [23, 39]
  assert case.specs == ("stop:rank=1:step=20", "kill:rank=1:step=40")
  assert drill.predict(case).lost == (3, 4)


def test_a_save_refused_in_process_is_listed_as_unplaced_with_why(tmp_path):
  figures = _figures(faults=[
      {"injected": "io_error:rank=0:step=30:seconds=0.0", "injected_step": 31, "by": "driver",
       "kind": "save_refused", "detection_latency_s": 4.5, "restart_s": None, "steps_lost": 0,
       "in_process": True, "phases": {}}])
  case = drill.read_case(_record(tmp_path, "r", figures, command="--checkpoint_every=5"))
  assert case.faults == ()
  ((what, why),) = case.unplaced
  assert "io_error" in what and "recovered in the process" in why


def _driver_fault(spec, step, restore, lost):
  return {"injected": spec, "injected_step": step, "by": "driver", "kind": "exited",
          "detection_latency_s": 1.0, "restart_s": 4.0, "restore_step": restore,
          "steps_lost": lost}


def test_driver_faults_strike_where_training_stood_and_a_corrupt_checkpoint_costs_one_more(
    tmp_path):
  # The driver fires on a heartbeat's step, so a fault strikes at or after it: the step logged
  # last before the restart (restore step + steps lost) is where training stood.
  figures = _figures(faults=[
      _driver_fault("stop:rank=1:step=20", 20, 20, 0),       # after the save at 20 was written
      _driver_fault("corrupt_checkpoint:rank=0:step=40", 40, 30, 10),   # 40 unwritten, 35 bad
      _driver_fault("kill_driver:step=50", 50, 50, 1)])      # the workers ran on a step
  case = drill.read_case(_record(tmp_path, "k", figures, command="--checkpoint_every=5"))
  assert [f.at_iteration for f in case.faults] == [20, 40, 51]
  assert [(f.saves_written, f.newest_corrupt) for f in case.faults] == \
      [(True, False), (False, True), (False, False)]
  assert drill.predict(case).lost == (0, 10, 1)
  # Each flag is what moves the restore point: without them the save in flight at the fault
  # (persisting 0.1 s) is lost and the checkpoint before it restored.
  job = drill.job_for(case)
  for i, field in ((0, "saves_written"), (1, "newest_corrupt")):
    plain = [dataclasses.replace(case.faults[i], **{field: False})]
    assert simulate.simulate(job, iterations=60, faults=plain).recoveries[0].lost_iterations == 5


def test_silent_corruption_costs_the_save_the_replica_check_refused(tmp_path):
  # Corrupted from step 23; the save at 25 is refused, so the restart restores 20, not 25.
  figures = _figures(faults=[
      {"injected": "bad_slot:slot=1:step=23", "kind": "replica_divergence",
       "detection_latency_s": 0.3, "restart_s": 5.0, "restore_step": 20, "steps_lost": 5}])
  case = drill.read_case(_record(tmp_path, "sdc", figures, command="--checkpoint_every=5"))
  assert [(f.at_iteration, f.during_save) for f in case.faults] == [(25, True)]
  assert drill.predict(case).lost == (5,)


def test_a_run_that_itemises_its_own_residual_is_fed_it_not_the_reference_runs(tmp_path):
  # Evaluations and the steps' time over the fed iteration time, measured in the faulty run
  # (its steps ran faster than the reference's: negative); the slowdown is inside the latter,
  # the stalls are simulated, the unaccounted rest is the prediction's to explain.
  split = {"checkpoint_stall_s": 2.0, "evaluation_s": 3.0, "slowdown_s": 1.0,
           "steps_slower_than_steady_s": -8.0, "unaccounted_s": -4.0}
  case = drill.read_case(_record(
      tmp_path, "m", _figures(reference_wall_s=40.0, where_time_went={"other_split": split}),
      command="--checkpoint_every=5"))
  assert (case.evaluation_s, case.own_steps_slower_s) == (3.0, -8.0) and case.own_residual
  contend = drill.read_case(_record(tmp_path, "n", _figures(faults=[
      {"injected": "contend:rank=1:step=30:seconds=30.0", "kind": "not flagged",
       "detected": False, "phases": {"slowdown_s": 1.0}}]), command="--checkpoint_every=5"))
  assert contend.faults == () and "slowdown is in the run's step times" in contend.unplaced[0][1]
  pred = drill.predict(case)
  assert pred.residual_from.startswith("this run")
  # 65 iterations run (2 + 3 replayed). The evaluations (every attempt) are spread over them;
  # the steps' time was measured once per step (60), and a replayed step ran at that pace too.
  assert pred.residual_per_step_s == pytest.approx(3.0 / 65 - 8.0 / 60)
  fed = 3.0 - 8.0 * 65 / 60
  assert pred.other_split["residual_s"] == pytest.approx(fed)
  # The stalls of every save were timed (2.0 s in all): fed as their mean over the 12 simulated
  # saves (5..60), not the listed saves' (the last start's only; 4.8 s in the events above).
  assert pred.other_split["checkpoint_stall_s"] == pytest.approx(2.0)
  assert pred.case.stall_s == pytest.approx(2.0 / 12) and pred.case.first_stall_s is None
  assert pred.rate == pytest.approx(30 / (48.8 - 4.8 + 2.0 + fed))
  assert pred.rate_from_reference is not None and pred.rate_from_reference != pred.rate
  # A newer record also times each restart's first new step (here 2 restarts, 1.6 s in all):
  # restart_s holds them whole, so only the other 58 steps set the per-step excess.
  split["of_which"] = {"first_new_steps_in_restart_s": 1.6, "slowdown_in_steps_slower_s": 1.0}
  timed = drill.read_case(_record(
      tmp_path, "m2", _figures(where_time_went={"other_split": split}),
      command="--checkpoint_every=5"))
  assert timed.first_new_steps_s == 1.6
  assert drill.predict(timed).residual_per_step_s == pytest.approx(
      3.0 / 65 + (-8.0 - (1.6 - 2 * 0.5)) / 58)
  too_fast = dataclasses.replace(drill.job_for(case), overhead_per_iteration_s=-0.5)
  with pytest.raises(ConfigError, match="overhead_per_iteration_s"):
    simulate.simulate(too_fast, iterations=10)


def test_the_steady_stall_is_the_mean_of_the_saves_after_the_first(tmp_path):
  # The simulator adds stalls up, so it is fed their mean; a median (0.1 s here) would lose
  # the long ones. The first save after a start is the start's (2.0 s).
  saves = [{"step": s, "stall_s": x, "write_s": 0.1}
           for s, x in ((35, 2.0), (40, 0.1), (45, 0.1), (50, 0.7))]
  case = drill.read_case(_record(tmp_path, "p", _figures(checkpoint_saves=saves, faults=[]),
                                 command="--checkpoint_every=5"))
  assert (case.first_stall_s, case.stall_s) == (2.0, pytest.approx(0.3))
  pred = drill.predict(case)
  # No faults: one start, 12 saves (5..60): the first 2.0 s, 11 at 0.3 s.
  assert pred.other_split["checkpoint_stall_s"] == pytest.approx(2.0 + 11 * 0.3)
  assert pred.breakdown["other_s"] == pytest.approx(2.0 + 11 * 0.3)
  # The residual that would have matched: the measured wall less the simulated one.
  assert pred.residual_needed_s == pytest.approx(50.0 - (60 * 0.5 + 2.0 + 11 * 0.3))


def test_a_record_missing_what_the_replay_needs_is_named_by_file_and_field(tmp_path):
  figures = _figures()
  del figures["wall_s"]
  path = _record(tmp_path, "q", figures, command="--checkpoint_every=5")
  with pytest.raises(ConfigError, match=r"fault_drill-q\.json: figures\.wall_s=None"):
    drill.read_case(path)
  (tmp_path / "fault_drill-r.json").write_text('{"figures": {"steps": ')   # cut off mid-write
  cases, errors = drill.read_all(str(tmp_path / "fault_drill-[qr].json"))
  assert cases == [] and [os.path.basename(p) for p, _ in errors] == \
      ["fault_drill-q.json", "fault_drill-r.json"]
  assert "figures.wall_s" in errors[0][1] and "fault_drill-r.json" in errors[1][1]


def test_new_optional_fields_are_read_past_and_a_missing_rate_is_worked_out(tmp_path):
  # A later drill may add fields (an adaptive hang limit, its launcher runs, odd entries);
  # the replay needs none of them.
  figures = _figures(hang_limit={"adaptive": True, "floor_s": 60.0},
                     launcher_runs=[{"status": 0, "wall_s": None}],
                     where_time_went={"startup_s": 2.0, "other_split": {"new_part_s": 1.0},
                                      "sources": "text"})
  del figures["effective_training_time_rate"]
  figures["faults"] = figures["faults"] + ["not a fault", {"injected": "hang:rank=0:step=50",
                                                          "hang_limit_s": 12.5}]
  figures["checkpoint_saves"] = figures["checkpoint_saves"] + [None]
  case = drill.read_case(_record(tmp_path, "s", figures, command=None,
                                 launcher={"note": "new"}))
  assert case.checkpoint_every == 5       # from the spacing of the saves (35, 40)
  assert case.measured_rate == pytest.approx(60 * 0.5 / 50.0)
  assert len(case.faults) == 2 and case.startup_s == 2.0 and not case.own_residual
  assert case.unplaced[-1][0] == "hang:rank=0:step=50"
  assert 0 < drill.predict(case).rate < 1
