r"""Draws a pipeline schedule table: one row per stage, a box per tick, idle gaps left blank.

  python -m experiments.pipeline_schedule --schedule=interleaved_1f1b --stages=4 --virtual=2 \
      --microbatches=8 --out_dir=results/pipeline_schedule

Forward boxes are blue, backward boxes orange, darker for later model chunks; each box shows
its microbatch number. Writes `<schedule>-p<P>-v<V>-m<M>-lat<L>.png` and a JSON record with the
bubble fraction (idle over busy ticks) and the peak in-flight chunk inputs per stage. The table
is `mscale_jax.parallel.schedule.build`, the one the executor runs and the perf model costs;
`--latency=1` is the executor's overlapped-send table (results usable one tick later).
Pure Python + matplotlib: no JAX, no devices.
"""
import os

from absl import app, flags

from experiments import results
from mscale_jax.parallel import schedule as schedule_lib

_SCHEDULE = flags.DEFINE_enum("schedule", "interleaved_1f1b", schedule_lib.SCHEDULES,
                              "Which schedule to draw.")
_STAGES = flags.DEFINE_integer("stages", 4, "Pipeline stages p.")
_VIRTUAL = flags.DEFINE_integer("virtual", 2, "Model chunks per stage v.")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "Microbatches m.")
_LATENCY = flags.DEFINE_integer("latency", 0, "Ticks between a send and its use (0 or 1).")
_OUT_DIR = flags.DEFINE_string("out_dir", os.path.join(results.REPO_ROOT, "results",
                                                       "pipeline_schedule"),
                               "Folder for the PNG and the JSON record.")

_FORWARD = ("#9ecae1", "#4292c6", "#2171b5", "#08519c", "#08306b")
_BACKWARD = ("#fdd0a2", "#fd8d3c", "#e6550d", "#a63603", "#7f2704")


def draw(table: schedule_lib.Table, path: str) -> None:
  """Saves the table as a PNG: stages top to bottom, ticks left to right."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch, Rectangle

  p, ticks = table.stages, table.ticks
  fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * ticks + 1.5), 0.55 * p + 1.6))
  for s, row in enumerate(table.grid):
    for t, action in enumerate(row):
      if action is None:
        continue
      shades = _FORWARD if action.kind == "F" else _BACKWARD
      color = shades[min(action.chunk, len(shades) - 1)]
      ax.add_patch(Rectangle((t, s), 1, 0.9, facecolor=color, edgecolor="white", lw=0.8))
      ax.text(t + 0.5, s + 0.45, str(action.microbatch + 1), ha="center", va="center",
              fontsize=7, color="white" if action.chunk else "black")
  ax.set_xlim(0, ticks)
  ax.set_ylim(p, 0)
  ax.set_yticks([s + 0.45 for s in range(p)], [f"stage {s}" for s in range(p)])
  ax.set_xlabel("tick (one chunk's forward or backward)")
  for side in ("top", "right", "left"):
    ax.spines[side].set_visible(False)
  name = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}
  ax.set_title(f"{name[table.schedule]}: p={p}, v={table.virtual}, m={table.microbatches}, "
               f"latency={table.latency} tick  |  bubble {table.bubble_fraction:.3f} "
               f"(idle {table.idle_ticks} of {ticks} ticks)  |  peak in-flight "
               f"{list(table.peak_inflight)}", fontsize=9)
  handles = [Patch(color=_FORWARD[c], label=f"F chunk {c}") for c in range(table.virtual)]
  handles += [Patch(color=_BACKWARD[c], label=f"B chunk {c}") for c in range(table.virtual)]
  ax.legend(handles=handles, ncol=2 * table.virtual, fontsize=7, loc="upper center",
            bbox_to_anchor=(0.5, -0.32 if p < 4 else -0.18), frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=140)
  plt.close(fig)


def figures(table: schedule_lib.Table) -> dict:
  """What the JSON record holds."""
  return {
      "schedule": table.schedule, "stages": table.stages, "virtual": table.virtual,
      "microbatches": table.microbatches, "latency_ticks": table.latency,
      "ticks": table.ticks, "busy_ticks_per_stage": table.busy_ticks,
      "idle_ticks_per_stage": table.idle_ticks, "bubble_fraction": table.bubble_fraction,
      "bubble_formula": (table.stages - 1) / (table.virtual * table.microbatches),
      "peak_inflight_per_stage": list(table.peak_inflight),
      "peak_inflight_note": "chunk inputs stashed at once; each holds 1/virtual of the stage's "
                            "layers for one microbatch",
      "messages": len(table.messages),
  }


def main(argv):
  del argv
  table = schedule_lib.build(_SCHEDULE.value, _STAGES.value, _VIRTUAL.value,
                             _MICROBATCHES.value, _LATENCY.value)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  stem = (f"{table.schedule}-p{table.stages}-v{table.virtual}-m{table.microbatches}"
          f"-lat{table.latency}")
  png = os.path.join(_OUT_DIR.value, stem + ".png")
  draw(table, png)
  record = results.write_record(f"pipeline_schedule-{stem}", figures(table),
                                out_dir=_OUT_DIR.value,
                                device={"platform": "python", "note": "pure-Python table"},
                                extra={"png": os.path.relpath(png, results.REPO_ROOT)})
  print(f"[pipeline_schedule] {stem}: bubble {table.bubble_fraction:.4f} "
        f"(formula (p-1)/(v*m) = {figures(table)['bubble_formula']:.4f}), "
        f"peak in-flight {list(table.peak_inflight)}")
  print(f"[pipeline_schedule] wrote {png}")
  print(f"[pipeline_schedule] wrote {record}")


if __name__ == "__main__":
  app.run(main)
