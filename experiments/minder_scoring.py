"""Scoring Minder and the threshold detector on labelled fleet traces: the detectors replayed
over metric arrays (flags out), flags matched to labelled faults (precision, recall, F1,
latency), and the grid searches that choose each detector's settings on validation traces.

No absl flags here, so tests and other experiments can import it beside any script;
`experiments/minder_eval.py` is the command line.
"""
import time

import numpy as np

from experiments import minder_fleet as fleet
from mscale_jax.observability import straggler
from mscale_jax.observability.minder.detector import Minder, MinderDetector, episode_features

PAPER = {"precision": 0.904, "f1": 0.893, "reaction_s": 3.6,
         "source": "Deng et al., Minder, NSDI 2025, abstract and §6"}
# A flag on a fault's machine up to GRACE_S after the fault ended still detects it: a detector
# that needs a stretch of evidence (Minder: a 30-s window, then 6 checks 5 s apart) can flag a
# short fault once it is over. One value for every evaluation (fleet traces, real runs).
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

def prf(tp: int, fp: int, faults: int) -> tuple[float, float, float]:
  """Precision, recall and F1 of `tp` true and `fp` false flags on `faults` labelled faults."""
  precision, recall = tp / max(tp + fp, 1), tp / max(faults, 1)
  return precision, recall, 2 * precision * recall / max(precision + recall, 1e-12)


def match(flags_: list[tuple[float, int]], faults: list[tuple[int, float, float]]
          ) -> list[int | None]:
  """The fault each flag (second, machine) detects, as an index into `faults` ((machine, onset,
  end)), or None for a false flag: of the faults on the flag's machine with onset <= second <=
  end + GRACE_S, the latest to start (a flag during a fault that began within GRACE_S of the
  previous one's end on that machine is the new fault's). The one matcher of both evaluations."""
  hits = []
  for t, machine in flags_:
    covering = [i for i, (m, onset, end) in enumerate(faults)
                if m == machine and onset <= t <= end + GRACE_S]
    hits.append(max(covering, key=lambda i: faults[i][1]) if covering else None)
  return hits


def score(flags_: list, faults: list) -> dict:
  """Matches flags (second, machine, metric) to labelled faults (`match`): true and false
  positives, repeat flags, precision/recall/F1 and onset-to-flag latency, overall and per kind."""
  detected, tp, fp, dup = {}, 0, 0, 0
  hits = match([(t, machine) for t, machine, _ in flags_],
               [(f.machine, f.onset, f.end) for f in faults])
  for (t, machine, metric), hit in zip(flags_, hits):
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
  precision, recall, f1 = prf(tp, fp, len(faults))
  lat = [d[0] for d in detected.values()]
  return {"faults": len(faults), "flags": len(flags_), "true_positives": tp,
          "false_positives": fp, "repeat_flags": dup, "precision": precision, "recall": recall,
          "f1": f1, "mean_latency_s": float(np.mean(lat)) if lat else None,
          "median_latency_s": float(np.median(lat)) if lat else None, "per_kind": per_kind}


def score_episodes(flags_: list[dict], faults: list[dict], cleans: list[dict]) -> dict:
  """Precision, recall, F1, latency of `flags_` ({'rank', 'time'}) on the episodes of a real run
  (experiments/minder_real.py: faults {'kind', 'rank', 'start', 'end'}, clean stretches
  {'start', 'end'}), matched as on the fleet traces (`match`)."""
  detected, false = {}, 0
  flags_ = sorted(flags_, key=lambda f: f["time"])
  hits = match([(f["time"], f["rank"]) for f in flags_],
               [(e["rank"], e["start"], e["end"]) for e in faults])
  for f, hit in zip(flags_, hits):
    if hit is None:
      false += 1
    elif hit not in detected:
      detected[hit] = f["time"] - faults[hit]["start"]
  tp = len(detected)
  precision, recall, f1 = prf(tp, false, len(faults))
  latency = sorted(detected.values())
  return {"detected": tp, "false_flags": false, "precision": precision, "recall": recall,
          "f1": f1,
          "mean_latency_s": float(np.mean(latency)) if latency else None,
          "median_latency_s": float(np.median(latency)) if latency else None,
          "latency_s": latency,
          "clean_stretches_with_a_flag": sum(any(e["start"] <= f["time"] <= e["end"]
                                                 for f in flags_) for e in cleans),
          "per_kind": {k: {"faults": sum(e["kind"] == k for e in faults),
                           "detected": sum(faults[i]["kind"] == k for i in detected),
                           "latency_s": [detected[i] for i in sorted(detected)
                                         if faults[i]["kind"] == k]}
                       for k in sorted({e["kind"] for e in faults})}}


def pooled(results: list) -> dict:
  """`score` results of several traces, counted together."""
  tp = sum(r["true_positives"] for r in results)
  fp = sum(r["false_positives"] for r in results)
  n = sum(r["faults"] for r in results)
  p, rc, f1 = prf(tp, fp, n)
  lat = [x for r in results for k in r["per_kind"].values() for x in k["latency_s"]]
  return {"faults": n, "true_positives": tp, "false_positives": fp, "precision": p,
          "recall": rc, "f1": f1,
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
