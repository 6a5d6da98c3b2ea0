"""Replaying fault drill records (mscale_jax.goodput.drill): the committed records, and the
reader's tolerance of records with other fields and fault kinds."""
import json
import os

import pytest

from mscale_jax.goodput import drill
from mscale_jax.resilience.driver.injector import OS_KINDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(REPO, "results", "fault_drill-*.json")


def test_every_committed_drill_record_is_replayed_and_falls_back_where_the_drill_did():
  cases, errors = drill.read_all(RECORDS)
  assert errors == [] and len(cases) >= 4
  for case in cases:
    pred = drill.predict(case)
    # Faults without a restart of their own are listed, not simulated: a slowdown (contend),
    # a bad slot (found by the self-check of another fault's restart).
    assert all(spec.split(":")[0] in ("contend", "bad_slot") for spec, _ in case.unplaced), \
        case.unplaced
    # The simulator works out each restart's checkpoint from the cadence, the fault's step and
    # whether it struck mid-save; the drill recorded where its driver actually restored. A
    # corrupt checkpoint sends the restore further back than the simulator knows; a fault from
    # outside strikes somewhere within a step or its save, which the record places only to the
    # step (within one checkpoint interval).
    specs = case.specs or ("",) * len(case.faults)
    for spec, recorded, simulated in zip(specs, case.recorded_lost, pred.lost):
      if spec.startswith("corrupt_checkpoint"):
        assert recorded >= simulated + case.checkpoint_every, (case.path, spec)
      elif spec.split(":")[0] in OS_KINDS:
        assert abs(recorded - simulated) <= case.checkpoint_every, (case.path, spec)
      else:
        assert recorded == simulated, (case.path, spec)
    # The fed costs come back in the drill's own accounting (restart includes the first step).
    exact = pred.lost == case.recorded_lost
    for key in ("detection_s", "restart_s", "startup_s", "replayed_steps_s", "training_s"):
      if key in case.measured_breakdown and (exact or key != "replayed_steps_s"):
        assert pred.breakdown[key] == pytest.approx(case.measured_breakdown[key], rel=1e-6), key
    assert 0 < pred.rate < pred.rate_events_only < 1


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
              {"injected": "contend:rank=1:step=40", "kind": "slow"}],
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
  assert case.unplaced == (("contend:rank=1:step=40",
                            "no detection or restart time recorded (no restart to simulate)"),)
  assert case.reference_wall_s is None and case.startup_s == 0.0
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
