"""experiments/sdp4bit_speedup.py: the paper's speed-test setups and what SDP4Bit buys on them."""
import glob
import json
import os
import subprocess
import sys

import pytest

from experiments import sdp4bit_speedup as sp
from mscale_jax.errors import ConfigError
from mscale_jax.perf.compressed import DPCompression, bytes_per_value

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", list(sp.MODELS))
def test_model_shapes_have_the_size_their_name_says(name):
  """12 L h^2 + V h parameters within 5% of the name (1.3B ... 18B): the cards were read right."""
  m = sp.MODELS[name]
  params = 12 * m.num_layers * m.hidden ** 2 + m.vocab * m.hidden
  assert params == pytest.approx(float(name[:-1]) * 1e9, rel=0.05)


def test_layouts_follow_the_readme_table():
  """TP/PP as the README's table; accumulation step 1 and micro-batch 1: batch = DP size."""
  assert sp.PARALLEL["h800"]["13B"] == (8, 1) and sp.PARALLEL["a100"]["18B"] == (4, 2)
  assert {sp.PARALLEL[c]["6.7B"] for c in sp.CLUSTERS} == {(4, 1)}
  for cluster in sp.CLUSTERS:
    for model in sp.MODELS:
      lay = sp.layout(model, cluster, 128)
      tp, pp = sp.PARALLEL[cluster][model]
      assert lay.tp * lay.pp * lay.dp == 128 and (lay.tp, lay.pp) == (tp, pp)
      assert lay.num_micro_batches == 1 and lay.micro_batch == 1
      assert lay.tp <= sp.CLUSTERS[cluster].hardware.devices_per_node
  with pytest.raises(ConfigError, match="gpus"):
    sp.layout("18B", "a100", 12)


@pytest.mark.parametrize("cluster,model", [("h800", "1.3B"), ("a100", "18B")])
def test_speedup_falls_with_bandwidth_and_stays_below_the_byte_ratio(cluster, model):
  """While the baseline's ring is network-bound, more bandwidth never makes SDP4Bit buy more;
  the speedup never exceeds what the bytes allow (fp32 gradients + bf16 weights against the
  4-bit codes with their scales)."""
  q = DPCompression()
  ratio = (4 + 2) / (bytes_per_value(q.grad_bits_inter, q.grad_group)
                     + bytes_per_value(q.weight_bits, q.weight_group))
  speedups = [sp.speedup(model, cluster, 128, g)["speedup"] for g in (25, 200, 1600, 12800)]
  assert all(1.0 < s < ratio for s in speedups)
  assert speedups[:3] == sorted(speedups[:3], reverse=True)


def test_past_the_nvlink_bound_the_ring_stops_gaining_and_sdp4bit_gains_again():
  """1.3B at TP=1 on H800 nodes (8 DP ranks per node): NCCL's ring is NIC-bound up to
  200 x 0.82 x 8/7 / 0.78 x 8 = 1,922 Gb/s per node, NVLink-bound above; SDP4Bit's inter-node
  level, run after its intra-node one, keeps shrinking, so its speedup turns up there. With
  TP=8 (one rank per node) no NVLink bound applies and the speedup keeps falling."""
  bound = 200 * 0.82 * 8 / 7 / 0.78 * 8
  base = [sp.speedup("1.3B", "h800", 128, g)["baseline_s"] for g in (1600, bound, 2 * bound)]
  assert base[0] > base[1] == pytest.approx(base[2], rel=1e-12)
  up = [sp.speedup("1.3B", "h800", 128, g)["speedup"] for g in (bound, 4 * bound)]
  assert up[1] > up[0]
  flat = [sp.speedup("13B", "h800", 128, g)["speedup"] for g in (bound, 4 * bound)]
  assert flat[1] < flat[0]


def test_the_two_level_schedule_is_the_baseline_only_with_one_rank_per_node():
  """TP=8 on nodes of 8 (13B on H800) or TP=4 on nodes of 4 (6.7B on A100): the uncompressed
  two-level schedule is the ring; with TP=1 it is slower than the ring."""
  for model, cluster in (("13B", "h800"), ("6.7B", "a100")):
    r = sp.speedup(model, cluster, 64, 400.0)
    assert r["two_level_s"] == r["baseline_s"] and r["speedup_over_two_level"] == r["speedup"]
  r = sp.speedup("1.3B", "h800", 64, 400.0)
  assert r["two_level_s"] > r["baseline_s"] and r["speedup_over_two_level"] > r["speedup"]


def test_summary_and_implied_bandwidth_agree_with_the_rows():
  rows = sp.sweep([64, 128], [50.0, 200.0, 800.0, 3200.0])
  summary = sp.summarize(rows)
  for cluster, s in summary.items():
    mine = [r for r in rows if r["cluster"] == cluster]
    reach = s["highest_gbps_reaching_headline"]
    assert reach["speedup"] >= sp.PAPER_HEADLINE
    assert all(r["speedup"] < sp.PAPER_HEADLINE for r in mine if r["node_gbps"] > reach["node_gbps"])
    in_range = [r["speedup"] for r in mine if r["gpus"] == 128 and r["plausible"]]
    assert s["min_in_range"]["speedup"] == min(in_range)
    assert s["max_in_range"]["speedup"] == max(in_range)
    assert s["headline_reached_in_range"] == (max(in_range) >= sp.PAPER_HEADLINE)
    implied = sp.implied_gbps(cluster)
    best = max(sp.speedup(m, cluster, 128, implied["node_gbps"])["speedup"] for m in sp.MODELS)
    assert best == pytest.approx(sp.PAPER_HEADLINE, rel=1e-6)
    assert sp.implied_gbps(cluster, target=100.0)["node_gbps"] is None


def test_cli_writes_a_record_with_its_sources_and_a_plot(tmp_path):
  result = subprocess.run([sys.executable, "-m", "experiments.sdp4bit_speedup",
                           f"--out_dir={tmp_path}", "--gpus=64,128", "--node_gbps=100,1600"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-2000:]
  record = json.load(open(glob.glob(str(tmp_path / "sdp4bit_speedup-*.json"))[0]))
  assert len(record["figures"]["rows"]) == 2 * len(sp.MODELS) * 2 * 2
  assert "speed_test_table.png" in record["not_read"]
  assert set(record["clusters"]) == {"h800", "a100"} and record["paper_headline_speedup"] == 4.08
  assert os.path.getsize(glob.glob(str(tmp_path / "sdp4bit_speedup-*.png"))[0]) > 1000
  assert "the headline implies" in result.stdout
  bad = subprocess.run([sys.executable, "-m", "experiments.sdp4bit_speedup",
                        f"--out_dir={tmp_path}", "--gpus=12"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert bad.returncode == 2 and "gpus" in bad.stderr
