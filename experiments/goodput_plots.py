"""The plots of experiments/goodput.py (matplotlib, Agg). Each function writes one PNG from
the figures its section computed and returns the path."""
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DRILL_COLORS = {"training_s": "#4c72b0", "replayed_steps_s": "#dd8452", "restart_s": "#c44e52",
                "detection_s": "#8172b3", "startup_s": "#937860", "other_s": "#bbbbbb"}


def _save(fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def drill(path: str, preds) -> str:
  """Per drill record, the measured and the predicted split of wall time (fractions)."""
  fig, ax = plt.subplots(figsize=(8, 0.9 + 0.75 * max(1, len(preds))))
  labels, y = [], 0
  for p in preds:
    rows = [("predicted", p.breakdown, sum(p.breakdown.values()))]
    if p.case.measured_breakdown:
      rows.insert(0, ("measured", p.case.measured_breakdown, p.case.measured_wall_s))
    for kind, split, wall in rows:
      left = 0.0
      for k, color in DRILL_COLORS.items():
        width = split.get(k, 0.0) / wall if wall else 0.0
        if width < 0:   # parts that overlap (faster steps than fed, double counts): left of 0
          ax.barh(y, width, left=0.0, color=color, hatch="//", edgecolor="white")
          continue
        ax.barh(y, width, left=left, color=color, label=k if y == 0 else None)
        left += width
      rate = p.case.measured_rate if kind == "measured" else p.rate
      labels.append(f"{os.path.basename(p.case.path)[-20:-5]} {kind} ({100 * rate:.1f}%)")
      y += 1
    if not p.case.measured_breakdown:
      labels[-1] = labels[-1] + f" vs {100 * p.case.measured_rate:.1f}% measured"
  ax.set_yticks(range(len(labels)), labels, fontsize=7)
  ax.invert_yaxis()
  ax.axvline(1.0, color="black", lw=0.6, ls=":")
  ax.set_xlabel("share of wall time (hatched, left of 0: a negative 'other_s')")
  ax.set_title("fault drills: measured vs simulated split of wall time", fontsize=9)
  ax.legend(fontsize=7, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.06))
  return _save(fig, path)


def llama3(path: str, rows) -> str:
  """Llama 3's rate against the assumed recovery overhead, best interval and hourly."""
  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  u0 = [r["u0_min"] for r in rows]
  ax.fill_between(u0, [100 * r["rate_p05"] for r in rows], [100 * r["rate_p95"] for r in rows],
                  alpha=0.25, label="best interval, 5-95% of runs")
  ax.plot(u0, [100 * r["rate_mean"] for r in rows], "o-", label="best interval, mean")
  ax.plot(u0, [100 * r["hourly_rate_mean"] for r in rows], "s--", label="hourly checkpoints")
  ax.axhline(90, color="black", lw=0.8, ls=":")
  ax.text(u0[-1], 90.3, "Llama 3: 'higher than 90%'", ha="right", fontsize=7)
  ax.axvspan(5, 20, color="grey", alpha=0.12, label="Kokolis et al.: u0 = 5-20 min")
  ax.set_xlabel("recovery overhead per interruption u0 (min; replay not included)")
  ax.set_ylabel("effective training time (%)")
  ax.set_title("Llama 3 405B: 466 interruptions in 54 days on 16,384 GPUs", fontsize=9)
  ax.legend(fontsize=7)
  return _save(fig, path)


def scale(path: str, rows) -> str:
  """Effective training time and goodput-adjusted throughput against GPU count."""
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for rates, color in (("llama3", "C0"), ("rsc1", "C3")):
    rs = [r for r in rows if r["rates"] == rates]
    gpus = [r["gpus"] for r in rs]
    label = {"llama3": "Llama 3 failure rates", "rsc1": "RSC-1 failure rates (Kokolis)"}[rates]
    left.fill_between(gpus, [100 * r["rate_p05"] for r in rs],
                      [100 * r["rate_p95"] for r in rs], color=color, alpha=0.2)
    left.plot(gpus, [100 * r["rate_mean"] for r in rs], "o-", color=color,
              label=f"{label}, best interval")
    left.plot(gpus, [100 * r["hourly_rate_mean"] for r in rs], "--", color=color,
              label=f"{label}, hourly checkpoints")
    right.plot(gpus, [r["tokens_per_s"] * r["rate_mean"] / 1e6 for r in rs], "o-",
               color=color, label=f"x effective training time ({rates})")
  base = [r for r in rows if r["rates"] == "llama3"]
  right.plot([r["gpus"] for r in base], [r["tokens_per_s"] / 1e6 for r in base], "k:",
             label="no failures (mscale_jax.perf)")
  left.axhline(90, color="black", lw=0.8, ls=":")
  left.axvline(12288, color="grey", lw=0.8)
  for ax in (left, right):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (175B, MegaScale's setup)")
    ax.legend(fontsize=7)
  left.set_ylabel("effective training time (%)")
  right.set_yscale("log")
  right.set_ylabel("tokens per wall-clock second (millions)")
  left.set_title("effective training time rate (band: 5-95% of runs)", fontsize=9)
  right.set_title("throughput with failures counted", fontsize=9)
  return _save(fig, path)


def interval(path: str, rows) -> str:
  """The simulated best checkpoint interval against GPU count, with Young's and Daly's."""
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for rates, color in (("llama3", "C0"), ("rsc1", "C3")):
    rs = [r for r in rows if r["rates"] == rates]
    gpus = [r["gpus"] for r in rs]
    best = [r["best_interval_s"] / 60 for r in rs]
    err = [[b - r["near_best_s"][0] / 60 for b, r in zip(best, rs)],
           [r["near_best_s"][1] / 60 - b for b, r in zip(best, rs)]]
    ax.errorbar(gpus, best, yerr=err, fmt="o", color=color, capsize=3,
                label=f"simulated best ({rates}; bar: within 1 s.e.)")
    ax.plot(gpus, [r["young_s"] / 60 for r in rs], "-", color=color, lw=0.8,
            label=f"Young sqrt(2 stall MTBF) ({rates})")
    ax.plot(gpus, [r["daly_s"] / 60 for r in rs], "--", color=color, lw=0.8,
            label=f"Daly higher-order ({rates})")
  persist = rows[0]["persist_s"] / 60
  ax.axhline(persist, color="grey", lw=0.8, ls=":")
  ax.text(rows[0]["gpus"], persist * 1.05, "background persist: no shorter interval is durable",
          fontsize=6, color="grey")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("GPUs")
  ax.set_ylabel("checkpoint interval (min)")
  ax.set_title("best checkpoint interval: 5 s stall, 200 s background persist", fontsize=9)
  ax.legend(fontsize=6)
  return _save(fig, path)


def what_if(path: str, rows) -> str:
  """The what-if policies' rates with their 5-95% spread."""
  fig, ax = plt.subplots(figsize=(7, 3.2))
  names = [r["policy"] for r in rows]
  means = [100 * r["rate_mean"] for r in rows]
  lo = [m - 100 * r["rate_p05"] for m, r in zip(means, rows)]
  hi = [100 * r["rate_p95"] - m for m, r in zip(means, rows)]
  ax.barh(range(len(rows)), means, xerr=[lo, hi], color="C0", alpha=0.8, capsize=3)
  for i, m in enumerate(means):
    ax.text(m + hi[i] + 0.2, i, f"{m:.1f}% ({m - means[0]:+.1f})", va="center", fontsize=8)
  ax.set_yticks(range(len(rows)), names, fontsize=8)
  ax.invert_yaxis()
  ax.set_xlim(min(means) - 6, 100)
  ax.set_xlabel("effective training time (%), bar: 5-95% of runs")
  ax.set_title("12,288 GPUs, 175B: what each change buys", fontsize=9)
  return _save(fig, path)
