"""Intervals from out-of-sample errors, the paper's own figures, and the shared micro-batch rule."""
import math
import re
import statistics

import pytest

from experiments import plan
from mscale_jax.perf import constants, fit, intervals, paper, sensitivity
from mscale_jax.perf.hardware import A100_MEGASCALE as A100
from mscale_jax.perf.workload import GPT_530B


def test_coverage_on_a_synthetic_case_with_a_known_answer():
  # Errors whose size is (1 + d/2) times k/10, k = 1..10, at distances 0 and 4, signs mixed.
  errors, distances = [], []
  for k in range(1, 11):
    for d in (0.0, 4.0):
      errors.append((-1) ** k * (1 + d / 2) * k / 10)
      distances.append(d)
  base, slope = intervals.fit_scale(errors, distances)
  assert (base, slope) == pytest.approx((0.55, 0.275))      # mean |e| at d=0 and d=4
  model = intervals.calibrate(errors, distances, nominal=0.8)
  # 80% of 20 errors, conformal: the ceil(21 * 0.8) = 17th smallest of the scores k/10 / 0.55
  # (each k twice) is k = 9, so the half-width is 0.9 (1 + d/2) and 18 of 20 errors fall in it.
  assert model.half_width(0.0) == pytest.approx(0.9)
  assert model.half_width(4.0) == pytest.approx(2.7)
  widths = [model.half_width(d) for d in distances]
  assert intervals.coverage(errors, widths) == pytest.approx(0.9)
  half = intervals.calibrate(errors, distances, nominal=0.5)   # 11th smallest: k = 6
  assert intervals.coverage(errors, [half.half_width(d) for d in distances]) == pytest.approx(0.6)


def test_normal_errors_give_the_normal_quantile():
  n = 400
  normal = statistics.NormalDist()
  distances = [float(i % 4) for i in range(n)]
  # Deterministic standard-normal quantiles, shuffled across distances by a stride.
  u = [normal.inv_cdf(((i * 37) % n + 0.5) / n) for i in range(n)]
  errors = [(0.5 + 0.25 * d) * x for d, x in zip(distances, u)]
  model = intervals.calibrate(errors, distances, nominal=0.8)
  for d in (0.0, 3.0):
    assert model.half_width(d) == pytest.approx(1.2816 * (0.5 + 0.25 * d), rel=0.06)
  widths = [model.half_width(d) for d in distances]
  assert intervals.coverage(errors, widths) == pytest.approx(0.8, abs=0.02)


def test_conformal_quantile_and_excess():
  assert intervals.conformal_quantile([3.0, 1.0, 2.0, 4.0], 0.6) == 3.0     # ceil(5 * .6) = 3rd
  assert intervals.conformal_quantile([1.0, 2.0], 0.8) == math.inf          # too few errors
  assert intervals.excess(5.0, 4.0, 6.0) == 0.0
  assert intervals.excess(3.5, 4.0, 6.0) == pytest.approx(-0.5)
  assert intervals.excess(7.0, 4.0, 6.0) == pytest.approx(1.0)
  assert intervals.ErrorModel(0.0, 0.0, 2.0, 0.8, 1).half_width(5.0) == pytest.approx(
      2 * intervals.RESOLUTION)


def test_left_out_coverage_sees_a_protocol_unlike_the_others():
  small = ([0.1, -0.1, 0.1, -0.1, 0.1, -0.1], [0.0] * 6)
  groups = {"a": small, "b": small, "c": ([3.0, -3.0, 3.0], [0.0] * 3)}
  out = intervals.cross_validated_coverage(groups, nominal=0.8)
  assert out["c"] == 0.0                      # calibrated on a and b only: far too narrow
  assert out["a"] == 1.0
  assert out["pooled"] == pytest.approx(12 / 15)


def test_distance_counts_doublings_beyond_the_fit():
  rows = paper.rows()
  fit_rows = [r for r in rows if r.table == "table2" and r.global_batch == 768]
  far = [r for r in rows if r.gpus == 12288][0]
  assert fit.distance(far, fit_rows) == pytest.approx(math.log2(12) + 3)   # GPUs, batch 8x
  near = [r for r in fit_rows if r.gpus == 512][0]
  assert fit.distance(near, fit_rows) == 0.0
  big = [r for r in rows if r.model is GPT_530B and r.gpus == 4480][0]
  size = math.log2(GPT_530B.num_params / paper.GPT_175B.num_params)
  assert fit.distance(big, fit_rows) == pytest.approx(math.log2(4480 / 1024)
                                                      + math.log2(4480 / 768) + size)


def test_protocols_predict_what_they_did_not_fit():
  protocols = fit.protocols()
  assert [p.name for p in protocols] == ["a", "b", "c", "d", "e", "full"]
  for p in protocols:
    assert not set(p.fit_rows) & set(p.test_rows)
    assert len(p.fit_rows) + len(p.test_rows) == 25
  by_name = {p.name: p for p in protocols}
  for name, largest in (("b", 256), ("c", 1024), ("d", 3072), ("e", 6144)):
    assert max(r.gpus for r in by_name[name].fit_rows) == largest
    assert min(r.gpus for r in by_name[name].test_rows) > largest
  assert {r.global_batch for r in by_name["c"].test_rows} == {6144}
  assert not by_name["full"].test_rows


def test_throughput_mfu_matches_the_printed_megatron_column():
  table2 = [r for r in paper.rows() if r.table == "table2"]
  for row in table2:
    ratio = row.paper_mfu / paper.throughput_mfu(row)
    if row.system == "megatron":
      assert ratio == pytest.approx(1.0, abs=0.002)
    elif row.gpus != 768:
      assert 0.988 < ratio < 0.992                     # MegaScale counts ~1% fewer FLOPs
    assert paper.target_mfu(row) == paper.throughput_mfu(row)
  lamb = [r for r in paper.rows() if r.table == "table3" and r.system == "lamb"][0]
  same = [r for r in table2 if r.system == "megascale" and r.gpus == 256][0]
  assert paper.throughput_mfu(lamb) == paper.throughput_mfu(same)
  baseline = [r for r in paper.rows() if r.system == "baseline"][0]
  assert paper.throughput_mfu(baseline) is None and paper.target_mfu(baseline) == 47.7
  assert all(paper.target_mfu(r) is None for r in paper.rows() if r.table == "fig9")


def test_time_split_recovers_a_line_and_reads_the_paper():
  tp_pp = 64

  def line(row):
    return 0.2 * row.global_batch / (row.gpus // tp_pp) + 1.5

  split = paper.time_split("megascale", 6144, line)
  assert split["per_sequence"] == pytest.approx(0.2) and split["fixed"] == pytest.approx(1.5)
  assert all(abs(r) < 1e-9 for r in split["residuals"].values())
  # The paper's own times: at batch 6,144 both systems spend more per sequence and less fixed
  # time per iteration than at batch 768 (docs/perf_model.md, 'The batch-6,144 rows').
  for system in ("megatron", "megascale"):
    small, large = paper.time_split(system, 768), paper.time_split(system, 6144)
    assert large["per_sequence"] > 1.08 * small["per_sequence"]
    assert large["fixed"] < small["fixed"] - 0.3


@pytest.mark.slow   # one of the fast tier's heaviest (a trainer run or a full search)
def test_plan_and_scaling_curves_share_the_micro_batch(capsys):
  """The issue's case: one run, one answer. plan.py's paper layout at 12,288 GPUs is the
  prediction scaling_curves makes for that row, at the same micro-batch."""
  plan.plan("175B", 12288, "a100_megascale", 0, 1, 1, constants.DEFAULT)
  line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("paper layout")][0]
  row = [r for r in paper.rows() if r.gpus == 12288 and r.system == "megascale"][0]
  pred = paper.predict_row(row)
  assert f"mb={pred.layout.micro_batch} " in line
  assert float(re.search(r"MFU ([0-9.]+)%", line).group(1)) == pytest.approx(
      100 * pred.mfu, abs=0.051)
  choices = paper.micro_batch_choices(row.model, row.gpus, row.global_batch, row.techniques)
  assert pred.mfu == max(p.mfu for p in choices) and len(choices) >= 2
  assert all(p.recompute != "full" for p in choices)


def test_constant_range_band_holds_the_prediction():
  rows = [r for r in paper.rows() if r.table == "table2" and r.system == "megascale"]
  fit_rows = rows[:4]
  out = sensitivity.constant_range_band(rows[-2:], fit_rows, A100, constants.DEFAULT,
                                        samples=3, points=3)
  assert 0 <= out["kept"] <= 3 and out["samples"] == 3
  for row, (low, high) in zip(rows[-2:], out["band"]):
    assert low <= 100 * paper.predict_row(row).mfu <= high
  for name, (lo, hi) in out["ranges"].items():
    assert constants.RANGES[name][0] <= lo <= hi <= constants.RANGES[name][1]
  assert "gemm_eff_max" not in out["ranges"]       # the level is re-pinned, not drawn


def test_profile_range_stops_where_the_fitted_rows_object():
  rows = [r for r in paper.rows() if r.table == "table2" and r.global_batch == 768]
  lo, hi = sensitivity.profile_range("nvlink_eff", rows, A100, constants.DEFAULT, points=5)
  grid = fit.grid("nvlink_eff", 5)
  assert lo in grid and hi in grid and lo <= constants.DEFAULT.nvlink_eff <= hi
