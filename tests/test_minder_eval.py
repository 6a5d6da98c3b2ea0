"""The Minder evaluation: the fleet generator's faults are where its labels say, the detectors
are given metric arrays only, and the scorer counts the way the module says."""
import ast
import inspect
import pathlib

import numpy as np
import pytest

from experiments import minder_fleet as fleet, minder_scoring
from mscale_jax.observability.minder.detector import Minder, MinderConfig
from mscale_jax.observability.minder.vae import VAEConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_each_fault_kind_moves_its_metric_on_its_machine_from_its_onset():
  changed = {"slow_compute": "compute_s", "nic_degraded": "net_gbps",
             "pcie_downgrade": "host_to_device_s", "mem_pressure": "rss_gb", "hang": "cpu_pct"}
  for kind, metric in changed.items():
    trace = fleet.generate(16, 3000, seed=3, kinds=(kind,), blips_per_machine_hour=0.0,
                           gap_s=(400, 600), fault_s=(300, 400), checkpoint_every_s=10**6)
    assert trace.faults and all(f.kind == kind for f in trace.faults)
    for f in trace.faults:
      x = trace.metrics[metric]
      during = x[:, f.onset + 30:f.end].mean(axis=1)
      before = x[:, f.onset - 200:f.onset].mean(axis=1)
      shift = np.abs(during / before - 1.0)
      assert int(np.argmax(shift)) == f.machine, (kind, f)
      assert shift[f.machine] > 0.1 > np.median(shift)


def test_generator_is_seeded_and_healthy_traces_have_no_faults():
  a, b = fleet.generate(8, 600, seed=5), fleet.generate(8, 600, seed=5)
  assert all(np.array_equal(a.metrics[m], b.metrics[m]) for m in fleet.METRICS)
  assert fleet.generate(8, 4000, seed=5, faults=False).faults == []


def test_detectors_are_given_metric_arrays_only():
  for fn in (minder_scoring.minder_checks, minder_scoring.replay_threshold):
    params = set(inspect.signature(fn).parameters)
    assert not params & {"trace", "faults", "labels"}, (fn.__name__, params)
  # The detector package imports nothing from the experiments (where faults are made).
  for path in (ROOT / "mscale_jax/observability/minder").glob("*.py"):
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("experiments")], path


@pytest.mark.slow   # one of the fast tier's heaviest (a trainer run or a fleet replay)
def test_minder_output_does_not_change_when_the_labels_do():
  trace = fleet.generate(12, 1500, seed=9, kinds=("slow_compute",), gap_s=(400, 500),
                         fault_s=(400, 500))
  healthy = fleet.generate(12, 600, seed=10, faults=False)
  minder = Minder.fit({m: [healthy.metrics[m]] for m in ("compute_s", "sync_s")},
                      MinderConfig(continuity=4, ratio=1.8, floor=0.0,
                                   vae=VAEConfig(hidden=8, latent=3, steps=60, batch=64)))
  checks, means, _ = minder_scoring.minder_checks(minder, trace.metrics, timed_checks=2)
  flags = minder_scoring.replay_minder(minder, checks, means)
  trace.faults = [fleet.Fault("hang", 0, 1, 2, 1.0)]         # wrong labels
  checks2, means2, _ = minder_scoring.minder_checks(minder, trace.metrics, timed_checks=2)
  assert minder_scoring.replay_minder(minder, checks2, means2) == flags


def test_score_counts_true_false_and_repeat_flags():
  faults = [fleet.Fault("slow_compute", 3, 100, 200, 0.3), fleet.Fault("hang", 5, 500, 600, 1)]
  flags = [(90, 3, "m"), (130, 3, "m"), (150, 3, "m"), (300, 4, "m"), (650, 5, "m"),
           (700, 5, "m")]
  s = minder_scoring.score(flags, faults)
  # (90, 3) is before the onset: false; (130, 3) detects fault 0 at 30 s; (150, 3) repeats it;
  # (650, 5) is within the 60 s grace after fault 1 ended: detects it at 150 s; (700, 5) false.
  assert (s["true_positives"], s["false_positives"], s["repeat_flags"]) == (2, 3, 1)
  assert s["per_kind"]["slow_compute"]["latency_s"] == [30]
  assert s["per_kind"]["hang"]["latency_s"] == [150]
  assert s["precision"] == 2 / 5 and s["recall"] == 1.0


def test_a_flag_detects_the_fault_under_way_or_one_that_ended_within_the_grace_period():
  g = minder_scoring.GRACE_S
  # machine 1: a fault from 0 to 40 s, the next from 40 + g // 2 (within the first's grace);
  # machine 2: one fault from 500 to 540 s.
  faults = [(1, 0, 40), (1, 40 + g // 2, 100 + g), (2, 500, 540)]
  flags = [(10, 1), (40 + g // 4, 1), (40 + g // 2 + 1, 1), (100 + 2 * g + 1, 1),
           (540 + g, 2), (541 + g, 2), (20, 2)]
  assert minder_scoring.match(flags, faults) == [0, 0, 1, None, 2, None, None]


def test_fleet_and_real_run_scores_count_the_same_flags_alike():
  """One matcher for both evaluations: the same faults and flags, in the fleet traces' form and
  in a real run's episodes, give the same detections, false flags and latencies."""
  rng = np.random.default_rng(3)
  starts = np.cumsum(rng.integers(30, 90, size=12))
  faults = [fleet.Fault(str(rng.choice(fleet.FAULT_KINDS)), int(rng.integers(3)), int(s),
                        int(s + rng.integers(20, 60)), 1.0) for s in starts]
  flags = sorted((int(rng.integers(0, starts[-1] + 120)), int(rng.integers(3)), "m")
                 for _ in range(40))
  fleet_score = minder_scoring.score(flags, faults)
  episodes = [{"kind": f.kind, "rank": f.machine, "start": f.onset, "end": f.end}
              for f in faults]
  real = minder_scoring.score_episodes([{"time": t, "rank": m} for t, m, _ in flags],
                                       episodes, [])
  assert real["detected"] == fleet_score["true_positives"]
  assert real["false_flags"] == fleet_score["false_positives"]
  assert real["latency_s"] == sorted(x for k in fleet_score["per_kind"].values()
                                     for x in k["latency_s"])
  assert 0 < real["detected"] < len(faults) and real["false_flags"] > 0   # both kinds occur
