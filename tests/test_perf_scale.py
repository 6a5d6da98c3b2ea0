"""Scale effects (stragglers, slow nodes, ECMP collisions, launch skew), the fit and validation."""
import dataclasses
import itertools
import math

import pytest

from experiments import scaling_curves, scaling_validation
from mscale_jax.perf import comm, constants, fit, iteration, paper, scale
from mscale_jax.perf.constants import DEFAULT
from mscale_jax.perf.hardware import A100_MEGASCALE as A100
from mscale_jax.perf.workload import GPT_175B, Layout

SWITCHES = ("stragglers", "slow_nodes", "ecmp_collisions", "launch_skew")
ALL_OFF = dataclasses.replace(DEFAULT, **{s: False for s in SWITCHES})


def only(switch):
  """DEFAULT with every scale effect off but `switch`."""
  return dataclasses.replace(ALL_OFF, **{switch: True})


def weak_scaling(dp):
  """175B at TP=8, PP=8, v=6 with 48 micro-batches of 1 per pipeline: only DP grows."""
  return Layout(8, 8, 6, dp, 1, 48 * dp)


def iteration_s(layout, c):
  return iteration.predict(GPT_175B, layout, paper.MEGASCALE, A100, c).iteration_s


def test_expected_max_of_normals_and_exponentials():
  assert scale.expected_max_std_normal(1) == 0.0
  assert scale.expected_max_std_normal(100) == pytest.approx(2.5076, rel=0.01)   # tabulated
  values = [scale.expected_max_std_normal(n) for n in (2, 8, 256, 1024, 12288)]
  assert values == sorted(values) and values[-1] < math.sqrt(2 * math.log(12288))
  assert scale.harmonic(4) == pytest.approx(1 + 1 / 2 + 1 / 3 + 1 / 4)
  exact = sum(1.0 / k for k in range(1, 1001))
  assert scale.harmonic(1000) == pytest.approx(exact, rel=1e-9)    # the asymptotic branch


def test_slowest_flow_share_matches_enumeration():
  # 3 flows hashed onto 2 uplinks, every assignment equally likely; a flow gets
  # min(1, speedup / flows on its uplink), the ring the slowest flow's share.
  for speedup in (1.0, 2.0):
    shares = []
    for assignment in itertools.product(range(2), repeat=3):
      loads = [assignment.count(u) for u in range(2)]
      shares.append(min(1.0, speedup / max(loads)))
    assert scale._slowest_flow_share(3, 2, speedup) == pytest.approx(sum(shares) / len(shares))


@pytest.mark.parametrize("switch", ["stragglers", "slow_nodes"])
def test_straggler_loss_grows_with_ranks_and_is_zero_when_off(switch):
  losses = []
  for dp in (4, 16, 64, 192):
    on, off = iteration_s(weak_scaling(dp), only(switch)), iteration_s(weak_scaling(dp), ALL_OFF)
    losses.append(on / off - 1.0)
    assert iteration.predict(GPT_175B, weak_scaling(dp), paper.MEGASCALE, A100,
                             ALL_OFF).breakdown["stragglers"] == 0.0
  assert all(x > 0 for x in losses) and losses == sorted(losses)
  assert losses[-1] > 1.2 * losses[0]


def test_launch_skew_grows_with_ranks_and_is_zero_when_off():
  skews = [iteration.predict(GPT_175B, weak_scaling(dp), paper.MEGASCALE, A100,
                             only("launch_skew")).breakdown["launch_skew"] for dp in (4, 64, 192)]
  assert 0 < skews[0] < skews[1] < skews[2]
  n = weak_scaling(192).devices
  assert skews[2] == pytest.approx(DEFAULT.dp_sync_points * DEFAULT.launch_delay_s
                                   * (sum(1.0 / k for k in range(1, n + 1)) - 1.0))
  assert scale.launch_skew_s(n, 1, DEFAULT) == 0.0      # no data parallelism, no DP collective
  assert scale.launch_skew_s(n, 192, ALL_OFF) == 0.0


def test_dp_collectives_crossing_more_tiers_cost_more():
  # One device's reduce-scatter + all-gather: DP=48 stays under one ToR (384 GPUs apart at
  # most), DP=96 crosses the aggregation tier, DP=1024 the spine.
  tiers, exposed = [], []
  for dp in (48, 96, 1024):
    layout = weak_scaling(dp)
    tiers.append(comm.group_link(A100, dp, 8, DEFAULT).tier)
    on, off = (sum(iteration.dp_times(GPT_175B, layout, A100, c)) for c in (DEFAULT, ALL_OFF))
    exposed.append(on / off)
  assert tiers == ["tor", "aggregation", "spine"]
  assert exposed[0] == 1.0 and 1.0 < exposed[1] < exposed[2]
  share = scale.ecmp_share(DEFAULT)
  assert 0.5 < share < 1.0 and scale.ecmp_share(ALL_OFF) == 1.0
  assert scale.tier_bandwidth_share(A100, "spine", DEFAULT) == pytest.approx(share ** 2)
  more_flows = dataclasses.replace(DEFAULT, ecmp_flows=32.0)
  assert scale.ecmp_share(more_flows) < share
  # And MFU falls: Megatron-LM (no DP overlap) at 12,288 GPUs loses more with ECMP on.
  row = [r for r in paper.rows() if r.gpus == 12288 and r.system == "megatron"][0]
  assert paper.predict_row(row, c=only("ecmp_collisions")).mfu < paper.predict_row(
      row, c=ALL_OFF).mfu


def test_all_switches_off_removes_every_scale_term():
  for dp in (4, 192):
    pred = iteration.predict(GPT_175B, weak_scaling(dp), paper.MEGASCALE, A100, ALL_OFF)
    assert pred.breakdown["stragglers"] == 0.0 and pred.breakdown["launch_skew"] == 0.0
  assert scale.straggler_stretch(12288, A100, ALL_OFF) == 0.0


def test_fit_recovers_known_constants():
  rows = [r for r in paper.rows() if r.table == "table2"][:4] + [
      r for r in paper.rows() if r.table == "table3"][:3]
  truth = dataclasses.replace(DEFAULT, nvlink_eff=fit.grid("nvlink_eff", 5)[1],
                              host_per_iteration_s=fit.grid("host_per_iteration_s", 5)[3])
  # Rows of no table: their figure is the synthetic one (no paper throughput replaces it).
  synthetic = [dataclasses.replace(r, table="synthetic",
                                   paper_mfu=100 * paper.predict_row(r, c=truth).mfu)
               for r in rows]
  result = fit.fit(synthetic, names=("nvlink_eff", "host_per_iteration_s"), points=5)
  assert result.rms < 1e-9
  assert result.constants.nvlink_eff == truth.nvlink_eff
  assert result.constants.host_per_iteration_s == truth.host_per_iteration_s


def test_defaults_are_a_grid_minimum_of_the_full_fit():
  """No fitted constant moved alone to another grid value, nor two by one step each, improves
  the full fit's RMS: DEFAULT satisfies `fit.fit`'s stopping rule on every row with a figure."""
  rows = scaling_curves.fit_rows(paper.rows())
  assert len(rows) == 25
  best = fit.rms(fit.errors(rows, A100, DEFAULT))
  for name in constants.FITTED:
    lo, hi = constants.RANGES[name]
    assert lo <= getattr(DEFAULT, name) <= hi and getattr(DEFAULT, name) in fit.grid(name)
    for value in fit.grid(name):
      trial = dataclasses.replace(DEFAULT, **{name: value})
      assert fit.rms(fit.errors(rows, A100, trial)) >= best - 1e-9, (name, value)
  grids = {name: fit.grid(name) for name in constants.FITTED}
  for change in fit._pair_steps(DEFAULT, grids):        # the fit's stopping rule, pairwise
    trial = dataclasses.replace(DEFAULT, **change)
    assert fit.rms(fit.errors(rows, A100, trial)) >= best - 1e-9, change


def test_validate_mode_runs(tmp_path):
  validations = fit.validate(points=3, names={"c", "e"})
  out = scaling_validation.run_validation(str(tmp_path), points=3, compare_off=False,
                                          validations=validations)
  c, e = out["validations"]
  assert {r.global_batch for r in c.fit.rows} == {256, 768}
  assert {h.row.global_batch for h in c.held_out} == {6144} and len(c.counted) == 8
  for v in out["validations"]:
    assert not any(h.row in v.fit.rows for h in v.held_out)
    for h in v.counted:
      assert h.low <= h.target + h.error <= h.high          # the rule's MFU is in its range
      assert h.distance > 0 and math.isfinite(h.error)
  assert 0.0 <= out["coverage"]["pooled"] <= 1.0
  text = (tmp_path / "validation.md").read_text()
  assert "| c: fit batch 768, predict batch 6,144 | 17 |" in text
  assert "The paper's own times, split" in text


def test_refit_level_repins_the_mean_error_to_zero():
  rows = [r for r in paper.rows() if r.table == "table2"]
  for start in constants.RANGES["gemm_eff_max"]:
    moved = dataclasses.replace(DEFAULT, gemm_eff_max=start, gpu_time_cv=0.015)
    c = fit.refit_level(rows, A100, moved)
    assert abs(sum(fit.errors(rows, A100, c)) / len(rows)) < 1e-3
    assert c.gemm_eff_max != start and c.gpu_time_cv == 0.015
