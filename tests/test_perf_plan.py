"""Layout search (experiments/plan.py) and calibration from a benchmark record."""
import json

import pytest

from experiments import plan, scaling_curves
from mscale_jax.perf import calibrate, constants, paper, search
from mscale_jax.perf.hardware import A100_MEGASCALE as A100
from mscale_jax.perf.workload import GPT_175B, validate


@pytest.mark.parametrize("gpus,batch", [(256, 768), (1024, 768), pytest.param(
    12288, 6144, marks=pytest.mark.slow)])   # the largest search: the same code, 6 s
def test_search_returns_valid_fitting_layouts(gpus, batch):
  best = search.search(GPT_175B, gpus, A100, batch, paper.MEGASCALE, top=3)
  assert best and all(p.fits for p in best)
  for pred in best:
    validate(GPT_175B, pred.layout, gpus)
    assert pred.layout.global_batch == batch
  assert [p.mfu for p in best] == sorted((p.mfu for p in best), reverse=True)
  # The paper's layout (TP=8, PP=8, 6 virtual stages) is matched or beaten.
  paper_layout = paper.row_layout(paper.Row("x", GPT_175B, "megascale", gpus, batch,
                                            paper.MEGASCALE, None))
  ref = paper.predict_row(paper.Row("x", GPT_175B, "megascale", gpus, batch, paper.MEGASCALE,
                                    None))
  assert paper_layout.tp == 8 and best[0].mfu >= ref.mfu - 1e-9


def test_larger_batch_only_with_lamb():
  no_lamb = paper.MEGASCALE.__class__(**{**paper.MEGASCALE.__dict__, "lamb": False})
  best = search.search(GPT_175B, 256, A100, 256, no_lamb, max_batch_scale=3, top=3)
  assert all(p.layout.global_batch == 256 for p in best)
  best = search.search(GPT_175B, 256, A100, 256, paper.MEGASCALE, max_batch_scale=3, top=3)
  assert best[0].layout.global_batch == 768


def test_plan_prints_and_explains(capsys):
  best = plan.plan("175B", 1024, "a100_megascale", 0, 1, 2, constants.DEFAULT)
  out = capsys.readouterr().out
  assert "global batch 768" in out and "paper layout" in out
  assert len(best) == 2


def _write_record(path, rows, kind="NVIDIA H100 80GB HBM3"):
  path.write_text(json.dumps({"name": "kernel_bench-gemm", "device": {
      "platform": "gpu", "device_kind": kind}, "figures": rows}))


def test_calibration_recovers_a_known_curve(tmp_path):
  true_max, true_edge = 0.7, 100.0
  rows = []
  for m, k, n in [(1024, 1024, 1024), (2048, 12288, 4608), (8192, 12288, 6144),
                  (256, 12288, 10752), (4096, 4096, 4096)]:
    eff = true_max / (1 + true_edge * (1 / m + 1 / k + 1 / n))
    rows.append({"m": m, "k": k, "n": n, "dtype": "bfloat16", "tflops": eff * 989.0})
  path = tmp_path / "kernel_bench-gemm-gpu-1.json"
  _write_record(path, rows)
  c, note = calibrate.calibrated(constants.DEFAULT, str(path))
  assert c.gemm_eff_max == pytest.approx(true_max, rel=1e-6)
  assert c.gemm_edge == pytest.approx(true_edge, rel=1e-6)
  assert "5 rows" in note and "H100" in note


def test_calibrated_scaling_curves_report_moves(tmp_path):
  rows = [{"m": s, "k": s, "n": s, "dtype": "bfloat16", "tflops": t, "peak_tflops": 312.0}
          for s, t in ((1024, 150.0), (4096, 220.0), (8192, 240.0))]
  path = tmp_path / "rec.json"
  _write_record(path, rows, kind="NVIDIA A100-SXM4-80GB")
  out = scaling_curves.run(str(tmp_path / "out"), calibration=str(path), intervals=False)
  assert len(out["moves"]) == len(paper.rows()) and "->" in out["moves"][0]
  assert "How calibration moved" in (tmp_path / "out" / "scaling_curves.md").read_text()


def test_sensitivity_covers_every_float_constant():
  from mscale_jax.perf import sensitivity
  rows = [r for r in paper.rows() if r.table == "table2" and r.gpus == 256]
  out = sensitivity.sensitivity(rows)
  assert {name for name, _, _ in out} == set(sensitivity.scalar_fields(constants.DEFAULT))
  assert out[0][0] == "gemm_eff_max" and out[0][1] > 1.0
