"""Minder's pipeline (observability/minder): the LSTM-VAE, similarity, continuity, priority and
the online detector, on random series where a wrong answer would show."""
import numpy as np
import pytest

from mscale_jax.observability.minder import continuity, priority, similarity, vae
from mscale_jax.observability.minder.detector import (Minder, MinderConfig, MinderDetector,
                                                      episode_features)
from mscale_jax.observability.minder.windows import Normaliser, sliding_windows

WINDOW = 16
SMALL_VAE = vae.VAEConfig(hidden=8, latent=3, steps=120, batch=64, seed=0)


def healthy_series(rng, machines, samples, level=10.0, noise=0.5):
  """Per-machine noisy series around a common level with a shared slow wave (the job's rhythm)."""
  t = np.arange(samples)
  wave = 0.5 * np.sin(2 * np.pi * t / 40.0)
  return level + wave + noise * rng.standard_normal((machines, samples))


@pytest.fixture(scope="module")
def minder():
  rng = np.random.default_rng(1)
  healthy = {"step": [healthy_series(rng, 8, 400)],
             "cpu": [healthy_series(rng, 8, 400, level=50.0, noise=2.0)]}
  config = MinderConfig(window=WINDOW, stride=4, continuity=3, ratio=1.8, floor=0.02,
                        vae=SMALL_VAE)
  return Minder.fit(healthy, config)


def test_vae_trains_and_reconstruction_error_separates_a_shifted_series(minder):
  rng = np.random.default_rng(2)
  model = minder.models["step"]
  assert np.mean(model.vae.losses[-10:]) < 0.5 * np.mean(model.vae.losses[:10])
  healthy = sliding_windows(healthy_series(rng, 6, 200), WINDOW, 8).reshape(-1, WINDOW)
  shifted = healthy + 3.0                       # six noise sigmas above the healthy level
  err_h = model.vae.reconstruction_error(model.normaliser(healthy))
  err_s = model.vae.reconstruction_error(model.normaliser(shifted))
  assert err_s.min() > err_h.max()


def test_normaliser_scales_healthy_to_unit_range_and_clips():
  rng = np.random.default_rng(3)
  x = rng.uniform(5, 7, 10_000)
  norm = Normaliser.fit(x)
  y = norm(x)
  assert -0.01 < np.percentile(y, 1) < 0.05 and 0.95 < np.percentile(y, 99) < 1.01
  assert norm(np.array([1e9]))[0] == 3.0


@pytest.mark.parametrize("machines", [4, 16, 64])
def test_similarity_flags_the_one_outlier_among_n_and_none_among_healthy(machines):
  rng = np.random.default_rng(machines)
  healthy = rng.standard_normal((machines, 4)) * 0.1
  assert similarity.outlier(healthy, ratio=1.8, floor=0.05) is None
  bad = int(rng.integers(machines))
  shifted = healthy.copy()
  shifted[bad] += 1.0
  found = similarity.outlier(shifted, ratio=1.8, floor=0.05)
  assert found is not None and found.machine == bad and found.ratio > 1.8


def test_dissimilarity_is_mean_distance_to_the_others():
  e = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]])
  np.testing.assert_allclose(similarity.dissimilarity(e), [2.5, 5.0, 2.5])


def test_continuity_suppresses_a_one_window_blip_and_fires_on_a_lasting_outlier():
  track = continuity.Continuity(checks=3)
  seq = [None, 5, None, 2, 7, 2, 2, 2, 2]     # 5 and 7: one-check blips; 2: lasting from t=5
  fired = [(t, track.update(t, m)) for t, m in enumerate(seq)]
  hits = [(t, s.machine, s.since) for t, s in fired if s is not None]
  assert hits == [(7, 2, 5)]


def test_detector_ignores_a_one_window_blip_and_flags_a_lasting_fault(minder):
  rng = np.random.default_rng(4)
  cfg = minder.config
  cpu = healthy_series(rng, 8, 240, level=50.0, noise=2.0)
  step = healthy_series(rng, 8, 240)
  step[3, 60:60 + WINDOW // 2] += 4.0           # a blip shorter than a window on machine 3
  bad = 5
  step[bad, 150:] += 3.0                         # a lasting fault on machine 5 from t=150
  detector = MinderDetector(minder)
  flags = []
  for t in range(cfg.window - 1, 240, cfg.stride):
    flag = detector.check(float(t), {"step": step[:, t - cfg.window + 1:t + 1],
                                     "cpu": cpu[:, t - cfg.window + 1:t + 1]})
    if flag:
      flags.append(flag)
  assert [(f.rank, f.metric) for f in flags] == [(bad, "step")]
  assert 150 <= flags[0].since and flags[0].at <= 150 + cfg.window + cfg.stride * (
      cfg.continuity + 1)
  assert flags[0].value > flags[0].others + 1.0 and "rank 5: step" in flags[0].describe()


def test_observe_windows_samples_like_check(minder):
  rng = np.random.default_rng(5)
  step = healthy_series(rng, 6, 120)
  step[2, 40:] += 3.0
  cpu = healthy_series(rng, 6, 120, level=50.0, noise=2.0)
  detector = MinderDetector(minder)
  flags = [f for t in range(120)
           if (f := detector.observe(float(t), {"step": step[:, t], "cpu": cpu[:, t]}))]
  assert [(f.rank, f.metric) for f in flags] == [(2, "step")]


def test_priority_orders_metrics_by_how_indicative_they_are():
  rng = np.random.default_rng(6)
  n = 300
  labels = rng.integers(0, 2, n)
  strong = labels * 2.0 + rng.normal(0, 0.3, n)          # separates almost perfectly
  weak = labels * 0.6 + rng.normal(0, 0.5, n)            # separates somewhat
  noise = rng.normal(0, 1.0, n)                          # says nothing
  features = np.stack([noise, weak, strong], axis=1)
  order, importance = priority.metric_priority(features, labels, ["noise", "weak", "strong"])
  assert order[0] == "strong"
  assert order.index("weak") < order.index("noise")
  tree, _ = priority.fit_tree(features, labels, max_depth=2)
  accuracy = np.mean((priority.predict(tree, features) > 0.5) == labels)
  assert accuracy > 0.9


def test_best_split_finds_the_separating_threshold():
  x = np.array([0.1, 0.2, 0.3, 1.1, 1.2, 1.3])
  y = np.array([0, 0, 0, 1, 1, 1])
  gain, threshold = priority.best_split(x, y)
  assert gain == pytest.approx(0.5) and 0.3 < threshold < 1.1


def test_episode_features_are_high_only_where_one_machine_stands_out(minder):
  rng = np.random.default_rng(7)
  healthy = {"step": healthy_series(rng, 8, 120),
             "cpu": healthy_series(rng, 8, 120, level=50.0, noise=2.0)}
  faulty = {k: v.copy() for k, v in healthy.items()}
  faulty["cpu"][1] -= 20.0
  f_healthy, f_faulty = episode_features(minder, healthy), episode_features(minder, faulty)
  cpu = minder.priority.index("cpu")
  assert f_faulty[cpu] > 1.8 > f_healthy[cpu]


def test_with_three_machines_the_healthy_reference_floor_finds_the_outlier(minder):
  rng = np.random.default_rng(8)
  assert all(m.healthy_score > 0 for m in minder.models.values())
  three = minder.config.for_machines(3)               # the driver's setting for 3 ranks
  small = minder.with_config(ratio=three.ratio, floor=three.floor,
                             floor_scale=three.floor_scale)
  cfg = small.config

  def run(step):
    detector = MinderDetector(small)
    cpu = healthy_series(rng, 3, step.shape[1], level=50.0, noise=2.0)
    return [f for t in range(cfg.window - 1, step.shape[1], cfg.stride)
            if (f := detector.check(float(t), {"step": step[:, t - cfg.window + 1:t + 1],
                                               "cpu": cpu[:, t - cfg.window + 1:t + 1]}))]

  assert run(healthy_series(rng, 3, 400)) == []
  faulty = healthy_series(rng, 3, 200)
  faulty[0, 80:] += 3.0
  assert [(f.rank, f.metric) for f in run(faulty)] == [(0, "step")]
