"""The reproduction targets: paper Table 3 and the batch-768 rows of Table 2, one constant set."""
import csv
import dataclasses
import json
import math
import os

import pytest

from experiments import scaling_curves
from mscale_jax.perf import constants, fit, iteration, paper
from mscale_jax.perf.hardware import A100_MEGASCALE

TARGET_POINTS = 1.5
FITTED = [r for r in paper.rows() if scaling_curves.fitted(r)]
REPRODUCED = [r for r in FITTED if r.global_batch != 6144]


@pytest.mark.parametrize("row", REPRODUCED, ids=lambda r: f"{r.table}-{r.system}-{r.gpus}")
def test_row_within_target(row):
  pred = paper.predict_row(row)
  assert pred.fits
  assert abs(100 * pred.mfu - paper.target_mfu(row)) <= TARGET_POINTS, (row, 100 * pred.mfu)


def test_batch_6144_rows_within_three_points():
  """Fitted too, but the model reaches them less well: the worst is Megatron-LM at 6,144 GPUs,
  which the paper puts above its own neighbours (docs/perf_model.md)."""
  errors = {(r.system, r.gpus): 100 * paper.predict_row(r).mfu - paper.target_mfu(r)
            for r in FITTED if r.global_batch == 6144}
  assert len(errors) == 8 and all(abs(e) <= 3.0 for e in errors.values()), errors


def test_rows_cover_the_paper():
  names = [r.system for r in paper.rows() if r.table == "table3"]
  assert names == ["baseline", "parallel_block", "sliding_window", "tp_overlap", "pp_overlap",
                   "dp_overlap", "efficient_ops", "misc", "lamb"]
  table2 = {(r.system, r.gpus, r.global_batch) for r in paper.rows() if r.table == "table2"}
  assert table2 == {(s, g, b) for s in ("megatron", "megascale")
                    for b, gpus in ((768, (256, 512, 768, 1024)), (6144, (3072, 6144, 8192, 12288)))
                    for g in gpus}
  assert all(r.paper_mfu is not None for r in paper.rows() if r.table == "table2")
  fig9 = {(r.model.name, r.gpus, r.global_batch) for r in paper.rows() if r.table == "fig9"}
  assert fig9 == {("530B", g, g) for g in (2240, 4480, 11200)}


def test_one_constant_set_for_every_row(monkeypatch):
  """Every row is predicted with the same Constants object; rows carry no factors."""
  seen = []
  real = iteration.predict

  def spy(model, layout, tech, hw, c=constants.DEFAULT, **kw):
    seen.append(c)
    return real(model, layout, tech, hw, c, **kw)

  monkeypatch.setattr(paper, "predict", spy)
  results = scaling_curves.predict_rows(A100_MEGASCALE, constants.DEFAULT)
  assert len(results) == len(paper.rows()) and len(seen) >= len(results)  # a call per mb
  assert all(c is constants.DEFAULT for c in seen)
  # A row holds only what the paper varied: no field could carry a per-row correction.
  assert [f.name for f in dataclasses.fields(paper.Row)] == [
      "table", "model", "system", "gpus", "global_batch", "techniques", "paper_mfu"]
  # Every constant is a plain scalar or tuple: nothing keyed by row or table.
  for f in dataclasses.fields(constants.Constants):
    assert isinstance(getattr(constants.DEFAULT, f.name), (int, float, tuple)), f.name


def test_switches_differ_only_as_documented():
  steps = paper.ablation_steps()
  for (_, prev, _, _), (name, cur, _, _) in zip(steps, steps[1:]):
    changed = [f.name for f in dataclasses.fields(cur) if getattr(cur, f.name) !=
               getattr(prev, f.name)]
    expected = {"misc": ["async_data"]}.get(name, [name])
    assert changed == expected
  assert steps[-1][1] == paper.MEGASCALE
  for row in paper.rows():
    if row.table != "table3":
      assert row.techniques in (paper.MEGATRON, paper.MEGASCALE)


def test_larger_runs_are_predicted():
  for row in paper.rows():
    if row.table == "fig9":
      pred = paper.predict_row(row)
      assert pred.fits and 0.2 < pred.mfu < 0.8 and math.isfinite(pred.iteration_s)


def test_scaling_curves_writes_outputs(tmp_path):
  validations = fit.validate(points=3, names={"c", "e"})
  out = scaling_curves.run(str(tmp_path), points=3, samples=2, validations=validations)
  with open(tmp_path / "scaling_curves.csv") as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0]) == list(scaling_curves.CSV_COLUMNS)
  assert list(rows[0])[:9] == ["table", "model", "system", "gpus", "global_batch",
                               "predicted_mfu", "paper_mfu", "predicted_low", "predicted_high"]
  assert "fitted" in rows[0]
  assert len(rows) == len(paper.rows())
  kept = {(r["model"], int(r["gpus"]), int(r["global_batch"])) for r in rows}
  assert {("175B", g, 6144) for g in (3072, 6144, 8192, 12288)} <= kept
  assert {("530B", g, g) for g in (2240, 4480, 11200)} <= kept
  assert {r["fitted"] for r in rows if r["paper_mfu"]} == {"yes"}
  assert {r["fitted"] for r in rows if not r["paper_mfu"]} == {"no"}
  # Every interval holds its micro-batch range, which holds the prediction; it widens with
  # the extrapolation distance (530B: model size and batch beyond what was fitted).
  width = {}
  for r in rows:
    low, nl, mid, nh, high = (float(r[k]) for k in ("predicted_low", "micro_batch_low",
                                                     "predicted_mfu", "micro_batch_high",
                                                     "predicted_high"))
    assert low < nl <= mid <= nh < high and high - low < 15
    assert float(r["constants_low"]) <= mid <= float(r["constants_high"])
    width[(r["model"], r["system"], int(r["gpus"]))] = (high - nh) + (nl - low)
  assert width[("530B", "megascale", 4480)] > width[("175B", "megascale", 256)]
  md = (tmp_path / "scaling_curves.md").read_text()
  assert "| table3 | 175B | baseline | 256 | 256 | yes | 47.7 |" in md
  assert "530B (Figure 9) against 175B" in md
  for name in ("mfu_vs_gpus.png", "ablation_waterfall.png"):
    assert os.path.getsize(tmp_path / name) > 1000
  with open(out["paths"]["record"]) as f:
    record = json.load(f)
  assert record["device"]["platform"] == "model" and len(record["figures"]) == len(rows)
  assert record["intervals"]["nominal"] == 0.8
