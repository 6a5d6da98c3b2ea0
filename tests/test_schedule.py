"""Properties of the pipeline schedule tables (mscale_jax/parallel/schedule.py), pure Python."""
import itertools

import pytest

from mscale_jax.errors import ConfigError
from mscale_jax.parallel import schedule as S

# (schedule, stages, virtual, microbatches) over many shapes; interleaved needs p | m.
CASES = ([("gpipe", p, v, m) for p in (2, 3, 4, 8) for v in (1, 2, 3) for m in (1, 2, 5, 8, 16)]
         + [("1f1b", p, 1, m) for p in (2, 3, 4, 5, 8) for m in (1, 2, 3, 7, 8, 16, 33)]
         + [("interleaved_1f1b", p, v, k * p) for p in (2, 3, 4, 8) for v in (2, 3, 4)
            for k in (1, 2, 3, 5)]
         + [("zb_h1", p, 1, m) for p in (2, 3, 4, 5, 8) for m in (1, 2, 3, 7, 8, 16, 33)])


def _all_cases(latencies=(0, 1)):
  return [case + (lat,) for case in CASES for lat in latencies]


@pytest.mark.parametrize("schedule,p,v,m,latency", _all_cases())
def test_every_pass_once_and_after_its_dependencies(schedule, p, v, m, latency):
  table = S.build(schedule, p, v, m, latency)
  kinds = "FBW" if schedule == "zb_h1" else "FB"
  want = {S.Action(kind, i, c) for kind in kinds for i in range(m) for c in range(v)}
  for s in range(p):
    row = [a for a in table.grid[s] if a is not None]
    assert len(row) == len(want) and set(row) == want        # each exactly once
    for t, action in enumerate(table.grid[s]):
      if action is None:
        continue
      i, c = action.microbatch, action.chunk
      if action.kind == "B":
        assert table.tick_of(s, S.Action("F", i, c)) < t
      if action.kind == "W":                                  # same stage, after its B
        assert table.tick_of(s, S.Action("B", i, c)) < t
      # The neighbour this pass waits for ran at least 1 + latency ticks before.
      if action.kind == "F" and (s, c) != (0, 0):
        src, chunk = (s - 1, c) if s else (p - 1, c - 1)
        assert table.tick_of(src, S.Action("F", i, chunk)) + 1 + latency <= t
      if action.kind == "B" and (s, c) != (p - 1, v - 1):
        src, chunk = (s + 1, c) if s < p - 1 else (0, c + 1)
        assert table.tick_of(src, S.Action("B", i, chunk)) + 1 + latency <= t


@pytest.mark.parametrize("schedule,p,v,m,latency", _all_cases())
def test_messages_connect_each_pass_to_its_consumer(schedule, p, v, m, latency):
  table = S.build(schedule, p, v, m, latency)
  received = {}
  for msg in table.messages:
    key = (msg.dst, S.Action(msg.kind, msg.microbatch, msg.chunk))
    assert key not in received
    received[key] = msg
    assert msg.ready == msg.sent + 1 + latency
    assert msg.ready <= table.tick_of(msg.dst, key[1])       # arrives before it is used
  # Every forward but the model's first and every backward but its last gets one message.
  assert len(received) == 2 * (p * v - 1) * m


@pytest.mark.parametrize("schedule,p,v,m", [c for c in CASES if c[0] != "zb_h1"
                                                if c[2] == 1 or c[3] >= c[1]])
def test_bubble_fraction_without_latency(schedule, p, v, m):
  """(p-1)/(v*m) for interleaved 1F1B, (p-1)/m for 1F1B and GPipe (v=1). With v > 1 and
  fewer microbatches than stages, chunk c+1 would wait for the wrap-around: not a case here."""
  table = S.build(schedule, p, v, m, latency=0)
  assert table.ticks == 2 * v * m + 2 * (p - 1)
  assert table.bubble_fraction == pytest.approx((p - 1) / (v * m), abs=1e-12)


def _fill_and_drain_bound(table) -> int:
  """No table is shorter: the last stage can start no earlier than its first input's p-1 hops
  of 1 + latency ticks, then computes all its actions, and its last backward (of some
  microbatch's first chunk: every other backward of that microbatch precedes it there) still
  has p-1 hops back to stage 0."""
  return table.busy_ticks + 2 * (table.stages - 1) * (1 + table.latency)


@pytest.mark.parametrize("schedule,p,v,m", [c for c in CASES if c[0] != "zb_h1"
                                                if c[0] != "gpipe" or c[3] >= 2 * c[1]])
def test_overlapped_tables_cost_only_the_fill_and_drain(schedule, p, v, m):
  """A tick of latency per hop costs 2(p-1) ticks in the fill and the drain, which no schedule
  avoids (`_fill_and_drain_bound`); the list-scheduled tables pay nothing more in the steady
  state (Megatron's fixed interleaved order paid 2(v-1)p more: 52 ticks against 44 at p=4,
  v=2, m=8). Interleaving with m = p cannot cover a 2p-tick wrap-around with p microbatches
  and pays 2(v-1)p at each of its v-1 wrap-arounds forward and back."""
  table, plain = S.build(schedule, p, v, m, latency=1), S.build(schedule, p, v, m, latency=0)
  wrap = 2 * (v - 1) * p if (schedule == "interleaved_1f1b" and m == p) else 0
  assert table.ticks == _fill_and_drain_bound(table) + wrap
  assert table.ticks == plain.ticks + 2 * (p - 1) + wrap


@pytest.mark.parametrize("p,m", list(itertools.product((2, 3, 4, 8), (1, 3, 8, 16, 32))))
def test_peak_inflight_1f1b_at_most_p_gpipe_m(p, m):
  one_f_one_b = S.build("1f1b", p, 1, m).peak_inflight
  assert one_f_one_b == tuple(min(p - s, m) for s in range(p))
  assert max(one_f_one_b) <= p
  assert S.build("gpipe", p, 1, m).peak_inflight == (m,) * p
  # With a tick of latency 1F1B warms up twice as deep: still independent of m.
  assert max(S.build("1f1b", p, 1, m, latency=1).peak_inflight) <= 2 * p - 1


@pytest.mark.parametrize("p,v", list(itertools.product((2, 4, 8), (2, 3, 4))))
def test_interleaved_peak_matches_korthikanti(p, v):
  """Stage 0 stashes p*v + p - 1 chunk inputs: p microbatches of all its layers plus
  (p-1)/(p*v) more (Korthikanti et al. 2022, section 4.2.3)."""
  for m in (2 * p, 4 * p):
    peak = S.build("interleaved_1f1b", p, v, m).peak_inflight
    assert peak[0] == p * v + p - 1
    assert list(peak) == sorted(peak, reverse=True)


@pytest.mark.parametrize("schedule,p,v", [("1f1b", 4, 1), ("1f1b", 7, 1), ("gpipe", 3, 2),
                                          ("interleaved_1f1b", 4, 2), ("interleaved_1f1b", 5, 3),
                                          ("zb_h1", 4, 1), ("zb_h1", 7, 1)])
@pytest.mark.parametrize("latency", [0, 1])
def test_summary_equals_the_full_table(schedule, p, v, latency):
  for k in (1, 2, 3, 6, 11):
    m = k * p
    table = S.build(schedule, p, v, m, latency)
    assert S.summary(schedule, p, v, m, latency) == (table.idle_ticks, table.peak_inflight)


def test_megatron_warmup_counts():
  assert [S.warmup_forwards("interleaved_1f1b", 4, 2, 8, s) for s in range(4)] == [10, 8, 6, 4]
  assert [S.warmup_forwards("1f1b", 4, 1, 8, s) for s in range(4)] == [3, 2, 1, 0]
  assert S.warmup_forwards("gpipe", 4, 1, 8, 2) == 8


@pytest.mark.parametrize("args,words", [
    (("zero_bubble", 2, 1, 4), "one of"),
    (("1f1b", 2, 2, 4), "virtual=1"),
    (("zb_h1", 2, 2, 4), "virtual=1"),
    (("interleaved_1f1b", 4, 2, 6), "microbatches=6 .* multiple of stages=4"),
    (("gpipe", 0, 1, 4), "positive"),
    (("gpipe", 2, 1, 4, 2), "latency"),
])
def test_refuses_what_cannot_run(args, words):
  with pytest.raises(ConfigError, match=words):
    S.build(*args)


def test_large_tables_are_fast_enough_for_planners():
  """The perf model asks for p up to ~35, v up to 8, m in the hundreds: summary() answers from
  a 2p-microbatch table (no timing asserted; this only has to finish)."""
  idle, peak = S.summary("interleaved_1f1b", 32, 8, 512)
  assert idle == 2 * 31 and peak[0] == 32 * 8 + 31


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 5, 8) for m in (2, 3, 7, 8, 16, 33)
                                 if m >= p])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_the_same_peak(p, m):
  """ZB-H1 (Qi et al., ICLR 2024): with T_F = T_B = T_W the authors give a bubble rate of
  (p-1)/(3m) against 1F1B's (p-1)/m, at 1F1B's activation memory. In ticks (F, B, W one each)
  that is p-1 idle ticks per stage (1F1B idles 2(p-1) ticks of F or whole backward), with
  at most 1F1B's first-stage peak of min(m, p) microbatches in flight (F to W) on any stage."""
  zb, ref = S.build("zb_h1", p, 1, m), S.build("1f1b", p, 1, m)
  assert zb.busy_ticks == 3 * m and zb.idle_ticks == p - 1
  assert zb.idle_ticks / zb.busy_ticks == pytest.approx((p - 1) / (3 * m))
  assert max(zb.peak_inflight) == max(ref.peak_inflight) == p


@pytest.mark.parametrize("p,m,latency", list(itertools.product((2, 4, 8), (4, 8, 16), (0, 1))))
def test_zb_h1_w_sends_nothing_and_b_sends_upstream(p, m, latency):
  table = S.build("zb_h1", p, 1, m, latency)
  assert {msg.kind for msg in table.messages} == {"F", "B"}
  for msg in table.messages:
    if msg.kind == "B":
      assert msg.dst == msg.src - 1
  # One action per stage per tick, each W after its own B on the same stage.
  for s, row in enumerate(table.grid):
    for t, action in enumerate(row):
      if action is not None and action.kind == "W":
        assert table.tick_of(s, S.Action("B", action.microbatch, action.chunk)) < t


def _arrival(table, s, action):
  """The tick from which `action` may run on stage `s`: after its same-stage input, and
  1 + latency ticks after a neighbour's (dependencies written out here, not imported)."""
  p, v, lat = table.stages, table.virtual, table.latency
  kind, i, c = action
  if kind == "W":
    return table.tick_of(s, S.Action("B", i, c)) + 1
  if kind == "F":
    if (s, c) == (0, 0):
      return 0
    src, chunk = (s - 1, c) if s else (p - 1, c - 1)
    return table.tick_of(src, S.Action("F", i, chunk)) + 1 + lat
  t = table.tick_of(s, S.Action("F", i, c)) + 1
  if (s, c) != (p - 1, v - 1):
    src, chunk = (s + 1, c) if s < p - 1 else (0, c + 1)
    t = max(t, table.tick_of(src, S.Action("B", i, chunk)) + 1 + lat)
  return t


@pytest.mark.parametrize("schedule,p,v,m,latency",
                         [c for c in _all_cases() if c[0] == "zb_h1" or c[4] == 1
                          if c[0] != "gpipe"])
def test_list_scheduled_stages_never_idle_with_ready_work(schedule, p, v, m, latency):
  """Whenever a stage idles, none of its later B or W has its inputs, and its next forward
  either lacks its input or would exceed the in-flight cap (S.inflight_cap)."""
  table = S.build(schedule, p, v, m, latency)
  release = "W" if schedule == "zb_h1" else "B"
  for s, row in enumerate(table.grid):
    cap = S.inflight_cap(schedule, p, v, m, s, latency)
    for t, action in enumerate(row):
      if action is not None:
        continue
      later = [a for a in row[t + 1:] if a is not None]
      for a in later:
        if a.kind in "BW":
          assert _arrival(table, s, a) > t, (s, t, a)
      forwards = [a for a in later if a.kind == "F"]
      if forwards:
        done = [a for a in row[:t] if a is not None]
        inflight = sum(a.kind == "F" for a in done) - sum(a.kind == release for a in done)
        assert _arrival(table, s, forwards[0]) > t or inflight >= cap, (s, t)


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 5, 8) for m in (1, 2, 3, 7, 8, 16, 33)])
def test_zb_h1_overlap_costs_at_most_the_fill_and_drain(p, m):
  """ZB-H1's W has no successor to wait for, so a tick of latency costs it no more than 1F1B:
  at most 2(p-1) ticks over its latency-0 table."""
  plain, overlapped = S.build("zb_h1", p, 1, m, 0), S.build("zb_h1", p, 1, m, 1)
  assert plain.ticks < overlapped.ticks <= plain.ticks + 2 * (p - 1)


def test_every_dependency_holds_over_a_wide_sweep():
  """Beyond CASES: every (p, m) up to p = 8 and m = 3p (interleaved: p <= 6, v <= 4, m = kp
  up to 4p), both latencies, every schedule: each action once per stage, none before its
  inputs arrive (`_arrival`, written out in this file)."""
  sweep = [(s, p, 1, m) for s in ("1f1b", "zb_h1") for p in range(2, 9) for m in range(1, 3 * p + 1)]
  sweep += [("gpipe", p, v, m) for p in range(2, 7) for v in (1, 2, 3) for m in range(1, 2 * p + 1)]
  sweep += [("interleaved_1f1b", p, v, k * p) for p in range(2, 7) for v in (2, 3, 4)
            for k in (1, 2, 3, 4)]
  for schedule, p, v, m in sweep:
    for latency in (0, 1):
      table = S.build(schedule, p, v, m, latency)
      kinds = 3 if schedule == "zb_h1" else 2
      for s, order in enumerate(table.orders):
        assert len(set(order)) == len(order) == kinds * v * m
        for action, t in zip(order, table.starts[s]):
          assert _arrival(table, s, action) <= t, (schedule, p, v, m, latency, s, action)
