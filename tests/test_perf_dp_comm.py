"""perf/dp_comm.py and `scaling_curves --dp_comm`: what SDP4Bit buys on a given network."""
import filecmp
import json
import os

import pytest

from experiments import scaling_curves
from mscale_jax.errors import ConfigError
from mscale_jax.perf import A100_MEGASCALE, DEFAULT, H800_DGX, Layout, ModelSpec, paper
from mscale_jax.perf import dp_comm
from mscale_jax.perf.compressed import DPCompression

MODEL = ModelSpec("1.3B", num_layers=24, hidden=2048, num_heads=16, seq_len=2048, vocab=50304)


def test_node_bandwidth_is_spread_over_the_nics():
  hw = dp_comm.at_node_gbps(A100_MEGASCALE, 400)
  assert hw.nics_per_node == 8 and hw.nic_bw == pytest.approx(400e9 / 8 / 8)
  assert dp_comm.node_gbps(hw) == pytest.approx(400)
  assert dp_comm.node_gbps(A100_MEGASCALE) == pytest.approx(1600)   # 8 x 200 Gb/s HDR
  assert dp_comm.at_node_gbps(A100_MEGASCALE, None) is A100_MEGASCALE
  with pytest.raises(ConfigError, match="node_gbps"):
    dp_comm.at_node_gbps(A100_MEGASCALE, -5)


def test_techniques_names_the_field():
  tech = paper.MEGASCALE
  assert dp_comm.techniques(tech, "none") is tech
  assert dp_comm.techniques(tech, "sdp4bit").dp_compression == DPCompression()
  with pytest.raises(ConfigError, match="dp_comm.*'int4'"):
    dp_comm.techniques(tech, "int4")


def test_comparison_differs_only_in_the_dp_collectives():
  """Same layout and recomputation; every breakdown term but the DP one is unchanged, and the
  speedup is the ratio of the iterations."""
  layout = Layout(tp=1, pp=1, vpp=1, dp=64, micro_batch=1, global_batch=64)
  hw = dp_comm.at_node_gbps(H800_DGX, 100)
  cmp = dp_comm.compare(MODEL, layout, paper.MEGASCALE, hw, DEFAULT)
  assert cmp.sdp4bit.recompute == cmp.none.recompute
  assert cmp.sdp4bit.layout == cmp.none.layout
  for key, value in cmp.none.breakdown.items():
    if key != "dp_exposed":
      assert cmp.sdp4bit.breakdown[key] == pytest.approx(value), key
  assert cmp.sdp4bit.breakdown["dp_exposed"] < cmp.none.breakdown["dp_exposed"]
  assert cmp.speedup == pytest.approx(cmp.none.iteration_s / cmp.sdp4bit.iteration_s)
  assert 0 < cmp.dp_share < 1


def test_every_row_gains_more_on_the_slower_network():
  """At the preset's bandwidth the `none` column is the row's own prediction; SDP4Bit buys
  something on every row, and more at 100 Gb/s per node than at the preset's 1,600."""
  results = scaling_curves.predict_rows(A100_MEGASCALE, DEFAULT)
  entries = scaling_curves.dp_comm_rows(results, A100_MEGASCALE, DEFAULT, (100.0, 1600.0))
  assert len(entries) == 2 * len(paper.rows())
  at = {(e["table"], e["system"], e["gpus"], e["global_batch"], e["node_gbps"]): e
        for e in entries}
  for row, pred in results:
    fast = at[(row.table, row.system, row.gpus, row.global_batch, 1600.0)]
    slow = at[(row.table, row.system, row.gpus, row.global_batch, 100.0)]
    assert fast["none_mfu"] == pytest.approx(100 * pred.mfu)
    assert fast["micro_batch"] == slow["micro_batch"] == pred.layout.micro_batch
    assert slow["speedup"] > fast["speedup"] > 1.0
    assert slow["none_dp_share"] > fast["none_dp_share"]
  default = scaling_curves.dp_comm_rows(results[:1], A100_MEGASCALE, DEFAULT)
  assert default[0]["node_gbps"] == pytest.approx(1600)


@pytest.mark.slow
def test_scaling_curves_with_sdp4bit_keeps_the_none_outputs(tmp_path):
  """--dp_comm=sdp4bit adds a section, a plot and a record; the CSV, the main record's figures
  and the rest of the markdown are those of a run without it."""
  base = scaling_curves.run(str(tmp_path / "none"), intervals=False)
  quick = scaling_curves.run(str(tmp_path / "sdp"), intervals=False, dp_comm_name="sdp4bit",
                             node_gbps=(100.0, 1600.0))
  assert base["sdp4bit"] is None and "sdp4bit_record" not in base["paths"]
  assert filecmp.cmp(base["paths"]["scaling_curves.csv"], quick["paths"]["scaling_curves.csv"],
                     shallow=False)
  records = [json.load(open(out["paths"]["record"])) for out in (base, quick)]
  assert records[0]["figures"] == records[1]["figures"]
  md_none = open(base["paths"]["scaling_curves.md"]).read()
  md_sdp = open(quick["paths"]["scaling_curves.md"]).read()
  assert md_sdp.startswith(md_none) and "`--dp_comm=sdp4bit`" in md_sdp[len(md_none):]
  assert os.path.getsize(quick["paths"]["sdp4bit_mfu_vs_gpus.png"]) > 1000

  record = json.load(open(quick["paths"]["sdp4bit_record"]))
  assert record["preset_node_gbps"] == pytest.approx(1600)
  assert len(record["figures"]) == 2 * len(paper.rows())


@pytest.mark.parametrize("values", [["fast"], ["100", "0"], ["-3"]])
def test_node_gbps_flag_values_are_config_errors(values):
  with pytest.raises(ConfigError, match="node_gbps"):
    scaling_curves.gbps_list(values)
  assert scaling_curves.gbps_list(["100", "1600"]) == (100.0, 1600.0)


def test_scaling_curves_cli_exits_2_on_a_bad_bandwidth(tmp_path):
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-m", "experiments.scaling_curves",
                           f"--out_dir={tmp_path}", "--nointervals", "--dp_comm=sdp4bit",
                           "--node_gbps=fast"], cwd=repo, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 2
  assert "node_gbps" in result.stderr and not os.listdir(tmp_path)


def test_a_faster_node_never_makes_sdp4bit_buy_more():
  layout = Layout(tp=1, pp=1, vpp=1, dp=128, micro_batch=1, global_batch=128)
  speedups = [dp_comm.compare(MODEL, layout, paper.MEGASCALE,
                              dp_comm.at_node_gbps(H800_DGX, g)).speedup
              for g in (50, 200, 800, 3200)]
  assert speedups == sorted(speedups, reverse=True) and speedups[-1] < speedups[0]


def test_scaling_curves_none_is_the_like_for_like_baseline_on_every_paper_row():
  """TP fills the node on every row, so `none`'s rings are the uncompressed two-level schedule
  to the last bit: the section's speedups are SDP4Bit's gain alone."""
  from mscale_jax.perf.iteration import dp_times
  for row, pred in scaling_curves.predict_rows(A100_MEGASCALE, DEFAULT):
    assert pred.layout.tp == A100_MEGASCALE.devices_per_node
    assert dp_times(row.model, pred.layout, A100_MEGASCALE, DEFAULT) == dp_times(
        row.model, pred.layout, A100_MEGASCALE, DEFAULT, DPCompression.uncompressed())


def test_none_at_tp1_is_the_nvlink_bound_ring_not_the_two_level_sum():
  """1.3B at TP=1 on H800 nodes (8 DP ranks per node, 16 nodes): NCCL's ring pays its
  busiest link, NVLink at 200 GB/s x 0.82 x 8/7 (the NICs would allow 8 x 50 x 0.78 = 312 GB/s),
  while the two-level schedule pays its intra-node level (7/8 of the buffer at 164 GB/s) and
  then its inter-node one (15/16 of an eighth at 39 GB/s) one after the other."""
  from mscale_jax.perf.iteration import dp_times
  from mscale_jax.perf.memory import params_per_device
  layout = Layout(tp=1, pp=1, vpp=1, dp=128, micro_batch=1, global_batch=128)
  grads = params_per_device(MODEL, layout) * 4.0          # fp32 gradients, bytes
  nvlink, nic = 200e9 * 0.82, 50e9 * 0.78
  ring = 127 * 15e-6 + 127 / 128 * grads * 7 / 8 / nvlink
  two_level = 7 * 8e-6 + 7 / 8 * grads / nvlink + 15 * 15e-6 + 15 / 16 * grads / 8 / nic
  rs, _ = dp_times(MODEL, layout, H800_DGX, DEFAULT)
  rs2, _ = dp_times(MODEL, layout, H800_DGX, DEFAULT, DPCompression.uncompressed())
  assert rs == pytest.approx(ring) and rs2 == pytest.approx(two_level)
  assert rs < rs2 < 127 / 128 * grads / nic               # the last: a flat ring's time
