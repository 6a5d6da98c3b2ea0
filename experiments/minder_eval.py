"""Minder against the threshold detector on labelled fleet traces: precision, recall, F1 and
detection latency, the way Minder's paper (NSDI'25 §6) reports them.

  python -m experiments.minder_eval                      # the full evaluation (~10 min, 2 CPUs)
  python -m experiments.minder_eval --quick              # a small smoke run

Protocol (every split is its own seed; the detectors see metric arrays only):
  1. fit: one LSTM-VAE per metric on healthy traces (no faults) -- the "stored normal set";
  2. priority: labelled fault and healthy episodes of other traces -> per-metric episode scores
     -> a decision tree -> the metric order (priority.py);
  3. validation: a labelled trace on which Minder's thresholds (ratio, floor, continuity) and the
     threshold detector's (threshold, window) are chosen for the best F1;
  4. test: fresh traces of 16 .. 1,024 machines, scored once with the chosen settings.
Scoring: a fault is detected when the detector flags its machine between its onset and `grace_s`
after its end; the first such flag is a true positive, its delay from the onset the detection
latency; later flags of the same machine during the same fault are not counted; every other flag
is a false positive. Also timed: the compute time of one Minder check over all metrics (the
paper's 3.6 s is, as we read it, the time of one detection pass on pulled data).
"""
import dataclasses
import time

from absl import app, flags
import numpy as np

from experiments import minder_fleet as fleet
from experiments.results import write_record
from mscale_jax.observability import straggler
from mscale_jax.observability.minder import priority as priority_lib
from mscale_jax.observability.minder.detector import (Minder, MinderConfig, MinderDetector,
                                                      episode_features)
from mscale_jax.observability.minder.vae import VAEConfig

_SIZES = flags.DEFINE_list("sizes", ["16", "64", "256", "1024"], "Test fleet sizes (machines).")
_HOURS = flags.DEFINE_list("hours", ["12", "6", "2", "1"], "Simulated hours per test size.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny splits and a short VAE fit (smoke test).")
_SEED = flags.DEFINE_integer("seed", 0, "Base seed; each split adds its own offset.")
_COMPUTE_CV = flags.DEFINE_float("compute_cv", fleet.CALIBRATION.compute_cv,
                                  "Per-sample noise of compute time in the fleet traces.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the record and plot (results/).")

PAPER = {"precision": 0.904, "f1": 0.893, "reaction_s": 3.6,
         "source": "Deng et al., Minder, NSDI 2025, abstract and §6"}
GRACE_S = 60


def log(msg):
  print(msg, flush=True)


# ---- the detectors, replayed over a trace (metric arrays in, flags (second, machine) out) ----

def minder_checks(minder: Minder, metrics: dict, *, timed_checks: int = 20
                  ) -> tuple[list, dict, float]:
  """Every check's most distinct machine per metric and per-machine window means, and the mean
  seconds of one online check (`Minder.most_distinct` on the windows of all metrics, timed on
  `timed_checks` checks). Thresholds are applied later (`replay_minder`), so one pass serves
  every setting tried; the embeddings of all checks are computed in large batches (the same
  numbers as check by check, faster)."""
  from mscale_jax.observability.minder import similarity
  from mscale_jax.observability.minder.windows import sliding_windows
  cfg = minder.config
  T = next(iter(metrics.values())).shape[1]
  times = np.arange(cfg.window - 1, T, cfg.stride)
  tops = [dict() for _ in times]
  for m in minder.priority:
    windows = sliding_windows(metrics[m], cfg.window, cfg.stride)          # [M, n, W]
    flat = windows.reshape(-1, cfg.window)
    emb = np.concatenate([minder.embed(m, flat[i:i + 65536])
                          for i in range(0, len(flat), 65536)]).reshape(*windows.shape[:2], -1)
    for i in range(len(times)):
      tops[i][m] = similarity.most_distinct(emb[:, i])
  csum = {m: np.cumsum(np.pad(metrics[m].astype(np.float64), ((0, 0), (1, 0))), axis=1)
          for m in minder.priority}
  means = {m: (c[:, times + 1] - c[:, times + 1 - cfg.window]) / cfg.window
           for m, c in csum.items()}
  picks = np.linspace(0, len(times) - 1, min(timed_checks, len(times))).astype(int)
  start = time.perf_counter()
  for i in picks:
    t = times[i]
    minder.most_distinct({m: metrics[m][:, t - cfg.window + 1:t + 1] for m in minder.priority})
  per_check = (time.perf_counter() - start) / len(picks)
  return list(zip(times.tolist(), tops)), means, per_check


def replay_minder(minder: Minder, checks: list, means: dict) -> list:
  """Runs the online detector over precomputed checks; returns its flags (second, rank, metric)."""
  detector = MinderDetector(minder)
  out = []
  for i, (t, tops) in enumerate(checks):
    flag = detector.decide(float(t), tops, {m: v[:, i] for m, v in means.items()})
    if flag:
      out.append((int(t), flag.rank, flag.metric))
  return out


def replay_threshold(metrics: dict, *, threshold: float, window: int) -> list:
  """The current driver detector (straggler.py), fed as the driver feeds it: once per training
  step (the fleet's step is CALIBRATION.step_s = 2 s, so each update averages 2 samples), with
  each rank's step-phase seconds and the step time."""
  det = straggler.StragglerDetector(threshold=threshold, window=window, unit="step")
  per = max(int(round(fleet.CALIBRATION.step_s)), 1)
  M, T = metrics["step_s"].shape
  n = T // per
  phases = np.stack([metrics[p][:, :n * per] for p in fleet.STEP_PHASES], axis=-1)
  phases = phases.reshape(M, n, per, -1).mean(axis=2)                     # [M, steps, P]
  step = np.median(metrics["step_s"][:, :n * per], axis=0).reshape(n, per).mean(axis=1)
  out = []
  for i in range(n):
    values = {r: dict(zip(fleet.STEP_PHASES, phases[r, i].tolist())) for r in range(M)}
    for flag in det.update(i, values, float(step[i])):
      out.append(((i + 1) * per - 1, flag.rank, flag.metric))
  return out


# ---- scoring (the only code that reads labels) ----

def score(flags_: list, faults: list) -> dict:
  """Matches flags to labelled faults (same machine, onset to end + GRACE_S): true and false
  positives, repeat flags, precision/recall/F1 and onset-to-flag latency, overall and per kind."""
  detected, tp, fp, dup = {}, 0, 0, 0
  for t, machine, metric in flags_:
    hit = next((i for i, f in enumerate(faults)
                if f.machine == machine and f.onset <= t <= f.end + GRACE_S), None)
    if hit is None:
      fp += 1
    elif hit in detected:
      dup += 1
    else:
      detected[hit] = (t - faults[hit].onset, metric)
      tp += 1
  per_kind = {}
  for kind in fleet.FAULT_KINDS:
    idx = [i for i, f in enumerate(faults) if f.kind == kind]
    lat = [detected[i][0] for i in idx if i in detected]
    per_kind[kind] = {"faults": len(idx), "detected": len(lat),
                      "latency_s": lat, "mean_latency_s": float(np.mean(lat)) if lat else None,
                      "metrics": sorted({detected[i][1] for i in idx if i in detected})}
  precision = tp / max(tp + fp, 1)
  recall = tp / max(len(faults), 1)
  f1 = 2 * precision * recall / max(precision + recall, 1e-12)
  lat = [d[0] for d in detected.values()]
  return {"faults": len(faults), "flags": len(flags_), "true_positives": tp,
          "false_positives": fp, "repeat_flags": dup, "precision": precision, "recall": recall,
          "f1": f1, "mean_latency_s": float(np.mean(lat)) if lat else None,
          "median_latency_s": float(np.median(lat)) if lat else None, "per_kind": per_kind}


def pooled(results: list) -> dict:
  """`score` results of several traces, counted together."""
  tp = sum(r["true_positives"] for r in results)
  fp = sum(r["false_positives"] for r in results)
  n = sum(r["faults"] for r in results)
  p, rc = tp / max(tp + fp, 1), tp / max(n, 1)
  lat = [x for r in results for k in r["per_kind"].values() for x in k["latency_s"]]
  return {"faults": n, "true_positives": tp, "false_positives": fp, "precision": p,
          "recall": rc, "f1": 2 * p * rc / max(p + rc, 1e-12),
          "mean_latency_s": float(np.mean(lat)) if lat else None,
          "median_latency_s": float(np.median(lat)) if lat else None}


# ---- the splits ----

def priority_episodes(minder: Minder, traces: list) -> tuple[np.ndarray, np.ndarray]:
  """Per fault, the first minutes of it (label 1), and as many healthy stretches of the same
  length from the gaps (label 0); features from the metrics only (episode_features)."""
  rng = np.random.default_rng(7)
  feats, labels = [], []
  for trace in traces:
    busy = np.zeros(trace.seconds, bool)
    for f in trace.faults:
      busy[max(f.onset - 120, 0):f.end + 120] = True
    for f in trace.faults:
      n = min(f.end - f.onset, 300)
      feats.append(episode_features(minder, {m: a[:, f.onset:f.onset + n]
                                             for m, a in trace.metrics.items()}))
      labels.append(1)
      for _ in range(50):
        s = int(rng.integers(0, trace.seconds - n))
        if not busy[s:s + n].any():
          feats.append(episode_features(minder, {m: a[:, s:s + n]
                                                 for m, a in trace.metrics.items()}))
          labels.append(0)
          break
  return np.array(feats), np.array(labels)


def choose_minder(minder, checks_means, faults_list):
  """Grid search of Minder's continuity, ratio and floor on validation traces (best F1, then
  lowest latency); returns (setting, its pooled score)."""
  best = None
  for continuity in (6, 12, 24):
    for ratio in (1.5, 2.0, 2.5, 3.0, 4.0):
      for floor in (0.0, 0.02, 0.05):
        m = minder.with_config(ratio=ratio, floor=floor, continuity=continuity)
        r = pooled([score(replay_minder(m, c, mm), f)
                    for (c, mm), f in zip(checks_means, faults_list)])
        key = (r["f1"], -(r["mean_latency_s"] or 1e9))
        if best is None or key > best[0]:
          best = (key, dict(ratio=ratio, floor=floor, continuity=continuity), r)
  return best[1], best[2]


def choose_threshold(traces):
  """The same for the threshold detector's threshold and window."""
  best = None
  for threshold in (0.05, 0.1, 0.2):
    for window in (5, 10, 20):
      r = pooled([score(replay_threshold(t.metrics, threshold=threshold, window=window),
                        t.faults) for t in traces])
      key = (r["f1"], -(r["mean_latency_s"] or 1e9))
      log(f"    threshold {threshold} window {window}: F1 {r['f1']:.3f}")
      if best is None or key > best[0]:
        best = (key, dict(threshold=threshold, window=window), r)
  return best[1], best[2]


def main(argv):
  del argv
  quick = _QUICK.value
  seed = _SEED.value
  wall = time.time()
  cal = dataclasses.replace(fleet.CALIBRATION, compute_cv=_COMPUTE_CV.value)
  gen = lambda *a, **k: fleet.generate(*a, cal=cal, **k)   # noqa: E731
  vae = VAEConfig(steps=60 if quick else 300)
  config = MinderConfig(vae=vae)
  sizes = [int(s) for s in _SIZES.value]
  hours = [float(h) for h in _HOURS.value]
  if len(hours) != len(sizes):
    raise app.UsageError(f"--hours needs one value per --sizes ({len(sizes)}), got {len(hours)}")
  if quick:
    sizes, hours = [16], [1.0]
  n_fit, s_fit = (16, 1200) if quick else (64, 3600)
  log(f"fit: per-metric LSTM-VAEs on {2 if not quick else 1} healthy traces of {n_fit} "
      f"machines x {s_fit} s")
  healthy = [gen(n_fit, s_fit, seed=seed + 100 + i, faults=False)
             for i in range(1 if quick else 2)]
  minder = Minder.fit({m: [h.metrics[m] for h in healthy] for m in fleet.METRICS}, config,
                      log=log)

  log("priority: labelled episodes -> decision tree")
  prio_traces = [gen(32, 3600 * (1 if quick else 6), seed=seed + 200)]
  feats, labels = priority_episodes(minder, prio_traces)
  order, importance = priority_lib.metric_priority(feats, labels, list(minder.priority))
  minder = minder.with_priority(order)
  log(f"  {len(labels)} episodes ({labels.sum()} faulty); order: {', '.join(order)}")

  log("validation: choosing thresholds")
  val = [gen(32, 3600 * (1 if quick else 4), seed=seed + 300)]
  val_checks = [minder_checks(minder, t.metrics)[:2] for t in val]
  m_choice, m_val = choose_minder(minder, val_checks, [t.faults for t in val])
  t_choice, t_val = choose_threshold(val)
  minder = minder.with_config(**m_choice)
  log(f"  minder {m_choice}: F1 {m_val['f1']:.3f}; threshold {t_choice}: F1 {t_val['f1']:.3f}")

  tests, curves = [], {"minder": {}, "threshold": {}}
  for size, h in zip(sizes, hours):
    trace = gen(size, int(3600 * h), seed=seed + 400 + size)
    start = time.time()
    checks, means, per_check = minder_checks(minder, trace.metrics)
    m_flags = replay_minder(minder, checks, means)
    m_wall = time.time() - start
    start = time.time()
    t_flags = replay_threshold(trace.metrics, **t_choice)
    t_wall = time.time() - start
    d_flags = (t_flags if t_choice == {"threshold": 0.1, "window": 10} else
               replay_threshold(trace.metrics, threshold=0.1, window=10))
    row = {"machines": size, "hours": h, "faults": len(trace.faults),
           "healthy_blips": len(trace.blips), "minder": score(m_flags, trace.faults),
           "threshold": score(t_flags, trace.faults),
           "threshold_defaults": score(d_flags, trace.faults),
           "minder_check_s": per_check, "minder_replay_s": m_wall, "threshold_replay_s": t_wall,
           "flags": {"minder": m_flags[:50], "threshold": t_flags[:50]}}
    tests.append((trace, checks, means, row))
    log(f"  {size:5d} machines, {h} h, {len(trace.faults)} faults: minder P "
        f"{row['minder']['precision']:.2f} R {row['minder']['recall']:.2f}; threshold P "
        f"{row['threshold']['precision']:.2f} "
        f"R {row['threshold']['recall']:.2f}; one check {1e3 * per_check:.1f} ms")
  rows = [r for *_, r in tests]
  for ratio in (1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0):
    m = minder.with_config(ratio=ratio)
    curves["minder"][ratio] = pooled([score(replay_minder(m, c, mm), t.faults)
                                      for t, c, mm, _ in tests])
  for threshold in (0.02, 0.05, 0.1, 0.2, 0.4):
    curves["threshold"][threshold] = pooled([
        score(replay_threshold(t.metrics, threshold=threshold, window=t_choice["window"]),
              t.faults) for t, *_ in tests if t.machines <= 16])
  figures = {
      "minder": pooled([r["minder"] for r in rows]),
      "threshold": pooled([r["threshold"] for r in rows]),
      "threshold_defaults": pooled([r["threshold_defaults"] for r in rows]),
      "paper": PAPER, "per_size": rows,
      "per_kind": {d: {k: {"faults": sum(r[d]["per_kind"][k]["faults"] for r in rows),
                           "detected": sum(r[d]["per_kind"][k]["detected"] for r in rows),
                           "latency_s": [x for r in rows for x in r[d]["per_kind"][k]["latency_s"]]}
                       for k in fleet.FAULT_KINDS} for d in ("minder", "threshold")},
      "minder_config": dataclasses.asdict(minder.config), "threshold_config": t_choice,
      "validation": {"minder": m_val, "threshold": t_val},
      "priority": {"order": order, "importance": importance, "episodes": int(len(labels)),
                   "faulty_episodes": int(labels.sum())},
      "pr_curves": {"minder_ratio": {str(k): v for k, v in curves["minder"].items()},
                    "threshold_threshold": {str(k): v for k, v in curves["threshold"].items()}},
      "calibration": dataclasses.asdict(cal),
      "wall_s": time.time() - wall,
  }
  out_dir = _OUT_DIR.value
  path = write_record("minder_eval" + ("-quick" if quick else ""), figures, out_dir=out_dir)
  from experiments import minder_plots
  png = minder_plots.plot(figures, path.replace(".json", ".png"))
  log(f"record {path}\nplot {png}")
  for d in ("minder", "threshold", "threshold_defaults"):
    f = figures[d]
    log(f"{d:18s} P {f['precision']:.3f} R {f['recall']:.3f} F1 {f['f1']:.3f} "
        f"latency {f['mean_latency_s']} s ({f['true_positives']}/{f['faults']}, "
        f"{f['false_positives']} false)")


if __name__ == "__main__":
  app.run(main)
