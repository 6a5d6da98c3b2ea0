"""Markdown tables and plots of `experiments/scaling_curves.py`'s outputs (no computation).

Each function takes what `scaling_curves.run` / `run_validation` computed and formats it:
the rows against the paper with their intervals, the breakdown of each iteration, the
validation protocols, the paper's own time split, the 530B-vs-175B comparison, and the plots.
"""
from mscale_jax.perf import fit, paper
from mscale_jax.perf.iteration import BREAKDOWN_KEYS

SCALE_SWITCHES = ("stragglers", "slow_nodes", "ecmp_collisions", "launch_skew")


def _f(value, spec=".1f", empty=""):
  """`value` formatted with `spec`, or `empty` for None."""
  return empty if value is None else format(value, spec)


def rows_table(results: list, bands: list | None) -> list:
  """Paper vs ours per row, with the interval, its micro-batch range and the constants' band."""
  lines = ["| table | model | system | GPUs | batch | fitted | paper MFU | paper, from its "
           "throughput | ours | micro-batch | interval (80%) | micro-batch range | "
           "constants' band | ours - paper |", "|" + "---|" * 14]
  for i, (row, pred) in enumerate(results):
    band = bands[i] if bands else None
    target = paper.target_mfu(row)
    ours = 100 * pred.mfu
    cells = [row.table, row.model.name, row.system, str(row.gpus), str(row.global_batch),
             "yes" if target is not None else "no", _f(row.paper_mfu),
             _f(paper.throughput_mfu(row)), f"{ours:.1f}", str(pred.layout.micro_batch),
             "" if band is None else f"{band['low']:.1f}-{band['high']:.1f}",
             "" if band is None else f"{band['nuisance'][0]:.1f}-{band['nuisance'][1]:.1f}",
             "" if band is None else f"{band['constants'][0]:.1f}-{band['constants'][1]:.1f}",
             "" if target is None else f"{ours - target:+.1f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def scale_effects_table(results: list, effects: list) -> list:
  """MFU points each scale-effect switch costs per row (Table 3 left out: all 256 GPUs)."""
  lines = ["| table | model | system | GPUs | " + " | ".join(SCALE_SWITCHES) + " |",
           "|" + "---|" * (4 + len(SCALE_SWITCHES))]
  for (row, _), costs in zip(results, effects):
    if row.table != "table3":
      cells = " | ".join(f"{costs[k]:.2f}" for k in SCALE_SWITCHES)
      lines.append(f"| {row.table} | {row.model.name} | {row.system} | {row.gpus} | {cells} |")
  return lines


def breakdown_table(results: list) -> list:
  """Layout, recomputation, memory and the seconds of each breakdown term per row."""
  lines = ["| table | model | system | GPUs | batch | layout | recompute | memory GB | iter | "
           + " | ".join(BREAKDOWN_KEYS) + " |", "|" + "---|" * (9 + len(BREAKDOWN_KEYS))]
  for row, pred in results:
    lay = pred.layout
    layout = f"tp{lay.tp} pp{lay.pp} v{lay.vpp} dp{lay.dp} mb{lay.micro_batch}"
    cells = " | ".join(f"{pred.breakdown[k]:.2f}" for k in BREAKDOWN_KEYS)
    lines.append(f"| {row.table} | {row.model.name} | {row.system} | {row.gpus} | "
                 f"{row.global_batch} | {layout} | {pred.recompute} | "
                 f"{pred.memory.total / 1e9:.1f} | {pred.iteration_s:.2f} | {cells} |")
  return lines


def protocols_table(validations: list, coverage: dict) -> list:
  """One line per protocol: fit, in-sample and out-of-sample errors, achieved coverage."""
  lines = ["| protocol | fit rows | in-sample RMS / worst | held-out rows | out-of-sample RMS / "
           "worst | mean (bias) | coverage of its held-out rows |", "|---|---|---|---|---|---|---|"]
  for v in validations:
    oos = v.out_of_sample
    name = v.protocol.name
    if not oos:
      lines.append(f"| {v.name} | {len(v.fit.rows)} | {v.fit.rms:.2f} / {v.fit.worst:.2f} | 0 "
                   f"| | | |")
      continue
    cov = coverage.get(name)
    lines.append(f"| {v.name} | {len(v.fit.rows)} | {v.fit.rms:.2f} / {v.fit.worst:.2f} | "
                 f"{len(oos)} | {fit.rms(oos):.2f} / {max(abs(e) for e in oos):.2f} | "
                 f"{sum(oos) / len(oos):+.2f} | "
                 f"{'n/a' if cov is None else format(100 * cov, '.0f') + '%'} |")
  return lines


def held_out_table(validations: list, model) -> list:
  """Every counted held-out row: error, micro-batch range, distance, inside its interval?"""
  lines = ["| protocol | table | system | GPUs | batch | paper | ours | micro-batch range | "
           "distance | error | half-width | inside |", "|" + "---|" * 12]
  for v in validations:
    for h in v.counted:
      width = model.half_width(h.distance)
      inside = h.low - width <= h.target <= h.high + width
      lines.append(f"| {v.protocol.name} | {h.row.table} | {h.row.system} | {h.row.gpus} | "
                   f"{h.row.global_batch} | {h.target:.1f} | {h.target + h.error:.1f} | "
                   f"{h.low:.1f}-{h.high:.1f} | {h.distance:.2f} | {h.error:+.2f} | "
                   f"{width:.2f} | {'yes' if inside else 'no'} |")
  return lines


def fitted_values_table(validations: list, names: tuple, ranges: dict) -> list:
  """Each fitted constant's value per protocol, with its range."""
  lines = ["| constant | range | " + " | ".join(v.protocol.name for v in validations) + " |",
           "|---|---|" + "---|" * len(validations)]
  for name in names:
    lo, hi = ranges[name]
    values = []
    for v in validations:
      value = getattr(v.fit.constants, name)
      edge = " (edge)" if value in (lo, hi) else ""
      values.append(f"{value:g}{edge}")
    lines.append(f"| {name} | {lo:g}-{hi:g} | " + " | ".join(values) + " |")
  return lines


def time_split_table(model_seconds) -> list:
  """The paper's Table 2 times split into per-sequence and fixed seconds, and the model's."""
  lines = ["| system | batch | paper: s per sequence per pipeline | paper: fixed s | "
           "model: s per sequence | model: fixed s | paper's residuals (s) |",
           "|---|---|---|---|---|---|---|"]
  for system in ("megatron", "megascale"):
    for batch in (768, 6144):
      ours = paper.time_split(system, batch)
      model = paper.time_split(system, batch, model_seconds)
      residuals = ", ".join(f"{g}: {r:+.2f}" for g, r in ours["residuals"].items())
      lines.append(f"| {system} | {batch} | {ours['per_sequence']:.4f} | {ours['fixed']:.2f} | "
                   f"{model['per_sequence']:.4f} | {model['fixed']:.2f} | {residuals} |")
  return lines


def weak_scaling_table(comparison: list) -> list:
  """530B against 175B: where each iteration's time goes, in percent of the iteration."""
  lines = ["| model | system | GPUs | batch | micro-batch x count | bubble | last-stage head | "
           "exposed DP | stragglers + slow machines | MFU |", "|" + "---|" * 10]
  for c in comparison:
    lines.append(f"| {c['model']} | {c['system']} | {c['gpus']} | {c['batch']} | "
                 f"{c['micro_batch']} x {c['micro_batches']} | {c['bubble']:.1f}% | "
                 f"{c['head']:.1f}% | {c['dp']:.1f}% | {c['stragglers']:.1f}% | "
                 f"{c['mfu']:.1f} |")
  return lines


def sensitivity_table(entries: list, c) -> list:
  """+-10% per float constant: the largest MFU move and the worst error after."""
  lines = ["| constant | value | largest MFU move (points) | worst error vs paper after |",
           "|---|---|---|---|"]
  for name, move, worst in entries:
    lines.append(f"| {name} | {getattr(c, name):.3g} | {move:.2f} | {worst:.2f} |")
  return lines


def plot_scaling(path: str, results: list, bands: list | None = None) -> None:
  """MFU against GPUs for both systems: 175B (both batches of Table 2) and 530B, each model
  curve with its prediction interval as a band; the paper's figures (from its throughput) as
  open markers."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  bands = bands or [None] * len(results)
  fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
  for ax, model in zip(axes, ("175B", "530B")):
    for system, color in (("megatron", "tab:blue"), ("megascale", "tab:red")):
      pts = sorted((r.gpus, 100 * p.mfu, paper.target_mfu(r), r.global_batch, b)
                   for (r, p), b in zip(results, bands)
                   if r.model.name == model and r.system == system and r.table != "table3")
      groups = sorted({q[3] for q in pts}) if model == "175B" else ["= GPUs"]
      for batch, style in zip(groups, ("-o", "--s")):
        sub = [q for q in pts if q[3] == batch or batch == "= GPUs"]
        ax.plot([q[0] for q in sub], [q[1] for q in sub], style, color=color, ms=3,
                label=f"{system} model (batch {batch})")
        if all(q[4] is not None for q in sub):
          ax.fill_between([q[0] for q in sub], [q[4]["low"] for q in sub],
                          [q[4]["high"] for q in sub], color=color, alpha=0.15, lw=0)
      known = [q for q in pts if q[2] is not None]
      if known:
        ax.plot([q[0] for q in known], [q[2] for q in known], "D", color=color, ms=7,
                mfc="none", label=f"{system} paper")
    ax.set_xscale("log")
    ticks = sorted({r.gpus for r, _ in results if r.model.name == model and r.table != "table3"})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks], rotation=45, fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("MFU (%), Megatron formula")
    ax.set_title(f"{model}: model (band: 80% prediction interval) vs paper")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_waterfall(path: str, results: list) -> None:
  """Table 3 as a waterfall: each step's MFU gain, model bars against the paper's steps."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [(r.system, 100 * p.mfu, paper.target_mfu(r)) for r, p in results
           if r.table == "table3"]
  fig, ax = plt.subplots(figsize=(10, 4))
  prev = None
  for i, (name, ours, paper_mfu) in enumerate(steps):
    base = 0.0 if prev is None else prev
    height = ours if prev is None else ours - prev
    ax.bar(i, height, bottom=base, color="tab:gray" if prev is None else
           ("tab:green" if height >= 0 else "tab:red"), width=0.6)
    ax.plot([i - 0.3, i + 0.3], [paper_mfu, paper_mfu], color="black", lw=2)
    ax.text(i, max(ours, paper_mfu) + 0.4, f"{ours:.1f}\n({paper_mfu:.1f})", ha="center",
            fontsize=7)
    prev = ours
  ax.plot([], [], color="black", lw=2, label="paper (cumulative); labels: ours (paper)")
  ax.set_xticks(range(len(steps)), [s[0] for s in steps], rotation=30, ha="right")
  ax.set_ylim(40, 72)
  ax.set_ylabel("MFU (%)")
  ax.set_title("Table 3 ablation (175B, 256 GPUs): model steps vs paper")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def dp_comm_table(entries: list) -> list:
  """scaling_curves.md's section for --dp_comm=sdp4bit: every row with `none` and SDP4Bit."""
  lines = ["## SDP4Bit's quantized DP collectives on the same rows (`--dp_comm=sdp4bit`)", "",
           "Each row's layout, micro-batch and recomputation, at each inter-node bandwidth per "
           "node; `none` is the row's own DP collectives, `sdp4bit` SDP4Bit's two-level ones "
           "(`mscale_jax/perf/dp_comm.py`). MFU in percent.", "",
           "| table | model | system | GPUs | batch | Gb/s per node | DP share (none) | "
           "MFU none | MFU sdp4bit | speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
  for e in entries:
    lines.append(f"| {e['table']} | {e['model']} | {e['system']} | {e['gpus']} | "
                 f"{e['global_batch']} | {e['node_gbps']:g} | {100 * e['none_dp_share']:.1f}% | "
                 f"{e['none_mfu']:.1f} | {e['sdp4bit_mfu']:.1f} | {e['speedup']:.2f}x |")
  return lines


def plot_dp_comm(path: str, entries: list) -> None:
  """MFU against GPUs of Table 2's and Figure 9's rows, `none` (solid) and SDP4Bit (dashed),
  one panel per inter-node bandwidth."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  speeds = sorted({e["node_gbps"] for e in entries})
  fig, axes = plt.subplots(1, len(speeds), figsize=(5 * len(speeds), 4.6), squeeze=False)
  for ax, gbps in zip(axes[0], speeds):
    curves = sorted({(e["model"], e["system"], e["global_batch"] if e["model"] == "175B" else 0)
                     for e in entries if e["table"] != "table3"})
    for i, (model, system, batch) in enumerate(curves):
      pts = sorted((e["gpus"], e["none_mfu"], e["sdp4bit_mfu"]) for e in entries
                   if e["node_gbps"] == gbps and e["table"] != "table3" and e["model"] == model
                   and e["system"] == system and (batch == 0 or e["global_batch"] == batch))
      label = f"{model} {system}" + (f" b{batch}" if batch else "")
      color = f"C{i}"
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=color, ms=3, label=label)
      ax.plot([p[0] for p in pts], [p[2] for p in pts], "--^", color=color, ms=3)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("MFU (%), Megatron formula")
    ax.set_title(f"{gbps:g} Gb/s per node: none (solid) vs SDP4Bit (dashed)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
