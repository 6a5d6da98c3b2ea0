"""Schedule tables in time (mscale_jax/parallel/schedule_timing.py): pass costs, timelines,
ZB-H1's bubble against the paper's formula. Pure Python."""
import random

import pytest

from mscale_jax.parallel import schedule as S

CASES = ([("1f1b", p, 1, m) for p in (2, 3, 4, 8) for m in (1, 3, 8, 17)]
         + [("gpipe", p, v, m) for p in (2, 4) for v in (1, 2) for m in (2, 8)]
         + [("interleaved_1f1b", p, v, k * p) for p in (2, 4) for v in (2, 3) for k in (1, 2, 3)]
         + [("zb_h1", p, 1, m) for p in (2, 3, 4, 8) for m in (1, 3, 8, 17)])


def _random_costs(rng, ordered=False):
  """Random pass costs; `ordered`: T_W <= T_F <= T_B, as with and without recompute."""
  f = rng.uniform(0.5, 2.0)
  if ordered:
    return {"F": f, "B": rng.uniform(f, 3 * f), "W": rng.uniform(0.2 * f, f)}
  return {"F": f, "B": rng.uniform(0.5, 3.0), "W": rng.uniform(0.3, 2.0)}


def test_pass_costs_follow_the_matmul_count():
  assert S.pass_costs("none", 2.0) == {"F": 2.0, "B": 2.0, "W": 2.0}
  assert S.pass_costs("full", 2.0) == {"F": 2.0, "B": 4.0, "W": 2.0}   # forward again in B
  with pytest.raises(ValueError, match="full, selective, none"):
    S.pass_costs("sometimes")


@pytest.mark.parametrize("schedule,p,v,m", CASES)
@pytest.mark.parametrize("latency", [0, 1])
def test_unit_timeline_is_the_tick_grid(schedule, p, v, m, latency):
  """With every pass one tick and a hop of `latency` ticks, running the orders as early as
  possible gives back the table's ticks: the grid wastes no tick its orders allow."""
  table = S.build(schedule, p, v, m, latency)
  unit = {"F": 1, "B": 1, "W": 1} if table.split_backward else {"F": 1, "B": 0.5, "W": 0.5}
  timeline = table.timeline(unit, hop=latency)
  assert timeline.starts == table.starts
  assert timeline.makespan == table.ticks and timeline.bubble == table.idle_ticks


@pytest.mark.parametrize("schedule,p,v,m", CASES)
def test_timeline_respects_dependencies_and_stage_order(schedule, p, v, m):
  rng = random.Random(hash((schedule, p, v, m)) % 1000)
  costs, hop = _random_costs(rng), rng.uniform(0.0, 0.5)
  table = S.build(schedule, p, v, m, latency=1)
  timeline = table.timeline(costs, hop)
  d = timeline.durations
  start = [dict(zip(o, st)) for o, st in zip(table.orders, timeline.starts)]
  for s in range(p):
    ends = timeline.ends(s)
    assert all(e <= nxt + 1e-12 for e, nxt in zip(ends, timeline.starts[s][1:]))   # one at a time
    for a, t in start[s].items():
      kind, i, c = a
      if kind == "W":
        assert t >= start[s][S.Action("B", i, c)] + d["B"] - 1e-12
      if kind == "B":
        assert t >= start[s][S.Action("F", i, c)] + d["F"] - 1e-12
        if (s, c) != (p - 1, v - 1):
          src, chunk = (s + 1, c) if s < p - 1 else (0, c + 1)
          assert t >= start[src][S.Action("B", i, chunk)] + d["B"] + hop - 1e-12
      if kind == "F" and (s, c) != (0, 0):
        src, chunk = (s - 1, c) if s else (p - 1, c - 1)
        assert t >= start[src][S.Action("F", i, chunk)] + d["F"] + hop - 1e-12
  # Lock-step ticks (the SPMD executor) are never faster than the same orders run freely.
  assert table.lockstep_time(costs, hop) >= timeline.makespan - 1e-9


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 6, 8) for m in (p, 2 * p + 1, 24)])
def test_zb_h1_bubble_matches_the_papers_formula(p, m):
  """Qi et al. (ICLR 2024), section 2: 1F1B idles (p-1)(T_F + T_B + T_W) per stage and ZB-H1
  (p-1)(T_F + T_B - T_W) (with T_F = T_B = T_W the authors' table: bubble rates (p-1)/m and
  (p-1)/3m). Our tables, timed with random pass costs, give exactly that when
  T_W <= T_F <= T_B (true with and without recompute, `pass_costs`; outside it the tick
  table's order, fixed for the executor, is not the best for those costs)."""
  rng = random.Random(p * 100 + m)
  zb, one = S.build("zb_h1", p, 1, m), S.build("1f1b", p, 1, m)
  for _ in range(5):
    c = _random_costs(rng, ordered=True)
    assert zb.timeline(c).bubble == pytest.approx((p - 1) * (c["F"] + c["B"] - c["W"]))
    assert one.timeline(c).bubble == pytest.approx((p - 1) * (c["F"] + c["B"] + c["W"]))
  # ... at 1F1B's memory: no stage holds more microbatches (F to W) than 1F1B's first stage.
  assert max(zb.peak_inflight) == max(one.peak_inflight)


@pytest.mark.parametrize("recompute", S.RECOMPUTES)
def test_overlap_costs_two_hops_per_stage_in_time(recompute):
  """With the hop shorter than a pass, an overlapped table's fill and drain cost 2(p-1) hops
  over the latency-0 table (what perf/iteration.py's bubble_time charges), not 2(p-1) ticks."""
  costs, hop = S.pass_costs(recompute), 0.1
  for schedule, p, v, m in (("1f1b", 4, 1, 8), ("interleaved_1f1b", 4, 2, 8), ("1f1b", 8, 1, 32),
                            ("interleaved_1f1b", 8, 3, 24)):
    plain = S.build(schedule, p, v, m, 0).timeline(costs, 0.0)
    overlapped = S.build(schedule, p, v, m, 1).timeline(costs, hop)
    assert overlapped.makespan == pytest.approx(plain.makespan + 2 * (p - 1) * hop)


def test_costs_must_be_positive():
  with pytest.raises(ValueError, match="positive"):
    S.build("zb_h1", 2, 1, 2).timeline({"F": 1.0, "B": 0.0, "W": 1.0})


def test_pipeline_schedule_record_and_picture(tmp_path):
  """experiments/pipeline_schedule.py: the record's figures and the ZB-H1 comparison come
  from the tables, and a timed picture is drawn."""
  from experiments import pipeline_schedule
  table = S.build("zb_h1", 4, 1, 8, 1)
  fig = pipeline_schedule.figures(table, hop=0.1)
  assert fig["ticks"] == table.ticks and fig["peak_inflight_per_stage"] == [7, 7, 7, 7]
  # ZB-H1 with 2 stages and 1 microbatch, timed by hand (hop 0.1; full recompute: F 1, B 2,
  # W 1): F0 [0, 1], F1 [1.1, 2.1], B1 [2.1, 4.1], W1 [4.1, 5.1] beside B0 [4.2, 6.2], then
  # W0 [6.2, 7.2]: 7.2 in all, 4 of it busy. Without recompute B is 1: 5.2, 3 busy. In ticks
  # F0 F1 B1 B0 W0 (W1 beside B0): 5.
  small = pipeline_schedule.figures(S.build("zb_h1", 2, 1, 1, 0), hop=0.1)
  assert small["ticks"] == 5
  assert small["recompute_full"]["step_free_running"] == pytest.approx(7.2)
  assert small["recompute_full"]["bubble"] == pytest.approx(3.2)
  assert small["recompute_none"]["bubble"] == pytest.approx(2.2)
  for row in pipeline_schedule.zb_h1_comparison():
    assert row["zb_h1_bubble"] == pytest.approx(row["paper_zb_h1"])
    assert row["1f1b_bubble"] == pytest.approx(row["paper_1f1b"])
    assert row["zb_h1_peak_inflight"] == row["1f1b_peak_inflight"] and row["speedup"] > 1
  path = tmp_path / "zb.png"
  pipeline_schedule.draw(table, str(path), "full", 0.1)
  assert path.stat().st_size > 10_000


def test_selective_recomputes_attentions_core_before_b():
  """'selective' runs attention's core again in B: B = F (1 + share), W = F; the share is
  the attention term of the Megatron formula (`flops.megatron_flops_per_token`: 1 + s/(6h)
  per 72 l h^2) over the whole forward."""
  from mscale_jax.flops import megatron_flops_per_token
  assert S.pass_costs("selective", 2.0, attention_core=0.25) == {"F": 2.0, "B": 2.5, "W": 2.0}
  for h, s in ((256, 256), (12288, 2048), (1024, 8192)):
    attention = megatron_flops_per_token(1, h, s, 0) - megatron_flops_per_token(1, h, 0, 0)
    share = attention / megatron_flops_per_token(1, h, s, 0)
    assert S.attention_core_share(h, s) == pytest.approx(share)
  default = S.pass_costs("selective")
  assert default["B"] == pytest.approx(1 + S.attention_core_share(12288, 2048))
  assert S.pass_costs("none")["B"] < default["B"] < S.pass_costs("full")["B"]
  with pytest.raises(ValueError, match="attention_core"):
    S.pass_costs("selective", attention_core=1.5)
