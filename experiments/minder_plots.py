"""The Minder evaluation's figure: detection latency per fault kind, and precision-recall."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot(figures: dict, path: str) -> str:
  """Two panels from a minder_eval record's figures; writes `path` (PNG) and returns it."""
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  kinds = list(figures["per_kind"]["minder"])
  for j, (name, color) in enumerate((("minder", "C0"), ("threshold", "C1"))):
    for i, kind in enumerate(kinds):
      lat = figures["per_kind"][name][kind]["latency_s"]
      x = i + (j - 0.5) * 0.3
      ax1.scatter(np.full(len(lat), x), lat, s=10, color=color, alpha=0.6,
                  label=name if i == 0 else None)
      info = figures["per_kind"][name][kind]
      ax1.annotate(f"{info['detected']}/{info['faults']}", (x, 1.3), fontsize=7, ha="center",
                   color=color)
  ax1.set_xticks(range(len(kinds)), kinds, rotation=20, fontsize=8)
  ax1.set_yscale("log")
  ax1.set_ylim(1, 3000)
  ax1.set_ylabel("onset to flag (s)")
  ax1.set_title("detection latency per fault kind (detected/faults)")
  ax1.legend(fontsize=8)
  for name, key, color in (("minder (ratio sweep)", "minder_ratio", "C0"),
                           ("threshold (threshold sweep)", "threshold_threshold", "C1")):
    pts = sorted((v["recall"], v["precision"]) for v in figures["pr_curves"][key].values())
    ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=name)
  paper = figures["paper"]
  recall = paper["f1"] * paper["precision"] / (2 * paper["precision"] - paper["f1"])
  ax2.scatter([recall], [paper["precision"]], marker="*", s=150, color="k",
              label="Minder paper (production)")
  ax2.set_xlabel("recall")
  ax2.set_ylabel("precision")
  ax2.set_xlim(0, 1.02)
  ax2.set_ylim(0, 1.02)
  ax2.set_title("precision-recall, fleet traces")
  ax2.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
