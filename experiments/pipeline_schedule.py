r"""Draws pipeline schedule tables and records their bubbles, in ticks and in time.

  python -m experiments.pipeline_schedule --schedule=zb_h1 --stages=4 --microbatches=8 \
      [--virtual=1] [--latency=1] [--recompute=none|selective|full] \
      [--out_dir=results/pipeline_schedule]
  python -m experiments.pipeline_schedule --all      # every schedule, latency 0 and 1, one record

One row per stage. Forward boxes are blue, backward (B) orange, weight-gradient (W, zb_h1)
green, darker for later model chunks; each box shows its microbatch number. Without
--recompute the picture is the executor's tick grid; with it, boxes are as long as their pass
(`schedule.pass_costs`: F=1, B=1, 1.027 with selective recompute (GPT-3 175B's
attention core) or 2 with full recompute, W=1, in units of a microbatch's
forward through a whole stage, so an interleaved chunk's passes are 1/v of that) and every
message takes --hop of those units, whatever the table's latency (which only shapes its
order). In lock-step a latency-0 tick ends with its send; a latency-1 tick overlaps it. The records give the idle ticks, the
bubble as time (free-running, as Megatron-LM runs a table; and lock-step, as our SPMD
executor does), the peak in-flight per stage, and, with --all, ZB-H1 against the paper's
formula and against 1F1B at equal memory. Pure Python + matplotlib: no JAX, no devices.
"""
import os
import sys

from absl import app, flags

from experiments import results
from mscale_jax.errors import ConfigError
from mscale_jax.parallel import schedule as schedule_lib


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  global _SCHEDULE, _STAGES, _VIRTUAL, _MICROBATCHES, _LATENCY, _RECOMPUTE, _HOP, _ALL, _OUT_DIR
  _SCHEDULE = flags.DEFINE_enum("schedule", "interleaved_1f1b", schedule_lib.SCHEDULES,
                                "Which schedule to draw.")
  _STAGES = flags.DEFINE_integer("stages", 4, "Pipeline stages p.")
  _VIRTUAL = flags.DEFINE_integer("virtual", 2, "Model chunks per stage v (1 for 1f1b, zb_h1).")
  _MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "Microbatches m.")
  _LATENCY = flags.DEFINE_integer("latency", 0, "Ticks between a send and its use (0 or 1).")
  _RECOMPUTE = flags.DEFINE_enum("recompute", None, schedule_lib.RECOMPUTES,
                                 "Draw in time with these pass costs (default: ticks).")
  _HOP = flags.DEFINE_float("hop", 0.1, "A message's time in a stage's forward-times, for the "
                            "tables in time (a send far shorter than compute, as on GPUs).")
  _ALL = flags.DEFINE_bool("all", False, "Every schedule at p=4, m=8 (v=2 interleaved), latency 0 "
                           "and 1, and the ZB-H1 comparison, in one record.")
  _OUT_DIR = flags.DEFINE_string("out_dir", os.path.join(results.REPO_ROOT, "results",
                                                         "pipeline_schedule"),
                                 "Folder for the PNGs and the JSON record.")

_SHADES = {"F": ("#9ecae1", "#4292c6", "#2171b5", "#08519c", "#08306b"),
           "B": ("#fdd0a2", "#fd8d3c", "#e6550d", "#a63603", "#7f2704"),
           "W": ("#c7e9c0", "#74c476", "#31a354", "#006d2c", "#00441b")}
_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B",
          "zb_h1": "ZB-H1"}


def _costs(table, recompute: str) -> dict:
  """Pass costs of one chunk in stage-forward-times: a microbatch's forward through all of a
  stage's layers takes 1, so an interleaved chunk (1/v of them) takes 1/v."""
  return schedule_lib.pass_costs(recompute, forward=1.0 / table.virtual)


def draw(table: schedule_lib.Table, path: str, recompute: str | None = None,
         hop: float = 0.1) -> None:
  """Saves the table as a PNG: stages top to bottom, ticks (or time, with `recompute`'s pass
  costs and `hop` per message) left to right."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch, Rectangle

  p = table.stages
  timeline = table.timeline(None if recompute is None else _costs(table, recompute),
                            hop if recompute else 0.0)
  span = timeline.makespan
  fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * span + 1.5), 0.55 * p + 1.6))
  for s, order in enumerate(table.orders):
    for action, t, end in zip(order, timeline.starts[s], timeline.ends(s)):
      color = _SHADES[action.kind][min(action.chunk, 4)]
      ax.add_patch(Rectangle((t, s), end - t, 0.9, facecolor=color, edgecolor="white", lw=0.8))
      ax.text((t + end) / 2, s + 0.45, str(action.microbatch + 1), ha="center", va="center",
              fontsize=7, color="white" if action.chunk else "black")
  ax.set_xlim(0, span)
  ax.set_ylim(p, 0)
  ax.set_yticks([s + 0.45 for s in range(p)], [f"stage {s}" for s in range(p)])
  unit = ("tick (one pass)" if recompute is None else
          f"time (a stage's forward = 1; recompute={recompute})")
  ax.set_xlabel(unit)
  for side in ("top", "right", "left"):
    ax.spines[side].set_visible(False)
  bubble = (f"idle {table.idle_ticks} of {table.ticks} ticks" if recompute is None else
            f"idle {timeline.bubble:.2f} of {span:.2f}")
  ax.set_title(f"{_NAMES[table.schedule]}: p={p}, v={table.virtual}, m={table.microbatches}, "
               f"latency={table.latency}  |  bubble {timeline.bubble_fraction:.3f} ({bubble})  "
               f"|  peak in-flight {list(table.peak_inflight)}", fontsize=9)
  kinds = "FBW" if table.split_backward else "FB"
  handles = [Patch(color=_SHADES[k][c], label=f"{k} chunk {c}") for k in kinds
             for c in range(table.virtual)]
  ax.legend(handles=handles, ncol=len(handles), fontsize=7, loc="upper center",
            bbox_to_anchor=(0.5, -0.32 if p < 4 else -0.18), frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=140)
  plt.close(fig)


def figures(table: schedule_lib.Table, hop: float = 0.1) -> dict:
  """One table's record: ticks, bubble in ticks and in time, peak in-flight."""
  p, v, m = table.stages, table.virtual, table.microbatches
  out = {
      "schedule": table.schedule, "stages": p, "virtual": v, "microbatches": m,
      "latency_ticks": table.latency, "ticks": table.ticks,
      "busy_ticks_per_stage": table.busy_ticks, "idle_ticks_per_stage": table.idle_ticks,
      "bubble_fraction_ticks": table.bubble_fraction,
      # No table without a split backward is shorter (tests/test_schedule.py); W can trail.
      "fill_drain_lower_bound_ticks": (None if table.split_backward else
                                       table.busy_ticks + 2 * (p - 1) * (1 + table.latency)),
      "peak_inflight_per_stage": list(table.peak_inflight),
      "peak_awaiting_weight_per_stage": list(table.peak_awaiting_weight),
      "messages": len(table.messages),
  }
  for recompute in schedule_lib.RECOMPUTES:
    costs, h = _costs(table, recompute), hop
    timeline = table.timeline(costs, h)
    out[f"recompute_{recompute}"] = {     # in stage-forward-times (_costs)
        "hop_forward_times": h, "busy": timeline.busy, "bubble": timeline.bubble,
        "bubble_fraction": timeline.bubble_fraction, "step_free_running": timeline.makespan,
        "step_lock_step": table.lockstep_time(costs, h)}
  return out


def zb_h1_comparison(hop: float = 0.0) -> list:
  """ZB-H1 against Qi et al.'s (p-1)(T_F+T_B-T_W) and against 1F1B's (p-1)(T_F+T_B+T_W), at
  equal peak in-flight microbatches, for both recompute choices (in forward-times)."""
  rows = []
  for p, m in ((4, 8), (4, 32), (8, 16), (8, 64)):
    zb, one = schedule_lib.build("zb_h1", p, 1, m), schedule_lib.build("1f1b", p, 1, m)
    for recompute in schedule_lib.RECOMPUTES:
      c = schedule_lib.pass_costs(recompute)
      zb_t, one_t = zb.timeline(c, hop), one.timeline(c, hop)
      rows.append({
          "stages": p, "microbatches": m, "recompute": recompute, "costs": c,
          "zb_h1_bubble": zb_t.bubble, "paper_zb_h1": (p - 1) * (c["F"] + c["B"] - c["W"]),
          "1f1b_bubble": one_t.bubble, "paper_1f1b": (p - 1) * (c["F"] + c["B"] + c["W"]),
          "zb_h1_step": zb_t.makespan, "1f1b_step": one_t.makespan,
          "speedup": one_t.makespan / zb_t.makespan,
          "zb_h1_peak_inflight": max(zb.peak_inflight),
          "1f1b_peak_inflight": max(one.peak_inflight)})
  return rows


def _stem(table) -> str:
  return (f"{table.schedule}-p{table.stages}-v{table.virtual}-m{table.microbatches}"
          f"-lat{table.latency}")


def _one(schedule, p, v, m, latency, recompute, hop, out_dir, tag="") -> tuple:
  table = schedule_lib.build(schedule, p, v, m, latency)
  suffix = tag + (f"-{recompute}" if recompute else "")
  png = os.path.join(out_dir, _stem(table) + suffix + ".png")
  draw(table, png, recompute, hop)
  return table, png


def main(argv):
  del argv
  try:
    run()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def run() -> None:
  """Draws and records what the flags ask for."""
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  device = {"platform": "python", "note": "pure-Python table"}
  hop = _HOP.value
  if not _ALL.value:
    table, png = _one(_SCHEDULE.value, _STAGES.value, _VIRTUAL.value, _MICROBATCHES.value,
                      _LATENCY.value, _RECOMPUTE.value, hop, _OUT_DIR.value)
    record = results.write_record(f"pipeline_schedule-{_stem(table)}", figures(table, hop),
                                  out_dir=_OUT_DIR.value, device=device,
                                  extra={"png": os.path.relpath(png, results.REPO_ROOT)})
    print(f"[pipeline_schedule] {_stem(table)}: idle {table.idle_ticks} of {table.ticks} ticks, "
          f"peak in-flight {list(table.peak_inflight)}; wrote {png} and {record}")
    return
  rows, pngs = [], []
  for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
    for latency in (0, 1):
      for recompute in (None, "none"):
        table, png = _one(schedule, 4, v, 8, latency, recompute, hop, _OUT_DIR.value,
                          tag="-all")
        pngs.append(os.path.relpath(png, results.REPO_ROOT))
      rows.append(figures(table, hop))
      fig = rows[-1]
      print(f"[pipeline_schedule] {_stem(table)}: {table.ticks} ticks (bound "
            f"{fig['fill_drain_lower_bound_ticks']}), idle {table.idle_ticks}; bubble "
            f"{fig['recompute_none']['bubble']:.2f} (recompute none) / "
            f"{fig['recompute_full']['bubble']:.2f} (full) forward-times; peak in-flight "
            f"{list(table.peak_inflight)}")
  comparison = zb_h1_comparison()
  for row in comparison:
    print(f"[pipeline_schedule] ZB-H1 p={row['stages']} m={row['microbatches']} "
          f"recompute={row['recompute']}: bubble {row['zb_h1_bubble']:.1f} (paper "
          f"{row['paper_zb_h1']:.1f}) vs 1F1B {row['1f1b_bubble']:.1f} (paper "
          f"{row['paper_1f1b']:.1f}), step x{row['speedup']:.3f} faster at peak in-flight "
          f"{row['zb_h1_peak_inflight']} vs {row['1f1b_peak_inflight']}")
  record = results.write_record(
      "pipeline_schedule-all", {"tables": rows, "zb_h1_vs_1f1b": comparison},
      out_dir=_OUT_DIR.value, device=device,
      extra={"pngs": pngs, "hop_forward_times": hop,
             "paper": "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024, section 2; "
                      "authors' table (T_F=T_B=T_W): bubble rate 1F1B (p-1)/m, ZB-H1 (p-1)/3m, "
                      "1x activation memory"})
  print(f"[pipeline_schedule] wrote {len(pngs)} PNGs and {record}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
