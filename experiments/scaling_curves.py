r"""Reproduces the paper's MFU tables from the performance model, and predicts its larger runs.

  python -m experiments.scaling_curves                      # writes results/scaling_curves/
  python -m experiments.scaling_curves --out_dir=/tmp/sc \
      --calibrate=results/kernel_bench-gemm-gpu-<stamp>.json

Rows: Table 3 (ablation, 175B, 256 GPUs), the batch-768 rows of Table 2 (175B, 256-1,024 GPUs)
for Megatron-LM and MegaScale, and the larger runs (175B at batch 6,144 on 3,072-12,288 GPUs,
530B weak scaling), all from one set of constants (`mscale_jax.perf.constants.DEFAULT`, or its
calibrated copy). Writes scaling_curves.csv, scaling_curves.md, two PNG plots and a JSON record.
MFU is the paper's: Megatron FLOPs per token over 312 TFLOP/s per GPU (mscale_jax.flops).
"""
import csv
import os
import sys

from absl import app, flags

from mscale_jax.errors import ConfigError
from mscale_jax.perf import calibrate, constants, hardware, paper, sensitivity
from mscale_jax.perf.iteration import BREAKDOWN_KEYS

CSV_COLUMNS = ("table", "model", "system", "gpus", "global_batch", "predicted_mfu", "paper_mfu")


def predict_rows(hw, c) -> list:
  """(row, prediction) for every row of `paper.rows()`, all with constants `c`."""
  return [(row, paper.predict_row(row, hw, c)) for row in paper.rows()]


def csv_record(row, pred) -> dict:
  """One CSV line: MFU in percent, paper_mfu empty where the paper gives none."""
  return {"table": row.table, "model": row.model.name, "system": row.system, "gpus": row.gpus,
          "global_batch": row.global_batch, "predicted_mfu": round(100 * pred.mfu, 2),
          "paper_mfu": "" if row.paper_mfu is None else row.paper_mfu}


def write_csv(path: str, results: list) -> None:
  """Writes one CSV line per row with `CSV_COLUMNS`."""
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for row, pred in results:
      writer.writerow(csv_record(row, pred))


def markdown(results: list, notes: list) -> str:
  """Paper vs ours vs difference per row, then each row's breakdown (seconds per iteration)."""
  lines = ["# Scaling curves: paper vs performance model", "",
           "MFU in percent (Megatron formula, 312 TFLOP/s per A100). Produced by "
           "`python -m experiments.scaling_curves`; every row uses the same constants.", ""]
  lines += [f"- {n}" for n in notes] + [""]
  lines += ["| table | model | system | GPUs | batch | paper | ours | diff |",
            "|---|---|---|---|---|---|---|---|"]
  for row, pred in results:
    ours = 100 * pred.mfu
    paper_s = "" if row.paper_mfu is None else f"{row.paper_mfu:.1f}"
    diff = "" if row.paper_mfu is None else f"{ours - row.paper_mfu:+.1f}"
    lines.append(f"| {row.table} | {row.model.name} | {row.system} | {row.gpus} | "
                 f"{row.global_batch} | {paper_s} | {ours:.1f} | {diff} |")
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


def plot_scaling(path: str, results: list) -> None:
  """MFU against GPUs for both systems: 175B (Table 2 and the batch-6144 runs) and 530B."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, model in zip(axes, ("175B", "530B")):
    for system, color in (("megatron", "tab:blue"), ("megascale", "tab:red")):
      pts = sorted((r.gpus, 100 * p.mfu, r.paper_mfu, r.global_batch) for r, p in results
                   if r.model.name == model and r.system == system and r.table != "table3")
      groups = sorted({q[3] for q in pts}) if model == "175B" else ["= GPUs"]
      for batch in groups:
        sub = [q for q in pts if q[3] == batch or batch == "= GPUs"]
        ax.plot([q[0] for q in sub], [q[1] for q in sub], "-o", color=color, ms=3,
                label=f"{system} model (batch {batch})")
      known = [q for q in pts if q[2] is not None]
      ax.plot([q[0] for q in known], [q[2] for q in known], "x", color=color, ms=9,
              label=f"{system} paper")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("MFU (%)")
    ax.set_title(f"{model}: predicted vs paper")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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


def run(out_dir: str, calibration: str | None = None, hw_name: str = "a100_megascale",
        allow_other_device: bool = False) -> dict:
  """Predicts every row, writes the outputs to `out_dir`; returns {'paths', 'results'}.

  A calibration record must come from the accelerator `hw_name` models unless
  `allow_other_device`.
  """
  from experiments.results import write_record
  hw = hardware.get_hardware(hw_name)
  c = constants.DEFAULT
  notes = ["No GPU benchmark record was used: efficiency constants are the documented defaults."]
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
  os.makedirs(out_dir, exist_ok=True)
  paths = {name: os.path.join(out_dir, name) for name in
           ("scaling_curves.csv", "scaling_curves.md", "mfu_vs_gpus.png", "ablation_waterfall.png")}
  write_csv(paths["scaling_curves.csv"], results)
  md = markdown(results, notes)
  if moves:
    md += "\n## How calibration moved each prediction (MFU %)\n\n" + "\n".join(
        f"- {m}" for m in moves) + "\n"
  md += sensitivity_markdown([r for r, _ in results if r.table != "fig9"], hw, c)
  with open(paths["scaling_curves.md"], "w") as f:
    f.write(md)
  plot_scaling(paths["mfu_vs_gpus.png"], results)
  plot_waterfall(paths["ablation_waterfall.png"], results)
  figures = [{**csv_record(r, p), "iteration_s": p.iteration_s,
              "breakdown_s": p.breakdown, "micro_batch": p.layout.micro_batch,
              "recompute": p.recompute, "memory_gb": p.memory.total / 1e9} for r, p in results]
  paths["record"] = write_record(
      "scaling_curves", figures, out_dir=out_dir,
      device={"platform": "model", "device_kind": hw.name},
      extra={"notes": notes, "calibration": calibration, "calibration_moves": moves})
  return {"paths": paths, "results": results, "notes": notes, "moves": moves}


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_string("out_dir", "results/scaling_curves", "Folder for the outputs.")
  flags.DEFINE_string("calibrate", None, "A kernel_bench-gemm JSON record whose measured GEMM "
                      "efficiency replaces the modelled curve.")
  flags.DEFINE_string("hardware", "a100_megascale", "Hardware preset.")
  flags.DEFINE_bool("calibrate_any_device", False, "Apply --calibrate's record even when it was "
                    "measured on another accelerator than --hardware models.")


def main(argv):
  del argv
  f = flags.FLAGS
  if f.calibrate and f.calibrate_any_device:
    print(f"[scaling_curves] note: --calibrate_any_device: the GEMM curve of {f.calibrate} is "
          f"applied to {f.hardware} whatever device it was measured on; predictions may not "
          f"describe either accelerator")
  try:
    out = run(f.out_dir, f.calibrate, f.hardware, f.calibrate_any_device)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  worst = max(abs(100 * p.mfu - r.paper_mfu) for r, p in out["results"]
              if r.table != "fig9" and r.paper_mfu is not None)
  for row, pred in out["results"]:
    paper_s = "" if row.paper_mfu is None else f"paper {row.paper_mfu:5.1f}"
    print(f"{row.table:6s} {row.model.name:4s} {row.system:15s} {row.gpus:6d} GPUs "
          f"batch {row.global_batch:5d}: ours {100 * pred.mfu:5.1f} {paper_s}")
  for note in out["notes"] + out["moves"]:
    print(f"note: {note}")
  print(f"[scaling_curves] worst Table 2/3 error {worst:.2f} MFU points")
  for path in out["paths"].values():
    print(f"[scaling_curves] wrote {path}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
