"""Inputs and presets of the goodput simulator: every input has a source, the measured one
matches its records, Llama 3's table is reproduced, and the experiment and plan.py run."""
import glob
import json
import os

import pytest

from experiments import goodput
from mscale_jax.errors import ConfigError
from mscale_jax.goodput import perf_adapter, planning, presets, simulate, sources
from mscale_jax.perf import paper
from mscale_jax.perf.workload import GPT_175B

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRILLS = os.path.join(REPO, "results", "fault_drill-*.json")


def test_every_input_says_where_it_comes_from():
  for name, i in sources.INPUTS.items():
    assert i.status in ("cited", "derived", "measured", "assumed"), name
    assert i.unit, name
    if i.status == "assumed":
      assert len(i.note) > 20, f"{name}: an assumption must say why"
    else:
      assert i.source, f"{name}: {i.status} without a source"
  table = sources.markdown_table()
  assert all(f"`{name}`" in table for name in sources.INPUTS)


def test_the_measured_exit_detection_is_the_slowest_in_the_drill_records():
  latencies = [f["detection_latency_s"] for p in glob.glob(DRILLS)
               for f in json.load(open(p))["figures"]["faults"]
               if f["kind"] in ("exited", "exception", "nonfinite")
               # an io_error's latency runs from the folder turning read-only to the failure
               # of the next save: waiting for that save is not detection; a stopped process
               # is a hang, reported by a peer's error once the coordination service timed out
               and not str(f.get("injected", "")).startswith(("io_error", "stop"))
               and not f.get("in_process")]   # a NaN rolled back in the process: no exit
  assert latencies
  assert sources.value("drill.exit_detection_s") == pytest.approx(max(latencies), abs=0.005)


def test_llama3_kinds_reproduce_its_interruption_counts():
  hours = sources.llama3_node_hours()
  assert hours == 2048 * 54 * 24
  kinds = {k.name: k for k in presets.llama3_kinds()}
  counts = {name: k.per_node_hour * hours for name, k in kinds.items()}
  assert sum(counts.values()) == pytest.approx(419 + 47)
  assert counts["planned"] == pytest.approx(47)
  assert counts["gpu"] == pytest.approx(148 + 72 + 19 + 17 + 6 + 6)
  assert {k.detected_by for k in kinds.values()} == {"exit", "hang", "planned"}
  rsc1 = presets.rsc1_kinds()
  assert sum(k.per_node_hour for k in rsc1) * 24 * 1000 == pytest.approx(6.50)
  # MegaScale's count: 100 restarts in 3 weeks on 1,536 nodes.
  count = sum(k.per_node_hour for k in presets.megascale_count_kinds()) * 1536 * 21 * 24
  assert count == pytest.approx(100)


def test_megascale_jobs_take_their_iteration_from_the_performance_model():
  step = perf_adapter.megascale_step(12288)
  job = presets.megascale_job(12288)
  assert job.iteration_s == step.iteration_s and job.gpus == 12288
  assert step.tokens_per_iteration == 6144 * 2048 and 0.4 < step.mfu < 0.7
  assert perf_adapter.megascale_batch(65536) == 32768
  with pytest.raises(ConfigError, match="rates"):
    presets.megascale_job(12288, rates="guess")
  production = presets.megascale_production_job()
  # Restore + longest replay (interval + persist) fits MegaScale's 15-minute catch-up.
  cp = production.checkpointing
  assert production.recovery.restore_s + cp.every_s + cp.persist_s == pytest.approx(900)


def test_goodput_adjusted_throughput_for_plan():
  row = paper.Row("x", GPT_175B, "megascale", 1024, 768, paper.MEGASCALE, None)
  pred = paper.predict_row(row)
  adj = planning.adjusted_throughput(1024, pred.iteration_s, 768 * 2048, seeds=range(3))
  assert adj.tokens_per_s == pytest.approx(pred.tokens_per_s)
  assert 0.8 < adj.rate < 1 and adj.goodput_tokens_per_s < adj.tokens_per_s
  line = goodput.goodput_line(pred, seeds=range(3))
  assert "goodput:" in line and "tokens per wall-clock second" in line


def test_the_experiment_replays_the_drills_and_writes_its_outputs(tmp_path):
  full = tmp_path / "goodput.md"
  full.write_text("# the full report, from a run of every section\n")
  out = goodput.run(str(tmp_path), ["drill"], seeds=2, days=1.0, drill_records=DRILLS)
  names = set(os.listdir(tmp_path))
  assert {"drill.md", "inputs.md", "drill_validation.png"} <= names
  assert out["report"] == str(tmp_path / "drill.md")
  assert "## Validation: our fault drills replayed" in (tmp_path / "drill.md").read_text()
  # A partial run leaves the full report alone.
  assert full.read_text() == "# the full report, from a run of every section\n"
  assert goodput.report_name(list(goodput.SECTIONS)) == "goodput.md"
  assert goodput.report_name(["scale", "calibration"]) == "calibration-scale.md"
  record = json.load(open(out["record"]))
  assert len(record["figures"]["drill"]["records"]) == len(glob.glob(DRILLS))
  assert record["device"]["platform"] == "model" and "inputs" in record
  with pytest.raises(ConfigError, match="questions"):
    goodput.run(str(tmp_path), ["drill", "astrology"], seeds=2, days=1.0, drill_records=DRILLS)


def test_a_policy_is_compared_on_the_same_failures():
  base = presets.megascale_job(4096, 900)
  spared = presets.megascale_job(4096, 900, policy=presets.WARM_SPARES)
  a, b = (simulate.simulate(j, seed=0, hours=24 * 14) for j in (base, spared))
  assert a.failures == b.failures and b.breakdown["replacement"] < a.breakdown["replacement"]


def test_an_overridden_input_reaches_every_policy_and_is_restored():
  before = presets.megascale_job(4096, 900, policy=presets.WARM_SPARES).recovery
  with sources.overridden("cold_replace_s", 1234.0), sources.overridden("warm_spares", 3):
    during = presets.megascale_job(4096, 900, policy=presets.WARM_SPARES).recovery
  after = presets.megascale_job(4096, 900, policy=presets.WARM_SPARES).recovery
  assert (during.cold_replace_s, during.warm_spares) == (1234.0, 3)
  assert before == after and (after.cold_replace_s, after.warm_spares) == (600, 8)
