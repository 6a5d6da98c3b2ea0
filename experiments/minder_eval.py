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
Scoring (minder_scoring.match): a fault is detected when the detector flags its machine between
its onset and GRACE_S (60 s) after its end; the first such flag is a true positive, its delay
from the onset the detection latency; later flags of the same machine during the same fault are
not counted; every other flag is a false positive. Also timed: the compute time of one Minder
check over all metrics (the paper's 3.6 s is, as we read it, the time of one detection pass on
pulled data).
"""
import dataclasses
import time

from absl import app, flags

from experiments import minder_fleet as fleet
from experiments.minder_scoring import (PAPER, choose_minder, choose_threshold, log,
                                        minder_checks, pooled, priority_episodes,
                                        replay_minder, replay_threshold, score)
from experiments.results import write_record
from mscale_jax.observability.minder import priority as priority_lib
from mscale_jax.observability.minder.detector import Minder, MinderConfig
from mscale_jax.observability.minder.vae import VAEConfig
from mscale_jax.resilience.driver.supervisor import DriverOptions

# The threshold detector as the driver runs it by default ('threshold_defaults' in the record).
DRIVER_THRESHOLD = {"threshold": DriverOptions.straggler_threshold,
                    "window": DriverOptions.straggler_window}


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  global _SIZES, _HOURS, _QUICK, _SEED, _COMPUTE_CV, _OUT_DIR
  _SIZES = flags.DEFINE_list("sizes", ["16", "64", "256", "1024"], "Test fleet sizes (machines).")
  _HOURS = flags.DEFINE_list("hours", ["12", "6", "2", "1"], "Simulated hours per test size.")
  _QUICK = flags.DEFINE_bool("quick", False, "Tiny splits and a short VAE fit (smoke test).")
  _SEED = flags.DEFINE_integer("seed", 0, "Base seed; each split adds its own offset.")
  _COMPUTE_CV = flags.DEFINE_float("compute_cv", fleet.CALIBRATION.compute_cv,
                                    "Per-sample noise of compute time in the fleet traces.")
  _OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the record and plot (results/).")

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
  defaults = {k: getattr(MinderConfig(), k) for k in m_choice}
  if m_choice != defaults:
    log(f"  note: validation chose {m_choice}, MinderConfig's defaults (the driver's) are "
        f"{defaults}")

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
    d_flags = (t_flags if t_choice == DRIVER_THRESHOLD else
               replay_threshold(trace.metrics, **DRIVER_THRESHOLD))
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
      "validation": {"minder": m_val, "threshold": t_val,
                     "minder_choice_is_the_default": m_choice == defaults},
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
  define_flags()
  app.run(main)
