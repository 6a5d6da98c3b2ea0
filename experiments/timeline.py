r"""Merge a run's per-rank timelines: Chrome trace, summary, heat-map.

  python -m experiments.timeline runs/gpt_tiny-20261123-160000
  python -m experiments.timeline RUN_DIR --title="slow rank drill"

Reads RUN_DIR/timeline/rank*.jsonl (written by every training process) and writes, beside them,
trace.json (open in ui.perfetto.dev or chrome://tracing: one track per rank), summary.json and
heatmap.png (ranks x steps coloured by each rank's own time per iteration; ranks x phase). Prints
a per-rank table of mean milliseconds per iteration by phase. The driver runs the same merge at
the end of a multi-process job; this script does it on demand (also while a run is going on).
"""
import sys

from absl import app, flags

_TITLE = flags.DEFINE_string("title", None, "Title of the heat-map.")


def format_summary(summary: dict) -> str:
  """A table: one row per rank, mean ms per iteration of each loop phase, and outliers."""
  from mscale_jax.observability.phases import LOOP_PHASES
  ranks = summary["ranks"]
  phases = [p for p in LOOP_PHASES if any(p in r["mean_s"] for r in ranks.values())]
  lines = ["rank  iters  " + "  ".join(f"{p[:12]:>12}" for p in phases) + "   own_ms  iter_ms"]
  for rank, r in ranks.items():
    cells = "  ".join(f"{1e3 * r['mean_s'].get(p, 0.0):12.2f}" for p in phases)
    own = 1e3 * (r["mean_own_s"] or 0.0)
    lines.append(f"{rank:>4}  {r['iterations']:>5}  {cells}  {own:7.2f}  "
                 f"{1e3 * (r['mean_iteration_s'] or 0.0):7.2f}")
  for phase, o in summary["furthest_above_others"].items():
    if o["excess_s"] > 0:
      lines.append(f"  {phase}: rank {o['rank']} is {1e3 * o['excess_s']:.2f} ms/iteration "
                   f"above the median of the others")
  return "\n".join(lines)


def main(argv):
  if len(argv) != 2:
    print("usage: python -m experiments.timeline RUN_DIR", file=sys.stderr)
    sys.exit(2)
  from mscale_jax.observability import heatmap, trace
  try:
    out = trace.merge(argv[1])
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if _TITLE.value:
    heatmap.write(out["data"], out["heatmap"], title=_TITLE.value)
  print(format_summary(out["summary_data"]))
  print(f"[timeline] trace {out['trace']}\n[timeline] summary {out['summary']}\n"
        f"[timeline] heat-map {out['heatmap']}")


if __name__ == "__main__":
  app.run(main)
