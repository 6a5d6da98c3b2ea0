"""The goodput simulator (mscale_jax.goodput.simulate) against what must hold: no failures,
configured rates, Daly's closed form, determinism, and each recovery mechanism on its own."""
import dataclasses
import math

import pytest

from mscale_jax.errors import ConfigError
from mscale_jax.goodput import analytic, simulate
from mscale_jax.goodput.job import Checkpointing, Detection, FailureKind, Job, Recovery
from mscale_jax.goodput.simulate import ScheduledFault


def make_job(kinds=(), every_s=97.0, stall_s=3.3, persist_s=0.0, iteration_s=2.7, nodes=16,
             detection=Detection(5.0, 40.0, 120.0), recovery=None, **checkpointing):
  recovery = recovery or Recovery(self_check_s=30.0, restart_s=45.0, restore_s=12.0,
                                  cold_replace_s=200.0)
  return Job(nodes=nodes, iteration_s=iteration_s, kinds=tuple(kinds), detection=detection,
             recovery=recovery,
             checkpointing=Checkpointing(every_s=every_s, stall_s=stall_s, persist_s=persist_s,
                                         **checkpointing))


def test_without_failures_the_rate_is_one_minus_checkpoint_stalls():
  job = make_job(kinds=[FailureKind("never", 0.0, "exit", True)], persist_s=40.0)
  out = simulate.simulate(job, seed=3, hours=50)
  assert sum(out.breakdown.values()) == pytest.approx(out.wall_s, rel=1e-12)
  assert out.rate == pytest.approx(1 - out.breakdown["checkpoint"] / out.wall_s, abs=1e-12)
  # Every save stalls once: the rate is the work share of a (work + stall) cycle, up to the
  # one cycle the horizon cuts.
  work = job.checkpoint_every * job.iteration_s
  cycle = work + job.checkpointing.stall_s
  assert abs(out.rate - work / cycle) <= cycle / out.wall_s
  assert out.failures == {} and out.recoveries == ()


def test_simulated_mtbf_matches_the_configured_rates():
  kinds = [FailureKind("gpu", 4e-3, "exit", True), FailureKind("net", 1e-3, "hang", True),
           FailureKind("sw", 2e-3, "exit", False), FailureKind("maint", 1e-3, "planned", False),
           FailureKind("slow", 5e-4, "straggler", True, slowdown=1.3)]
  job = make_job(kinds, nodes=32)
  hours = 4000.0
  out = simulate.simulate(job, seed=11, hours=hours)
  n = sum(out.failures.values())
  expected = job.failures_per_hour * hours           # 272 per 1,000 h
  assert abs(n - expected) < 4 * math.sqrt(expected)
  assert out.wall_s / 3600 / n == pytest.approx(job.mtbf_s / 3600, rel=4 / math.sqrt(expected))
  total = sum(k.per_node_hour for k in kinds)
  for k in kinds:   # each kind's share is binomial
    p = k.per_node_hour / total
    assert abs(out.failures[k.name] - n * p) < 4 * math.sqrt(n * p * (1 - p)), k.name
  # Failures also struck during recoveries: fewer recoveries than failures of non-slow kinds.
  stops = n - out.failures["slow"]
  assert len(out.recoveries) < stops + out.failures["slow"]


def test_matches_dalys_closed_form_for_exponential_failures_and_fixed_costs():
  # Daly's model: Poisson failures at any time, a fixed restart R (itself interruptible),
  # the segment since the last durable checkpoint redone. MTBF 2 h, tau 30 min, delta 2 min,
  # R = detection + self-check + restart + restore = 15 min.
  mtbf, tau, delta = 7200.0, 1800.0, 120.0
  job = make_job([FailureKind("any", 3600 / mtbf / 10, "exit", False)], nodes=10,
                 every_s=tau, stall_s=delta, iteration_s=10.0, detection=Detection(100, 100),
                 recovery=Recovery(self_check_s=200, restart_s=300, restore_s=300))
  assert job.mtbf_s == pytest.approx(mtbf)
  expected = analytic.expected_rate(tau, delta, 900.0, mtbf)
  got = simulate.spread(job, range(12), hours=1500)
  assert got.stderr < 0.004
  assert abs(got.mean - expected) < 4 * got.stderr, (got.mean, expected, got.stderr)
  # The closed form is not a tautology: the same run without restarts failing would differ.
  assert abs(expected - analytic.expected_rate(tau, delta, 0.0, mtbf)) > 10 * got.stderr


def test_the_same_seed_gives_the_same_run_and_the_same_failures_whatever_the_policy():
  kinds = [FailureKind("gpu", 2e-3, "exit", True), FailureKind("hang", 1e-3, "hang", False)]
  job = make_job(kinds)
  a, b = simulate.simulate(job, seed=5, hours=300), simulate.simulate(job, seed=5, hours=300)
  assert a == b
  assert simulate.simulate(job, seed=6, hours=300) != a
  spared = dataclasses.replace(job, recovery=dataclasses.replace(job.recovery, warm_spares=4,
                                                                 spare_swap_s=10.0))
  c = simulate.simulate(spared, seed=5, hours=300)
  assert c.failures == a.failures and c.rate > a.rate


def test_restarts_fall_back_to_the_latest_durable_checkpoint():
  job = make_job(every_s=10 * 2.7, persist_s=8.0)   # saves every 10 iterations, 8 s to persist
  faults = [ScheduledFault(36, "kill", 0.5, 1.0, 4.0),                  # step 37: back to 30
            ScheduledFault(80, "kill during save", 0.5, 1.0, 4.0, during_save=True),  # to 70
            ScheduledFault(101, "kill while persisting", 0.5, 1.0, 4.0)]  # 100 not durable: 90
  out = simulate.simulate(job, iterations=200, faults=faults)
  assert [(r.at_iteration, r.restored_to) for r in out.recoveries] == \
      [(36, 30), (80, 70), (101, 90)]
  assert out.breakdown["replay"] == pytest.approx((6 + 10 + 11) * job.iteration_s)
  assert out.breakdown["training"] == pytest.approx(200 * job.iteration_s)
  assert out.breakdown["detection"] == pytest.approx(1.5)
  assert out.breakdown["restart"] == pytest.approx(12.0)


def test_warm_spares_are_used_until_the_pool_is_empty():
  kinds = [FailureKind("gpu", 1e-3, "exit", True)]
  recovery = Recovery(self_check_s=1.0, restart_s=1.0, restore_s=1.0, warm_spares=2,
                      spare_swap_s=7.0, cold_replace_s=500.0, spare_restock_s=1e9)
  out = simulate.simulate(make_job(kinds, recovery=recovery, detection=Detection(1.0, 1.0)),
                          seed=2, hours=2000)
  n = len(out.recoveries)
  assert n == sum(out.failures.values()) > 3        # rare failures, none during a recovery
  assert out.breakdown["replacement"] == pytest.approx(2 * 7.0 + (n - 2) * 500.0)


def test_a_slow_machine_costs_until_the_straggler_detector_finds_it():
  kinds = [FailureKind("slow", 2e-4, "straggler", True, slowdown=1.5)]
  job = make_job(kinds, detection=Detection(5.0, 40.0, straggler_s=600.0), stall_s=0.0)
  out = simulate.simulate(job, seed=4, hours=3000)
  n = out.failures["slow"]
  assert n > 5 and len(out.recoveries) == n
  assert all(r.cause == "straggler evicted" for r in out.recoveries)
  # 600 s of training at 1.5x the iteration time (saves stall for 0 s here): a third of it
  # is the slow machine's.
  assert out.breakdown["slowdown"] == pytest.approx(n * 600.0 / 3, rel=1e-6)
  assert out.breakdown["detection"] == 0 and out.breakdown["diagnosis"] == 0


def test_planned_stops_lose_no_work_and_in_memory_checkpoints_bound_replay():
  planned = simulate.simulate(make_job([FailureKind("maint", 2e-3, "planned", False)]),
                              seed=1, hours=1000)
  assert planned.recoveries and all(r.lost_iterations == 0 for r in planned.recoveries)
  assert planned.breakdown["replay"] == pytest.approx(0, abs=1e-6)
  kinds = [FailureKind("gpu", 2e-3, "exit", True)]
  base = make_job(kinds, every_s=3600.0, persist_s=100.0)
  memory = dataclasses.replace(base, checkpointing=dataclasses.replace(
      base.checkpointing, memory_every_s=base.iteration_s, memory_restore_s=0.5))
  a, b = (simulate.simulate(j, seed=8, hours=1000) for j in (base, memory))
  assert a.failures == b.failures
  assert max(r.lost_iterations for r in b.recoveries) < 1 + 1e-9
  assert b.breakdown["replay"] < a.breakdown["replay"] / 50 and b.rate > a.rate


def test_young_and_daly_intervals_sit_at_the_closed_form_optimum():
  mtbf, delta, restart = 4 * 3600.0, 30.0, 300.0
  grid = [60 * 1.01 ** i for i in range(400)]
  best = max(grid, key=lambda t: analytic.expected_rate(t, delta, restart, mtbf))
  assert analytic.daly_interval(delta, mtbf) == pytest.approx(best, rel=0.02)
  assert analytic.young_interval(delta, mtbf) == pytest.approx(best, rel=0.05)
  assert analytic.daly_interval(3 * mtbf, mtbf) == mtbf


@pytest.mark.parametrize("change,field", [
    (dict(nodes=0), "nodes"), (dict(iteration_s=0.0), "iteration_s"),
    (dict(checkpointing=Checkpointing(every_s=10.0, stall_s=-1.0)), "checkpointing.stall_s"),
    (dict(kinds=(FailureKind("x", 1e-3, "smoke", True),)), "kinds[x].detected_by"),
    (dict(kinds=(FailureKind("x", 1e-3, "straggler", True),)), "kinds[x].slowdown"),
    (dict(kinds=(FailureKind("x", 1e-3, "exit", True), FailureKind("x", 1e-3, "hang", True))),
     "kinds"),
])
def test_bad_jobs_are_config_errors_naming_the_field(change, field):
  with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
    simulate.simulate(dataclasses.replace(make_job(), **change), hours=1)


def test_exactly_one_end_condition():
  for kwargs in (dict(), dict(hours=1, iterations=5), dict(hours=-1)):
    with pytest.raises(ConfigError):
      simulate.simulate(make_job(), **kwargs)


def test_spread_quantiles_and_breakdown_shares():
  job = make_job([FailureKind("gpu", 2e-3, "exit", True)])
  sp = simulate.spread(job, range(6), hours=200)
  assert sp.quantile(0) == min(sp.rates) and sp.quantile(1) == max(sp.rates)
  assert sp.quantile(0) <= sp.quantile(0.5) <= sp.quantile(1)
  assert sum(sp.breakdown.values()) == pytest.approx(1.0)
  assert sp.breakdown["training"] == pytest.approx(sp.mean)   # every run lasts 200 h
