"""The drill's density model (experiments/drill_density.py): it reproduces a synthetic drill
whose every second is known, predicts a longer run of the same faults, finds the 95% crossing,
says when it does not fit, and its CLI writes a record and a PNG from a committed drill record."""
import json
import math
import os
import random
import subprocess
import sys

import pytest

from experiments import drill_density

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(REPO, "results", "fault_drill-gpt_tiny-cpu-20261126T235744.json")
OLDER = os.path.join(REPO, "results", "fault_drill-gpt_tiny-cpu-20261123T161414.json")


def synthetic(rng: random.Random, steps: int, phases: list[dict], *, gain: float,
              startup_extra: float = 0.0, unaccounted: float = 0.0) -> dict:
  """A drill record's figures built the way the drill's accounting splits a run, from known
  parts: per-step costs (iteration, checkpoint stall, evaluation and the fault run's extra
  per-step time) scale with `steps`; each fault costs its `phases` (a restart's first new step
  is inside restart_s, a slowdown inside the steps' time); the reference ran `gain` seconds
  faster while the fault run was down."""
  t, true_t, stall, evaluation, extra = 0.5, 0.52, 0.006, 0.002, 0.004
  first_new = sum(p.get("restart_s", 0.0) for p in phases) * 0.2
  slowdown = sum(p.get("slowdown_s", 0.0) for p in phases)
  ref = {"startup_s": 20.0, "training_s": steps * true_t - gain,
         "checkpoint_stall_s": steps * stall, "evaluation_s": steps * evaluation}
  reference_wall = sum(ref.values())
  split = {"training_s": steps * t, "startup_s": 20.0 + startup_extra,
           "other_split": {"checkpoint_stall_s": steps * stall * 1.1,
                           "evaluation_s": steps * evaluation,
                           "steps_slower_than_steady_s": steps * (true_t - t + extra)
                           + first_new + slowdown,
                           "of_which": {"first_new_steps_in_restart_s": first_new,
                                        "slowdown_in_steps_slower_s": slowdown}}}
  other = split["other_split"]
  wall = (split["training_s"] + split["startup_s"] + other["checkpoint_stall_s"]
          + other["evaluation_s"] + other["steps_slower_than_steady_s"] - first_new
          + sum(sum(p.values()) for p in phases) - slowdown + unaccounted)   # slowdown: once
  other["unaccounted_s"] = unaccounted
  rng.shuffle(phases)
  return {"faults": [{"injected": f"fault{i}", "phases": p} for i, p in enumerate(phases)],
          "where_time_went": split, "reference_where_time_went": ref,
          "reference_gain_while_fault_run_down": {"reference_saved_s": gain},
          "wall_s": wall, "reference_wall_s": reference_wall, "steps": steps,
          "faults_per_hour": len(phases) / (wall / 3600),
          "rate_vs_fault_free": reference_wall / wall,
          "rate_vs_fault_free_without_that_gain": (reference_wall + gain) / wall}


def random_phases(rng: random.Random, n: int) -> list[dict]:
  """`n` faults' phases: restarts of random cost, some a slowdown, some costing nothing."""
  out = []
  for _ in range(n):
    kind = rng.random()
    if kind < 0.15:
      out.append({})                                   # e.g. a bad slot found by another
    elif kind < 0.3:
      out.append({"slowdown_s": rng.uniform(2, 10)})   # contend
    else:
      out.append({"detection_s": rng.uniform(0.2, 12), "diagnosis_s": rng.uniform(0.3, 1.5),
                  "restart_s": rng.uniform(2, 12), "replay_s": rng.uniform(0, 6)})
  return out


@pytest.mark.parametrize("seed", range(4))
def test_the_model_reproduces_a_synthetic_drill_both_ways(seed):
  rng = random.Random(seed)
  phases = random_phases(rng, 12)
  figures = synthetic(rng, 1560, phases, gain=rng.uniform(0, 50))
  m = drill_density.model(figures)
  total = sum(sum(p.values()) for p in phases)
  assert m["per_fault_total_s"] == pytest.approx(total)
  assert m["model"]["per_fault_mean_s"] == pytest.approx(total / 12)
  # Non-fault costs: 10% more checkpoint stall and `extra` per step over the reference.
  assert m["model"]["non_fault_s"] == pytest.approx(1560 * (0.006 * 0.1 + 0.004))
  for key, measured in (("model", "rate_vs_fault_free_without_that_gain"),
                        ("as_measured", "rate_vs_fault_free")):
    assert m[key]["predicted_rate_at_measured_density"] == pytest.approx(figures[measured])
    assert m[key]["fits"]
  assert m["unmodelled_s"] == pytest.approx(0.0, abs=1e-9)
  # As measured, the reference's gain is a per-fault cost.
  assert m["as_measured"]["per_fault_mean_s"] == pytest.approx(
      m["model"]["per_fault_mean_s"] + figures["reference_gain_while_fault_run_down"][
          "reference_saved_s"] / 12)


def test_the_model_of_a_short_drill_predicts_a_longer_one_with_the_same_faults():
  """Per-fault costs do not grow with the run, per-step costs do: a drill 3x as long (the same
  faults, a third of the density) keeps the rate the short drill's model gives there."""
  rng = random.Random(7)
  phases = random_phases(rng, 12)
  short = synthetic(rng, 1560, [dict(p) for p in phases], gain=30.0)
  long = synthetic(rng, 4680, [dict(p) for p in phases], gain=30.0)
  assert long["faults_per_hour"] < short["faults_per_hour"] / 2.5
  m = drill_density.model(short)
  for key, measured in (("model", "rate_vs_fault_free_without_that_gain"),
                        ("as_measured", "rate_vs_fault_free")):
    v = m[key]
    predicted = drill_density.retained(long["faults_per_hour"], v["per_fault_mean_s"],
                                       v["delta"])
    # Not exact: delta is a fraction of the short run's reference wall time, whose start-up
    # (20 s) does not grow with the run; that shifts the long run's rate by ~1e-4.
    assert predicted == pytest.approx(long[measured], abs=1e-3)
    assert abs(predicted - long[measured]) < abs(short[measured] - long[measured]) / 20
    assert long[measured] > short[measured]


def test_crossing_is_where_the_model_meets_the_target():
  rng = random.Random(3)
  for _ in range(50):
    per_fault, delta = rng.uniform(0.5, 60), rng.uniform(-0.02, 0.04)
    rho = drill_density.crossing(per_fault, delta)
    assert drill_density.retained(rho, per_fault, delta) == pytest.approx(0.95)
    assert drill_density.retained(rho * 0.9, per_fault, delta) > 0.95
    assert drill_density.retained(rho * 1.1, per_fault, delta) < 0.95
  # 6% of non-fault costs leave less than 95% with no faults at all; free faults never cross.
  assert drill_density.crossing(10.0, 0.06) is None
  assert drill_density.crossing(0.0, 0.01) == math.inf


def test_a_drill_the_model_does_not_explain_is_said_not_to_fit():
  """Seconds no part measured (here 5% of the run) make the prediction miss: the record says
  the model does not fit and gives no crossing."""
  rng = random.Random(11)
  figures = synthetic(rng, 1560, random_phases(rng, 12), gain=20.0, unaccounted=45.0)
  m = drill_density.model(figures)
  assert m["unmodelled_s"] == pytest.approx(45.0)
  assert m["unmodelled_split_s"]["fault_run_s"] == pytest.approx(45.0)
  assert m["unmodelled_split_s"]["reference_s"] == pytest.approx(0.0, abs=1e-9)
  for key in ("model", "as_measured"):
    assert not m[key]["fits"]
    assert m[key]["crossing_faults_per_hour"] is None
    assert m[key]["crossing_if_it_fitted"] is not None
    assert m[key]["verdict"].startswith("the model does not fit")


def test_real_job_density_is_llama3s_466_interruptions_in_54_days():
  real = drill_density.real_job_density()
  assert real["interruptions_per_hour"] == pytest.approx(466 / (54 * 24))
  assert real["unexpected_per_hour"] == pytest.approx(419 / (54 * 24))


def test_the_cli_models_a_committed_record_and_skips_one_that_lacks_the_parts(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.drill_density", f"--out_dir={tmp_path}", COMMITTED,
       OLDER], cwd=REPO, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  written = sorted(os.listdir(tmp_path))
  assert [os.path.splitext(w)[1] for w in written] == [".json", ".png"], written
  with open(tmp_path / written[1], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with open(tmp_path / written[0]) as f:
    record = json.load(f)
  figures = record["figures"]
  assert record["name"] == "drill_density-gpt_tiny"
  assert list(figures["skipped"]) == [OLDER]
  m = figures["records"][os.path.basename(COMMITTED)]
  with open(COMMITTED) as f:
    drill = json.load(f)["figures"]
  assert m["measured"]["faults_per_hour"] == drill["faults_per_hour"]
  assert m["model"]["measured_rate"] == drill["rate_vs_fault_free_without_that_gain"]
  assert m["as_measured"]["measured_rate"] == drill["rate_vs_fault_free"]
  v = m["model"]
  assert v["fits"] == (abs(v["predicted_rate_at_measured_density"] - v["measured_rate"])
                       <= drill_density.TOLERANCE)
  if v["fits"]:
    assert drill_density.retained(v["crossing_faults_per_hour"], v["per_fault_mean_s"],
                                  v["delta"]) == pytest.approx(0.95)
  assert "95% at" in out.stdout
