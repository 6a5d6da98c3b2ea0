"""The heat-map of MegaScale's Figure 6 tool: ranks x steps coloured by time, so a slow rank is a
bright row. Left: each rank's own time per iteration (its work outside waiting for the devices
and peers); right: ranks x phase, mean seconds per iteration."""
import numpy as np

from mscale_jax.observability import phases as phases_lib
from mscale_jax.observability import timeline as timeline_lib


def matrices(data: dict):
  """(ranks, steps, own [ranks, steps] seconds (NaN where a rank has no such step),
  phases, phase means [ranks, phases] seconds) of `trace.load()`'s data."""
  per_rank = {r: timeline_lib.per_iteration(d["spans"]) for r, d in data["ranks"].items()}
  ranks = sorted(per_rank)
  steps = sorted({s for iters in per_rank.values() for s in iters})
  own = np.full((len(ranks), len(steps)), np.nan)
  column = {s: j for j, s in enumerate(steps)}
  for i, r in enumerate(ranks):
    for s, phases in per_rank[r].items():
      own[i, column[s]] = timeline_lib.own_time(phases)
  phases = [p for p in phases_lib.LOOP_PHASES
            if any(p in v for iters in per_rank.values() for v in iters.values())]
  means = np.array([[np.mean([v.get(p, 0.0) for v in per_rank[r].values()]) if per_rank[r]
                     else np.nan for p in phases] for r in ranks]).reshape(len(ranks), len(phases))
  return ranks, steps, own, phases, means


def write(data: dict, path: str, title: str | None = None) -> str:
  """Draws the heat-map PNG of `trace.load()`'s data at `path`; returns `path`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ranks, steps, own, phases, means = matrices(data)
  fig, (left, right) = plt.subplots(
      1, 2, figsize=(12, 1.6 + 0.35 * max(len(ranks), 2)),
      gridspec_kw={"width_ratios": [3, max(len(phases), 1) * 0.35 + 0.5]})
  cmap = matplotlib.colormaps["inferno"].with_extremes(bad="lightgrey")   # grey: no data
  image = left.imshow(1e3 * own, aspect="auto", interpolation="nearest", cmap=cmap,
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, len(ranks) - 0.5, -0.5)
                      if steps else None)
  left.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
  left.set_xlabel("step")
  left.set_title("own time per iteration (ms): work outside waiting for devices/peers",
                 fontsize=9)
  fig.colorbar(image, ax=left, fraction=0.03, pad=0.01)
  image = right.imshow(1e3 * means, aspect="auto", interpolation="nearest", cmap="viridis")
  right.set_xticks(range(len(phases)), phases, rotation=60, ha="right", fontsize=8)
  right.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
  right.set_title("mean ms per iteration", fontsize=9)
  fig.colorbar(image, ax=right, fraction=0.08, pad=0.02)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
