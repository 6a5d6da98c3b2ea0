r"""Reproduces the paper's MFU tables from the performance model, with calibrated intervals.

  python -m experiments.scaling_curves                      # writes results/scaling_curves/
  python -m experiments.scaling_curves --validate           # + validation.md and its record
  python -m experiments.scaling_curves --protocol=c         # one validation protocol, its record
  python -m experiments.scaling_curves --out_dir=/tmp/sc \
      --calibrate=results/kernel_bench-gemm-gpu-<stamp>.json
  python -m experiments.scaling_curves --dp_comm=sdp4bit --node_gbps=100,400,1600

Rows: Table 3 (ablation, 175B, 256 GPUs), Table 2 (175B, batch 768 on 256-1,024 GPUs and batch
6,144 on 3,072-12,288) for Megatron-LM and MegaScale, and the 530B weak-scaling runs (Figure 9,
no figure in our notes), all from one set of constants (`mscale_jax.perf.constants.DEFAULT`,
fitted to every row with a paper figure, or its calibrated copy). Each row's interval is its
micro-batch range (the paper gives no micro-batch) widened by the model's own out-of-sample
error at the row's extrapolation distance, calibrated to 80% coverage on the validation
protocols (`mscale_jax.perf.intervals`); the constants' documented ranges, varied jointly, are a
separate column (`sensitivity.constant_range_band`). Writes scaling_curves.csv,
scaling_curves.md, validation.md (with --validate), two PNG plots and JSON records. MFU is the
paper's: Megatron FLOPs per token over 312 TFLOP/s per GPU (mscale_jax.flops); the paper
figure a prediction is compared with is the MFU of the paper's throughput where it gives one
(`paper.target_mfu`). With --dp_comm=sdp4bit every row is also predicted with SDP4Bit's
quantized data-parallel collectives at each --node_gbps (`perf/dp_comm.py`): a section of
scaling_curves.md, sdp4bit_mfu_vs_gpus.png and the record scaling_curves-sdp4bit-*.json; the
rows, intervals and other outputs stay those of `none`.

This module predicts the rows and writes the outputs; the validation protocols and the
intervals' error model are experiments/scaling_validation.py, the tables and plots
experiments/scaling_report.py.
"""
import csv
import dataclasses
import os
import sys

from absl import app, flags

from experiments import scaling_report as report
from experiments.scaling_validation import (NOMINAL, coverage, error_model, progress,
                                           run_validation)
from mscale_jax.config import DP_COMMS
from mscale_jax.errors import ConfigError
from mscale_jax.perf import calibrate, constants, dp_comm, fit, hardware, layer, paper, sensitivity
from mscale_jax.perf.compressed import DPCompression

CSV_COLUMNS = ("table", "model", "system", "gpus", "global_batch", "predicted_mfu", "paper_mfu",
               "predicted_low", "predicted_high", "fitted", "paper_throughput_mfu",
               "micro_batch", "micro_batch_low", "micro_batch_high", "constants_low",
               "constants_high", "distance")
SCALE_SWITCHES = report.SCALE_SWITCHES


def fitted(row) -> bool:
  """Whether the default constants were fitted to `row`: every row with a paper figure."""
  return paper.target_mfu(row) is not None


def role(row) -> str:
  """'fitted' (the defaults were fitted to it) or 'predicted' (no paper figure in our notes)."""
  return "fitted" if fitted(row) else "predicted"


def fit_rows(rows: list) -> list:
  """The rows the default constants are fitted to."""
  return [r for r in rows if fitted(r)]


def predict_rows(hw, c) -> list:
  """(row, prediction) for every row of `paper.rows()`, all with constants `c`."""
  return [(row, paper.predict_row(row, hw, c)) for row in paper.rows()]


def _round(value, digits=2):
  return "" if value is None else round(value, digits)


def csv_record(row, pred, band=None) -> dict:
  """One CSV line: MFU in percent; empty cells where there is no figure or no interval."""
  band = band or {}
  nuisance, consts = band.get("nuisance", (None, None)), band.get("constants", (None, None))
  return {"table": row.table, "model": row.model.name, "system": row.system, "gpus": row.gpus,
          "global_batch": row.global_batch, "predicted_mfu": round(100 * pred.mfu, 2),
          "paper_mfu": "" if row.paper_mfu is None else row.paper_mfu,
          "predicted_low": _round(band.get("low")), "predicted_high": _round(band.get("high")),
          "fitted": "yes" if fitted(row) else "no",
          "paper_throughput_mfu": _round(paper.throughput_mfu(row)),
          "micro_batch": pred.layout.micro_batch, "micro_batch_low": _round(nuisance[0]),
          "micro_batch_high": _round(nuisance[1]), "constants_low": _round(consts[0]),
          "constants_high": _round(consts[1]), "distance": _round(band.get("distance"))}


def write_csv(path: str, results: list, bands: list | None = None) -> None:
  """Writes one CSV line per row with `CSV_COLUMNS`."""
  bands = bands or [None] * len(results)
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for (row, pred), band in zip(results, bands):
      writer.writerow(csv_record(row, pred, band))


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


def row_bands(results: list, model, hw, c, samples: int, points: int) -> tuple:
  """Per row {'low', 'high', 'nuisance', 'constants', 'distance', 'half_width'} and the
  constant-range band's summary."""
  rows = [r for r, _ in results]
  fitted_rows = fit_rows(rows)
  band = sensitivity.constant_range_band(rows, fitted_rows, hw, c, samples, points)
  out = []
  for i, row in enumerate(rows):
    low, high = fit.nuisance_range(row, hw, c)
    distance = fit.distance(row, fitted_rows)
    width = model.half_width(distance)
    out.append({"low": low - width, "high": high + width, "nuisance": (low, high),
                "constants": band["band"][i], "distance": distance, "half_width": width})
  return out, band


def weak_scaling(results: list, hw, c) -> list:
  """530B rows and the 175B batch-6,144 rows: percent of each iteration in the terms that
  differ between them (the last stage's LM head: its extra seconds per micro-batch times the
  micro-batches)."""
  out = []
  for row, pred in results:
    if row.global_batch == 768 or row.table == "table3":
      continue
    lay = pred.layout
    head = layer.head_cost(row.model, lay, row.techniques, hw, c).total
    share = lambda seconds: 100 * seconds / pred.iteration_s
    out.append({"model": row.model.name, "system": row.system, "gpus": row.gpus,
                "batch": row.global_batch, "micro_batch": lay.micro_batch,
                "micro_batches": lay.num_micro_batches, "bubble": share(pred.breakdown["bubble"]),
                "head": share(head * lay.num_micro_batches),
                "dp": share(pred.breakdown["dp_exposed"]),
                "stragglers": share(pred.breakdown["stragglers"]), "mfu": 100 * pred.mfu})
  return sorted(out, key=lambda d: (d["system"], d["model"], d["gpus"]))


def dp_comm_rows(results: list, hw, c, node_gbps=()) -> list:
  """Every row's layout at each of `node_gbps` (Gb/s per node; none given: `hw`'s own) with
  `none`'s collectives and SDP4Bit's, at the row's micro-batch and recomputation."""
  out = []
  for gbps in node_gbps or (dp_comm.node_gbps(hw),):
    for row, pred in results:
      cmp = dp_comm.compare(row.model, pred.layout, row.techniques, dp_comm.at_node_gbps(hw, gbps),
                            c, pred.recompute)
      out.append({"table": row.table, "model": row.model.name, "system": row.system,
                  "gpus": row.gpus, "global_batch": row.global_batch, "node_gbps": gbps,
                  "micro_batch": pred.layout.micro_batch, "none_mfu": 100 * cmp.none.mfu,
                  "sdp4bit_mfu": 100 * cmp.sdp4bit.mfu, "none_iteration_s": cmp.none.iteration_s,
                  "sdp4bit_iteration_s": cmp.sdp4bit.iteration_s, "speedup": cmp.speedup,
                  "none_dp_share": cmp.dp_share})
  return out


def markdown(results, notes, bands, summary, effects, weak, c, hw) -> str:
  """scaling_curves.md: every row against the paper, the interval method's numbers, the scale
  effects' costs, 530B against 175B, each iteration's breakdown and the +-10% sensitivity."""
  lines = ["# Scaling curves: paper vs performance model", "",
           "Produced by `python -m experiments.scaling_curves`; every row uses the same "
           "constants, fitted to every row with a paper figure (`fitted`). MFU in percent, "
           "Megatron formula, 312 TFLOP/s per A100; 'paper, from its throughput' is the MFU of "
           "the paper's tokens/s or iteration time by that formula (what the model is compared "
           "with where the paper gives it; the paper's MegaScale column counts ~1% fewer FLOPs).",
           ""] + [f"- {n}" for n in notes] + [""]
  if summary:
    m, cov = summary["error_model"], summary["coverage"]
    lines += [f"Interval: the micro-batch range (every plausible micro-batch; the paper gives "
              f"none) widened by {m.quantile:.2f} x ({m.base:.2f} + {m.slope:.2f} x distance) "
              f"points on each side, distance in doublings beyond what was fitted "
              f"(`fit.distance`): calibrated to {100 * NOMINAL:.0f}% on {m.count} out-of-sample "
              f"errors of the validation protocols; achieved {100 * cov['pooled']:.0f}% with "
              f"each protocol left out of the calibration; fitted rows inside their interval: "
              f"{summary['fitted_inside']}. Constants' band: {summary['constants_kept']} of "
              f"{summary['constants_samples']} joint draws of the constants within their ranges "
              f"kept by the fitted rows (a separate component, not part of the interval).", ""]
  lines += report.rows_table(results, bands)
  lines += ["", "## What each scale effect costs (MFU points: that switch off minus all on)", ""]
  lines += report.scale_effects_table(results, effects)
  lines += ["", "## 530B (Figure 9) against 175B: percent of each iteration", ""]
  lines += report.weak_scaling_table(weak)
  lines += ["", "## Breakdown of each iteration (seconds)", ""]
  lines += report.breakdown_table(results)
  rows = [r for r, _ in results if fitted(r)]
  lines += ["", "## Sensitivity: each constant scaled by 0.9 and 1.1, the others held", ""]
  lines += report.sensitivity_table(sensitivity.sensitivity(rows, 0.1, hw, c), c)
  return "\n".join(lines) + "\n"


def run(out_dir: str, calibration: str | None = None, hw_name: str = "a100_megascale",
        allow_other_device: bool = False, intervals: bool = True,
        points: int = fit.GRID_POINTS, samples: int = 48, validations: list | None = None,
        dp_comm_name: str = "none", node_gbps=()) -> dict:
  """Predicts every row, writes the outputs to `out_dir`; returns {'paths', 'results', ...}.

  A calibration record must come from the accelerator `hw_name` models unless
  `allow_other_device`. The intervals need the validation protocols (`fit.validate`, fitted on
  a `points` grid; a minute or two) unless `validations` are given; `intervals=False` leaves
  the interval columns empty (seconds). dp_comm_name='sdp4bit' also predicts every row with
  SDP4Bit's collectives at each of `node_gbps` (`dp_comm_rows`; Gb/s per node).
  """
  from experiments.results import write_record
  hw = hardware.get_hardware(hw_name)
  dp_comm.techniques(paper.MEGASCALE, dp_comm_name)       # bad values fail before any work
  for gbps in node_gbps:
    dp_comm.at_node_gbps(hw, gbps)
  c = constants.DEFAULT
  notes = ["No GPU benchmark record was used: efficiency constants are the documented defaults "
           f"(the {len(constants.FITTED)} fitted ones as `fit.fit` returns them on every row "
           "with a paper figure)."]
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
  bands, summary = None, None
  if intervals:
    if validations is None:
      validations = fit.validate(hw, c, points=points, progress=progress)
    model = error_model(validations)
    print(f"[scaling_curves] constants' band: {samples} joint draws", flush=True)
    bands, band = row_bands(results, model, hw, c, samples, points)
    inside = sum(b["low"] <= paper.target_mfu(r) <= b["high"]
                 for (r, _), b in zip(results, bands) if fitted(r))
    summary = {"error_model": model, "coverage": coverage(validations, model),
               "fitted_inside": f"{inside} of {len(fit_rows([r for r, _ in results]))}",
               "constants_kept": band["kept"], "constants_samples": band["samples"],
               "constants_ranges": band["ranges"]}
  effects = scale_effects(results, hw, c)
  weak = weak_scaling(results, hw, c)
  os.makedirs(out_dir, exist_ok=True)
  paths = {name: os.path.join(out_dir, name) for name in
           ("scaling_curves.csv", "scaling_curves.md", "mfu_vs_gpus.png", "ablation_waterfall.png")}
  write_csv(paths["scaling_curves.csv"], results, bands)
  md = markdown(results, notes, bands, summary, effects, weak, c, hw)
  if moves:
    md += "\n## How calibration moved each prediction (MFU %)\n\n" + "\n".join(
        f"- {m}" for m in moves) + "\n"
  sdp4bit = dp_comm_rows(results, hw, c, node_gbps) if dp_comm_name == "sdp4bit" else None
  if sdp4bit:
    md += "\n" + "\n".join(report.dp_comm_table(sdp4bit)) + "\n"
    paths["sdp4bit_mfu_vs_gpus.png"] = os.path.join(out_dir, "sdp4bit_mfu_vs_gpus.png")
    report.plot_dp_comm(paths["sdp4bit_mfu_vs_gpus.png"], sdp4bit)
  with open(paths["scaling_curves.md"], "w") as f:
    f.write(md)
  report.plot_scaling(paths["mfu_vs_gpus.png"], results, bands)
  report.plot_waterfall(paths["ablation_waterfall.png"], results)
  figures = [{**csv_record(r, p, None if bands is None else bands[i]), "role": role(r),
              "target_mfu": paper.target_mfu(r), "iteration_s": p.iteration_s,
              "paper_iteration_s": paper.paper_iteration_s(r), "breakdown_s": p.breakdown,
              "scale_effect_points": effects[i], "recompute": p.recompute,
              "memory_gb": p.memory.total / 1e9}
             for i, (r, p) in enumerate(results)]
  extra = {"notes": notes, "calibration": calibration, "calibration_moves": moves,
           "fitted_constants": {n: getattr(c, n) for n in constants.FITTED},
           "weak_scaling": weak}
  if summary:
    extra["intervals"] = {**summary, "error_model": dataclasses.asdict(summary["error_model"]),
                          "nominal": NOMINAL}
  paths["record"] = write_record("scaling_curves", figures, out_dir=out_dir,
                                 device={"platform": "model", "device_kind": hw.name},
                                 extra=extra)
  if sdp4bit:
    paths["sdp4bit_record"] = write_record(
        "scaling_curves-sdp4bit", sdp4bit, out_dir=out_dir,
        device={"platform": "model", "device_kind": hw.name},
        extra={"notes": notes, "dp_comm": "sdp4bit", "preset_node_gbps": dp_comm.node_gbps(hw),
               "compression": dataclasses.asdict(DPCompression())})
  return {"paths": paths, "results": results, "notes": notes, "moves": moves, "bands": bands,
          "summary": summary, "validations": validations, "sdp4bit": sdp4bit}


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_string("out_dir", "results/scaling_curves", "Folder for the outputs.")
  flags.DEFINE_string("calibrate", None, "A kernel_bench-gemm JSON record whose measured GEMM "
                      "efficiency replaces the modelled curve.")
  flags.DEFINE_string("hardware", "a100_megascale", "Hardware preset.")
  flags.DEFINE_bool("calibrate_any_device", False, "Apply --calibrate's record even when it was "
                    "measured on another accelerator than --hardware models.")
  flags.DEFINE_bool("intervals", True, "Compute each row's prediction interval (fits the "
                    "validation protocols: a minute or two).")
  flags.DEFINE_integer("samples", 48, "Joint draws of the constants for the constants' band.")
  flags.DEFINE_bool("validate", False, "Also write validation.md and its record: every "
                    "protocol's fit and held-out errors, and the same with scale effects off.")
  flags.DEFINE_enum("dp_comm", "none", list(DP_COMMS), "sdp4bit: also predict every row "
                    "with SDP4Bit's quantized DP collectives (perf/dp_comm.py).")
  flags.DEFINE_list("node_gbps", [], "With --dp_comm=sdp4bit: inter-node Gb/s per node to "
                    "predict at (default: the --hardware preset's).")
  flags.DEFINE_enum("protocol", None, ["a", "b", "c", "d", "e"], "Run only this validation "
                    "protocol (docs/perf_model.md) and write its record; no other output.")


def gbps_list(values: list) -> tuple:
  """--node_gbps as floats; a ConfigError names a value that is not a positive number."""
  try:
    out = tuple(float(v) for v in values)
  except ValueError as e:
    raise ConfigError("node_gbps", values, "comma-separated positive numbers (Gb/s)") from e
  if any(v <= 0 for v in out):
    raise ConfigError("node_gbps", values, "comma-separated positive numbers (Gb/s)")
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  if f.calibrate and f.calibrate_any_device:
    print(f"[scaling_curves] note: --calibrate_any_device: the GEMM curve of {f.calibrate} is "
          f"applied to {f.hardware} whatever device it was measured on; predictions may not "
          f"describe either accelerator")
  try:
    if f.protocol:
      checked = run_validation(f.out_dir, f.hardware, compare_off=False, names={f.protocol})
      print("\n".join(checked["lines"]))
      print(f"[scaling_curves] wrote {checked['paths']['record']}")
      return
    out = run(f.out_dir, f.calibrate, f.hardware, f.calibrate_any_device, f.intervals,
              samples=f.samples, dp_comm_name=f.dp_comm, node_gbps=gbps_list(f.node_gbps))
    checked = (run_validation(f.out_dir, f.hardware, validations=out["validations"])
               if f.validate else None)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  errs = [100 * p.mfu - paper.target_mfu(r) for r, p in out["results"] if fitted(r)]
  bands = out["bands"] or [None] * len(out["results"])
  for (row, pred), band in zip(out["results"], bands):
    target = paper.target_mfu(row)
    paper_s = "" if target is None else f"paper {target:5.1f}"
    interval = "" if band is None else f"[{band['low']:5.1f}, {band['high']:5.1f}]"
    print(f"{row.table:6s} {row.model.name:4s} {row.system:15s} {row.gpus:6d} GPUs "
          f"batch {row.global_batch:5d} mb {pred.layout.micro_batch}: ours {100 * pred.mfu:5.1f} "
          f"{interval:14s} {role(row):9s} {paper_s}")
  for note in out["notes"] + out["moves"]:
    print(f"note: {note}")
  print(f"[scaling_curves] fitted rows: RMS {fit.rms(errs):.2f}, worst "
        f"{max(errs, key=abs):+.2f} MFU points")
  if out["summary"]:
    cov = out["summary"]["coverage"]
    print(f"[scaling_curves] {100 * NOMINAL:.0f}% intervals: achieved {100 * cov['pooled']:.0f}% "
          f"on held-out rows with each protocol left out; fitted rows inside: "
          f"{out['summary']['fitted_inside']}")
  if checked:
    print("\n".join(checked["lines"][:20]))
  for e in out["sdp4bit"] or []:
    print(f"[scaling_curves] sdp4bit {e['model']} {e['system']:14s} {e['gpus']:6d} GPUs at "
          f"{e['node_gbps']:g} Gb/s/node: MFU {e['none_mfu']:.1f} -> {e['sdp4bit_mfu']:.1f} "
          f"({e['speedup']:.2f}x)")
  for path in list(out["paths"].values()) + (list(checked["paths"].values()) if checked else []):
    print(f"[scaling_curves] wrote {path}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
