r"""Reproduces the paper's MFU tables from the performance model, and predicts its larger runs.

  python -m experiments.scaling_curves                      # writes results/scaling_curves/
  python -m experiments.scaling_curves --validate           # + the out-of-sample protocol
  python -m experiments.scaling_curves --out_dir=/tmp/sc \
      --calibrate=results/kernel_bench-gemm-gpu-<stamp>.json

Rows: Table 3 (ablation, 175B, 256 GPUs), the batch-768 rows of Table 2 (175B, 256-1,024 GPUs)
for Megatron-LM and MegaScale, and the larger runs (175B at batch 6,144 on 3,072-12,288 GPUs,
530B weak scaling), all from one set of constants (`mscale_jax.perf.constants.DEFAULT`, or its
calibrated copy), each with a prediction interval from the constants' documented ranges
(`mscale_jax.perf.sensitivity.prediction_intervals`). Writes scaling_curves.csv,
scaling_curves.md, two PNG plots and a JSON record. --validate also fits the constants on subsets
of the paper's rows and reports the held-out errors (`mscale_jax.perf.fit`; validation.md and
its own record). MFU is the paper's: Megatron FLOPs per token over 312 TFLOP/s per GPU
(mscale_jax.flops).
"""
import csv
import dataclasses
import os
import sys

from absl import app, flags

from mscale_jax.errors import ConfigError
from mscale_jax.perf import calibrate, constants, fit, hardware, paper, sensitivity
from mscale_jax.perf.iteration import BREAKDOWN_KEYS

CSV_COLUMNS = ("table", "model", "system", "gpus", "global_batch", "predicted_mfu", "paper_mfu",
               "predicted_low", "predicted_high")
SCALE_SWITCHES = ("stragglers", "slow_nodes", "ecmp_collisions", "launch_skew")


def role(row) -> str:
  """'fitted' (the default constants were fitted to it), 'held out' (a paper figure no fit
  sees) or 'predicted' (no paper figure in our notes)."""
  if row.table == "table3" or (row.table == "table2" and row.global_batch == 768):
    return "fitted"
  return "predicted" if row.paper_mfu is None else "held out"


def fit_rows(rows: list) -> list:
  """The rows the default constants are fitted to: Tables 2 and 3."""
  return [r for r in rows if role(r) == "fitted"]


def predict_rows(hw, c) -> list:
  """(row, prediction) for every row of `paper.rows()`, all with constants `c`."""
  return [(row, paper.predict_row(row, hw, c)) for row in paper.rows()]


def csv_record(row, pred, interval=None) -> dict:
  """One CSV line: MFU in percent, paper_mfu (and an absent interval) empty where none."""
  low, high = ("", "") if interval is None else (round(interval[0], 2), round(interval[1], 2))
  return {"table": row.table, "model": row.model.name, "system": row.system, "gpus": row.gpus,
          "global_batch": row.global_batch, "predicted_mfu": round(100 * pred.mfu, 2),
          "paper_mfu": "" if row.paper_mfu is None else row.paper_mfu,
          "predicted_low": low, "predicted_high": high}


def write_csv(path: str, results: list, intervals: list | None = None) -> None:
  """Writes one CSV line per row with `CSV_COLUMNS`."""
  intervals = intervals or [None] * len(results)
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for (row, pred), interval in zip(results, intervals):
      writer.writerow(csv_record(row, pred, interval))


def scale_effects(results: list, hw, c) -> list:
  """Per row: MFU points each scale-effect switch costs (all on minus that one off)."""
  out = []
  for row, pred in results:
    costs = {}
    for name in SCALE_SWITCHES:
      off = paper.predict_row(row, hw, dataclasses.replace(c, **{name: False}))
      costs[name] = 100 * (off.mfu - pred.mfu)
    out.append(costs)
  return out


def markdown(results: list, notes: list, intervals: list | None = None,
             effects: list | None = None) -> str:
  """Paper vs ours (with interval) per row, marked fitted / held out / predicted; what each
  scale effect costs; then each row's breakdown (seconds per iteration)."""
  intervals = intervals or [None] * len(results)
  lines = ["# Scaling curves: paper vs performance model", "",
           "MFU in percent (Megatron formula, 312 TFLOP/s per A100). Produced by "
           "`python -m experiments.scaling_curves`; every row uses the same constants. Role: "
           "*fitted* rows are the ones the default constants were fitted to (Tables 2 and 3); "
           "*held out* rows have a paper figure that no fit ever sees; *predicted* rows have "
           "none in our notes. The interval is the prediction interval of "
           "`sensitivity.prediction_intervals` (docs/perf_model.md, 'Error bars').", ""]
  lines += [f"- {n}" for n in notes] + [""]
  lines += ["| table | model | system | GPUs | batch | role | paper | ours | interval | diff |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for (row, pred), interval in zip(results, intervals):
    ours = 100 * pred.mfu
    paper_s = "" if row.paper_mfu is None else f"{row.paper_mfu:.1f}"
    diff = "" if row.paper_mfu is None else f"{ours - row.paper_mfu:+.1f}"
    band = "" if interval is None else f"{interval[0]:.1f}-{interval[1]:.1f}"
    lines.append(f"| {row.table} | {row.model.name} | {row.system} | {row.gpus} | "
                 f"{row.global_batch} | {role(row)} | {paper_s} | {ours:.1f} | {band} | {diff} |")
  if effects:
    lines += ["", "## What each scale effect costs (MFU points: that switch off minus all on)",
              "", "| table | model | system | GPUs | " + " | ".join(SCALE_SWITCHES) + " |",
              "|" + "---|" * (4 + len(SCALE_SWITCHES))]
    for (row, _), costs in zip(results, effects):
      if row.table == "table3":
        continue
      cells = " | ".join(f"{costs[k]:.2f}" for k in SCALE_SWITCHES)
      lines.append(f"| {row.table} | {row.model.name} | {row.system} | {row.gpus} | {cells} |")
  lines += ["", "## Breakdown of each iteration (seconds)", "",
            "| table | model | system | GPUs | batch | layout | recompute | memory GB | iter | "
            + " | ".join(BREAKDOWN_KEYS) + " |",
            "|" + "---|" * (9 + len(BREAKDOWN_KEYS))]
  for row, pred in results:
    lay = pred.layout
    layout = f"tp{lay.tp} pp{lay.pp} v{lay.vpp} dp{lay.dp} mb{lay.micro_batch}"
    cells = " | ".join(f"{pred.breakdown[k]:.2f}" for k in BREAKDOWN_KEYS)
    lines.append(f"| {row.table} | {row.model.name} | {row.system} | {row.gpus} | "
                 f"{row.global_batch} | {layout} | {pred.recompute} | "
                 f"{pred.memory.total / 1e9:.1f} | {pred.iteration_s:.2f} | {cells} |")
  return "\n".join(lines) + "\n"


def sensitivity_markdown(rows: list, hw, c) -> str:
  """A section listing how far +-10% in each float constant moves the reproduced rows."""
  lines = ["", "## Sensitivity: each constant scaled by 0.9 and 1.1, the others held", "",
           "| constant | value | largest MFU move (points) | worst error vs paper after |",
           "|---|---|---|---|"]
  for name, move, worst in sensitivity.sensitivity(rows, 0.1, hw, c):
    lines.append(f"| {name} | {getattr(c, name):.3g} | {move:.2f} | {worst:.2f} |")
  lines += ["", "The GEMM efficiency sets the absolute level (every row moves with it); the "
            "steps between rows come from the mechanisms, which the other constants size."]
  return "\n".join(lines) + "\n"


def plot_scaling(path: str, results: list, intervals: list | None = None) -> None:
  """MFU against GPUs for both systems: 175B (Table 2 and the batch-6144 runs) and 530B, each
  model curve with its prediction interval as a band; paper figures as crosses (filled where
  the constants were fitted to them, open where held out)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  intervals = intervals or [None] * len(results)
  fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
  for ax, model in zip(axes, ("175B", "530B")):
    for system, color in (("megatron", "tab:blue"), ("megascale", "tab:red")):
      pts = sorted((r.gpus, 100 * p.mfu, r.paper_mfu, r.global_batch, iv, role(r))
                   for (r, p), iv in zip(results, intervals)
                   if r.model.name == model and r.system == system and r.table != "table3")
      groups = sorted({q[3] for q in pts}) if model == "175B" else ["= GPUs"]
      for batch, style in zip(groups, ("-o", "--s")):
        sub = [q for q in pts if q[3] == batch or batch == "= GPUs"]
        ax.plot([q[0] for q in sub], [q[1] for q in sub], style, color=color, ms=3,
                label=f"{system} model (batch {batch})")
        if all(q[4] is not None for q in sub):
          ax.fill_between([q[0] for q in sub], [q[4][0] for q in sub], [q[4][1] for q in sub],
                          color=color, alpha=0.15, lw=0)
      for which, marker in (("fitted", "x"), ("held out", "D")):
        known = [q for q in pts if q[2] is not None and q[5] == which]
        if known:
          ax.plot([q[0] for q in known], [q[2] for q in known], marker, color=color, ms=8,
                  mfc="none", label=f"{system} paper ({which})")
    ax.set_xscale("log")
    ticks = sorted({r.gpus for r, _ in results if r.model.name == model and r.table != "table3"})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks], rotation=45, fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("MFU (%)")
    ax.set_title(f"{model}: model (band: prediction interval) vs paper")
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
  steps = [(r.system, 100 * p.mfu, r.paper_mfu) for r, p in results if r.table == "table3"]
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


def interval_markdown(moves: dict) -> str:
  """A section listing how far each constant moves some row within its interval sweep."""
  lines = ["", "## Error bars: the largest move of any row per constant (MFU points)", "",
           "Unfitted constants at each end of their documented range; fitted ones as far as "
           "the fitted rows allow (95% profile); the level re-fitted after each change.", "",
           "| constant | fitted | largest move |", "|---|---|---|"]
  for name, move in sorted(moves.items(), key=lambda t: -t[1]):
    lines.append(f"| {name} | {'yes' if name in constants.FITTED else 'no'} | {move:.2f} |")
  return "\n".join(lines) + "\n"


def run(out_dir: str, calibration: str | None = None, hw_name: str = "a100_megascale",
        allow_other_device: bool = False, intervals: bool = True) -> dict:
  """Predicts every row, writes the outputs to `out_dir`; returns {'paths', 'results', ...}.

  A calibration record must come from the accelerator `hw_name` models unless
  `allow_other_device`. `intervals=False` leaves the interval columns empty (faster).
  """
  from experiments.results import write_record
  hw = hardware.get_hardware(hw_name)
  c = constants.DEFAULT
  notes = ["No GPU benchmark record was used: efficiency constants are the documented defaults "
           "(the seven fitted ones as `fit.fit` returns them on Tables 2 and 3)."]
  moves = []
  if calibration:
    c, note = calibrate.calibrated(constants.DEFAULT, calibration, hw,
                                   allow_other_device=allow_other_device)
    notes = [note]
  results = predict_rows(hw, c)
  if calibration:
    for (row, pred), (_, old) in zip(results, predict_rows(hw, constants.DEFAULT)):
      moves.append(f"{row.table} {row.model.name} {row.system} {row.gpus} GPUs: "
                   f"{100 * old.mfu:.1f} -> {100 * pred.mfu:.1f}")
  bounds, interval_moves = None, {}
  if intervals:
    bounds, interval_moves = sensitivity.prediction_intervals(
        [r for r, _ in results], fit_rows([r for r, _ in results]), hw, c)
  effects = scale_effects(results, hw, c)
  os.makedirs(out_dir, exist_ok=True)
  paths = {name: os.path.join(out_dir, name) for name in
           ("scaling_curves.csv", "scaling_curves.md", "mfu_vs_gpus.png", "ablation_waterfall.png")}
  write_csv(paths["scaling_curves.csv"], results, bounds)
  md = markdown(results, notes, bounds, effects)
  if moves:
    md += "\n## How calibration moved each prediction (MFU %)\n\n" + "\n".join(
        f"- {m}" for m in moves) + "\n"
  if interval_moves:
    md += interval_markdown(interval_moves)
  md += sensitivity_markdown([r for r, _ in results if role(r) == "fitted"], hw, c)
  with open(paths["scaling_curves.md"], "w") as f:
    f.write(md)
  plot_scaling(paths["mfu_vs_gpus.png"], results, bounds)
  plot_waterfall(paths["ablation_waterfall.png"], results)
  figures = [{**csv_record(r, p, None if bounds is None else bounds[i]), "role": role(r),
              "iteration_s": p.iteration_s, "breakdown_s": p.breakdown,
              "scale_effect_points": effects[i], "micro_batch": p.layout.micro_batch,
              "recompute": p.recompute, "memory_gb": p.memory.total / 1e9}
             for i, (r, p) in enumerate(results)]
  paths["record"] = write_record(
      "scaling_curves", figures, out_dir=out_dir,
      device={"platform": "model", "device_kind": hw.name},
      extra={"notes": notes, "calibration": calibration, "calibration_moves": moves,
             "fitted_constants": {n: getattr(c, n) for n in constants.FITTED},
             "interval_moves": interval_moves})
  return {"paths": paths, "results": results, "notes": notes, "moves": moves,
          "intervals": bounds}


def validation_lines(validations: list) -> list:
  """The validation protocol's outcome as markdown lines (also what --validate prints)."""
  lines = ["| protocol | fitted constants | fit rows | in-sample RMS / worst | held-out rows | "
           "out-of-sample RMS / worst |", "|---|---|---|---|---|---|"]
  for v in validations:
    oos = v.out_of_sample
    lines.append(f"| {v.name} | {len(v.fit.names)} | {len(v.fit.rows)} | "
                 f"{v.fit.rms:.2f} / {v.fit.worst:.2f} | {len(oos)} | "
                 f"{fit.rms(oos):.2f} / {max(abs(e) for e in oos):.2f} |")
  lines += ["", "Held-out rows (error = ours - paper, MFU points):", "",
            "| protocol | table | system | GPUs | batch | paper | error |",
            "|---|---|---|---|---|---|---|"]
  for v in validations:
    for row, err, dup in v.held_out:
      note = " (the same run as fitted Table 3 'lamb'; not counted)" if dup else ""
      lines.append(f"| {v.name.split(':')[0]} | {row.table} | {row.system} | {row.gpus} | "
                   f"{row.global_batch} | {row.paper_mfu:.1f} | {err:+.2f}{note} |")
  lines += ["", "Fitted values per protocol:", "",
            "| constant | range | " + " | ".join(v.name.split(':')[0] for v in validations) + " |",
            "|---|---|" + "---|" * len(validations)]
  for name in constants.FITTED:
    lo, hi = constants.RANGES[name]
    lines.append(f"| {name} | {lo:g}-{hi:g} | " + " | ".join(
        f"{getattr(v.fit.constants, name):g}" for v in validations) + " |")
  return lines


def summary_lines(validations: list) -> list:
  """One line per protocol: out-of-sample RMS / worst."""
  return [f"| {v.name} | {fit.rms(v.out_of_sample):.2f} / "
          f"{max(abs(e) for e in v.out_of_sample):.2f} |" for v in validations]


def run_validation(out_dir: str, hw_name: str = "a100_megascale",
                   points: int = fit.GRID_POINTS, compare_off: bool = True) -> dict:
  """Runs `fit.validate`, writes validation.md and a record; returns {'paths', 'validations'}.

  With `compare_off`, the protocol runs again with every scale effect switched off, so the
  report shows what the scale mechanisms do to the out-of-sample errors.
  """
  from experiments.results import write_record
  hw = hardware.get_hardware(hw_name)
  validations = fit.validate(hw, constants.DEFAULT, points=points)
  off = dataclasses.replace(constants.DEFAULT, **{s: False for s in SCALE_SWITCHES})
  validations_off = fit.validate(hw, off, points=points) if compare_off else []
  full = validations[-1].fit.constants
  same = all(getattr(full, n) == getattr(constants.DEFAULT, n) for n in constants.FITTED)
  fitted = ", ".join(constants.FITTED)
  lines = ["# Validation: fit on some of the paper's rows, predict the others", "",
           "Produced by `python -m experiments.scaling_curves --validate`. Each protocol fits "
           f"the {len(constants.FITTED)} constants of `constants.FITTED` ({fitted}) on a "
           f"{points}-point grid within their documented ranges (`fit.fit`: coordinate then "
           "pairwise search minimising the RMS error, from the middle of every range); all "
           "other constants keep their source values; scale effects are never fitted.", "",
           f"The default constants {'are' if same else 'are NOT'} the 'full' protocol's fit.", ""]
  lines += validation_lines(validations)
  if validations_off:
    lines += ["", "The same protocols with every scale effect switched off (refitted), "
              "out-of-sample RMS / worst:", "", "| protocol | scale effects off |", "|---|---|"]
    lines += summary_lines(validations_off)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "validation.md")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  figures = []
  for v in validations:
    oos = v.out_of_sample
    figures.append({"protocol": v.name, "fitted_constants": len(v.fit.names),
                    "fit_rows": len(v.fit.rows), "in_sample_rms": v.fit.rms,
                    "in_sample_worst": v.fit.worst, "held_out_rows": len(oos),
                    "out_of_sample_rms": fit.rms(oos),
                    "out_of_sample_worst": max(abs(e) for e in oos),
                    "held_out": [{"table": r.table, "system": r.system, "gpus": r.gpus,
                                  "global_batch": r.global_batch, "paper_mfu": r.paper_mfu,
                                  "error": e, "same_run_as_fitted": d} for r, e, d in v.held_out],
                    "constants": {n: getattr(v.fit.constants, n) for n in v.fit.names}})
  off_figures = [{"protocol": v.name, "in_sample_rms": v.fit.rms,
                  "out_of_sample_rms": fit.rms(v.out_of_sample),
                  "out_of_sample_worst": max(abs(e) for e in v.out_of_sample)}
                 for v in validations_off]
  record = write_record("scaling_curves-validate", figures, out_dir=out_dir,
                        device={"platform": "model", "device_kind": hw.name},
                        extra={"grid_points": points, "defaults_are_full_fit": same,
                               "scale_effects_off": off_figures})
  return {"paths": {"validation.md": path, "record": record}, "validations": validations,
          "lines": lines, "defaults_are_full_fit": same}


def run_first_contact(out_dir: str, hw_name: str = "a100_megascale") -> dict:
  """Protocol (c), first contact: the default constants predict the batch-6,144 Table 2 rows.

  The defaults were fitted to Table 3 and the batch-768 rows of Table 2 only, so the four
  batch-6,144 GPU counts (both systems) are predicted without them. Run once, before the model
  was changed for them (issue 25); its record is kept and cited, never overwritten. Each row
  also gets the interval the model gave at the time, to say whether the paper's figure fell in it.
  """
  from experiments.results import write_record
  hw = hardware.get_hardware(hw_name)
  c = constants.DEFAULT
  rows = paper.rows()
  held = [r for r in rows if r.table == "table2" and r.global_batch == 6144]
  bounds, _ = sensitivity.prediction_intervals(held, fit_rows(rows), hw, c)
  figures, lines = [], ["| system | GPUs | batch | micro-batch | paper | ours | interval | error |",
                        "|---|---|---|---|---|---|---|---|"]
  for row, (low, high) in zip(held, bounds):
    pred = paper.predict_row(row, hw, c)
    ours = 100 * pred.mfu
    figures.append({"system": row.system, "gpus": row.gpus, "global_batch": row.global_batch,
                    "paper_mfu": row.paper_mfu, "predicted_mfu": round(ours, 2),
                    "error": round(ours - row.paper_mfu, 2), "predicted_low": round(low, 2),
                    "predicted_high": round(high, 2),
                    "paper_in_interval": low <= row.paper_mfu <= high,
                    "micro_batch": pred.layout.micro_batch, "iteration_s": pred.iteration_s})
    lines.append(f"| {row.system} | {row.gpus} | {row.global_batch} | {pred.layout.micro_batch} "
                 f"| {row.paper_mfu:.1f} | {ours:.1f} | {low:.1f}-{high:.1f} | "
                 f"{ours - row.paper_mfu:+.1f} |")
  summary = {}
  for system in ("megatron", "megascale", "both"):
    errs = [f["error"] for f in figures if system in (f["system"], "both")]
    summary[system] = {"rms": round(fit.rms(errs), 2), "worst": max(errs, key=abs),
                       "mean": round(sum(errs) / len(errs), 2),
                       "in_interval": sum(f["paper_in_interval"] for f in figures
                                          if system in (f["system"], "both"))}
  record = write_record(
      "scaling_curves-first_contact", figures, out_dir=out_dir,
      device={"platform": "model", "device_kind": hw.name},
      extra={"protocol": "c: fitted without these rows (first contact)",
             "fit_rows": "Table 3 and the batch-768 rows of Table 2 (17 rows)",
             "fitted_constants": {n: getattr(c, n) for n in constants.FITTED},
             "summary": summary,
             "note": "The 12,288-GPU rows were in our notes (and held out of every fit) when the "
                     "scale effects were added, so they are less out of sample than the "
                     "3,072-8,192-GPU rows, which no version of the model had seen."})
  return {"record": record, "figures": figures, "summary": summary, "lines": lines}


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_string("out_dir", "results/scaling_curves", "Folder for the outputs.")
  flags.DEFINE_string("calibrate", None, "A kernel_bench-gemm JSON record whose measured GEMM "
                      "efficiency replaces the modelled curve.")
  flags.DEFINE_string("hardware", "a100_megascale", "Hardware preset.")
  flags.DEFINE_bool("calibrate_any_device", False, "Apply --calibrate's record even when it was "
                    "measured on another accelerator than --hardware models.")
  flags.DEFINE_bool("intervals", True, "Compute each row's prediction interval (a few seconds).")
  flags.DEFINE_enum("protocol", None, ["first_contact"], "Run one named protocol and write its "
                    "record: 'first_contact', the default constants against the batch-6,144 rows "
                    "of Table 2, which they were fitted without.")
  flags.DEFINE_bool("validate", False, "Also run the validation protocol: fit on Table 3 only "
                    "and on the 256-GPU rows only, report the held-out errors (validation.md).")


def main(argv):
  del argv
  f = flags.FLAGS
  if f.calibrate and f.calibrate_any_device:
    print(f"[scaling_curves] note: --calibrate_any_device: the GEMM curve of {f.calibrate} is "
          f"applied to {f.hardware} whatever device it was measured on; predictions may not "
          f"describe either accelerator")
  if f.protocol == "first_contact":
    out = run_first_contact(f.out_dir, f.hardware)
    print("\n".join(out["lines"]))
    for system, figs in out["summary"].items():
      print(f"[scaling_curves] {system}: RMS {figs['rms']:.2f}, worst {figs['worst']:+.2f}, "
            f"mean {figs['mean']:+.2f}, paper in interval {figs['in_interval']}")
    print(f"[scaling_curves] wrote {out['record']}")
    return
  try:
    out = run(f.out_dir, f.calibrate, f.hardware, f.calibrate_any_device, f.intervals)
    checked = run_validation(f.out_dir, f.hardware) if f.validate else None
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  fitted = [abs(100 * p.mfu - r.paper_mfu) for r, p in out["results"] if role(r) == "fitted"]
  held = [abs(100 * p.mfu - r.paper_mfu) for r, p in out["results"] if role(r) == "held out"]
  bounds = out["intervals"] or [None] * len(out["results"])
  for (row, pred), interval in zip(out["results"], bounds):
    paper_s = "" if row.paper_mfu is None else f"paper {row.paper_mfu:5.1f}"
    band = "" if interval is None else f"[{interval[0]:5.1f}, {interval[1]:5.1f}]"
    print(f"{row.table:6s} {row.model.name:4s} {row.system:15s} {row.gpus:6d} GPUs "
          f"batch {row.global_batch:5d}: ours {100 * pred.mfu:5.1f} {band:14s} {role(row):9s} "
          f"{paper_s}")
  for note in out["notes"] + out["moves"]:
    print(f"note: {note}")
  print(f"[scaling_curves] fitted Table 2/3 rows: worst error {max(fitted):.2f} MFU points; "
        f"held-out 12,288-GPU rows: worst {max(held):.2f}")
  if checked:
    print("\n".join(checked["lines"]))
  for path in list(out["paths"].values()) + (list(checked["paths"].values()) if checked else []):
    print(f"[scaling_curves] wrote {path}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
