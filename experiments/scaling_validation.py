"""Validation of the performance model: fit the constants on some of the paper's rows, predict
the others (`fit.validate`'s protocols); the error model those out-of-sample errors calibrate
(the half-width of every row's interval in `scaling_curves`) and its achieved coverage;
validation.md and its record.

  python -m experiments.scaling_curves --validate           # validation.md and its record
  python -m experiments.scaling_curves --protocol=c         # one protocol, its record
"""
import dataclasses
import glob
import json
import os

from experiments import scaling_report as report
from mscale_jax.perf import constants, fit, hardware, paper
from mscale_jax.perf import intervals as perf_intervals

NOMINAL = 0.8     # the intervals' calibrated coverage


def held_errors(validation) -> tuple:
  """(errors, distances) of a protocol's counted held-out rows, an error being how far the
  paper figure lies outside the prediction's micro-batch range (`intervals.excess`)."""
  held = validation.counted
  return ([perf_intervals.excess(h.target, h.low, h.high) for h in held],
          [h.distance for h in held])


def error_model(validations: list, nominal: float = NOMINAL) -> perf_intervals.ErrorModel:
  """The error model calibrated on every protocol's counted held-out rows."""
  errs, dists = [], []
  for v in validations:
    e, d = held_errors(v)
    errs, dists = errs + e, dists + d
  return perf_intervals.calibrate(errs, dists, nominal)


def coverage(validations: list, model, nominal: float = NOMINAL) -> dict:
  """Achieved coverage: per protocol and pooled with each protocol left out of the calibration
  ('cross-validated'), and on every held-out error with the full calibration ('calibration',
  nominal by construction)."""
  groups = {v.protocol.name: held_errors(v) for v in validations if v.counted}
  out = perf_intervals.cross_validated_coverage(groups, nominal)
  errs = [e for es, _ in groups.values() for e in es]
  dists = [d for _, ds in groups.values() for d in ds]
  out["calibration"] = perf_intervals.coverage(errs, [model.half_width(d) for d in dists])
  return out


def first_contact(out_dir: str) -> dict | None:
  """The newest first-contact record in `out_dir` (protocol (c) before any model change)."""
  paths = sorted(glob.glob(os.path.join(out_dir, "scaling_curves-first_contact-*.json")))
  if not paths:
    return None
  with open(paths[-1]) as f:
    return {"path": paths[-1], **json.load(f)}


def progress(protocol) -> None:
  """Prints which protocol is being fitted."""
  print(f"[scaling_curves] protocol {protocol.name} ({protocol.description}): fitting "
        f"{len(protocol.fit_rows)} rows", flush=True)


def validation_markdown(validations, validations_off, model, cov, c, hw, first) -> list:
  """validation.md's lines: the protocols, their held-out rows, the interval calibration, the
  first contact, the paper's own time split and the fitted values per protocol."""
  fitted_names = ", ".join(constants.FITTED)
  lines = ["# Validation: fit on some of the paper's rows, predict the others", "",
           "Produced by `python -m experiments.scaling_curves --validate`. Each protocol fits "
           f"the {len(constants.FITTED)} constants of `constants.FITTED` ({fitted_names}) on a "
           "grid within their ranges (`fit.fit`), every other constant at its source value, "
           "and predicts the rows it did not fit. Errors are ours minus the paper's figure (the "
           "MFU of its throughput where it gives one), MFU points; the micro-batch is the "
           "shared rule's (`paper.predict_row`).", ""]
  lines += report.protocols_table(validations, cov)
  pooled = ("n/a (one protocol)" if cov["pooled"] != cov["pooled"]
            else f"{100 * cov['pooled']:.0f}%")
  lines += ["", f"Coverage column: the share of that protocol's held-out figures inside the "
            f"{100 * NOMINAL:.0f}% interval calibrated on the other protocols only; pooled over "
            f"all: {pooled} (nominal {100 * NOMINAL:.0f}%). Calibrated on all "
            f"of them ({model.count} errors): half-width {model.quantile:.2f} x ({model.base:.2f} "
            f"+ {model.slope:.2f} x distance) points beyond the micro-batch range, "
            f"{100 * cov['calibration']:.0f}% on those errors (nominal by construction). The "
            "protocols share rows, so the left-out coverage is still optimistic.", ""]
  if first:
    s = first["summary"]
    lines += ["## Protocol (c), first contact (recorded before the model changed, never rerun)",
              "", f"Record `{os.path.basename(first['path'])}` (commit {first['commit'][:7]}, "
              "`--protocol=first_contact` there): the defaults of that commit, fitted to Table 3 "
              "and batch 768, against the batch-6,144 rows as printed: MegaScale RMS "
              f"{s['megascale']['rms']:.2f} (worst {s['megascale']['worst']:+.2f}, mean "
              f"{s['megascale']['mean']:+.2f}), Megatron-LM RMS {s['megatron']['rms']:.2f} (worst "
              f"{s['megatron']['worst']:+.2f}); {s['both']['in_interval']} of 8 paper figures "
              "inside the intervals of the time. Against the paper's throughput instead (as "
              "every protocol above compares), the same predictions err by:", "",
              "| system | GPUs | ours then | paper, printed | paper, from its throughput | "
              "error then |", "|---|---|---|---|---|---|"]
    table2 = {(r.system, r.gpus): r for r in paper.rows() if r.global_batch == 6144}
    for figure in first["figures"]:
      target = paper.throughput_mfu(table2[(figure["system"], figure["gpus"])])
      lines.append(f"| {figure['system']} | {figure['gpus']} | {figure['predicted_mfu']:.2f} | "
                   f"{figure['paper_mfu']:.1f} | {target:.2f} | "
                   f"{figure['predicted_mfu'] - target:+.2f} |")
    lines.append("")
  lines += ["## Held-out rows", ""] + report.held_out_table(validations, model)
  lines += ["", "## The paper's own times, split", "",
            "`paper.time_split`: Table 2's iteration seconds as per-sequence x sequences per "
            "pipeline + fixed, fitted per system and batch (no model), and the same split of "
            "the default model's predictions.", ""]
  lines += report.time_split_table(lambda r: paper.predict_row(r, hw, c).iteration_s)
  lines += ["", "## Fitted values per protocol", ""]
  lines += report.fitted_values_table(validations, constants.FITTED, constants.RANGES)
  if validations_off:
    lines += ["", "## The same protocols with every scale effect switched off (refitted)", "",
              "| protocol | in-sample RMS | out-of-sample RMS / worst |", "|---|---|---|"]
    for v in validations_off:
      oos = v.out_of_sample
      worst = f"{max(abs(e) for e in oos):.2f}" if oos else ""
      lines.append(f"| {v.name} | {v.fit.rms:.2f} | {fit.rms(oos):.2f} / {worst} |")
  return lines


def validation_figures(validations: list) -> list:
  """The record's figures: each protocol's fit and its held-out rows."""
  out = []
  for v in validations:
    oos = v.out_of_sample
    out.append({"protocol": v.name, "fitted_constants": len(v.fit.names),
                "fit_rows": len(v.fit.rows), "in_sample_rms": v.fit.rms,
                "in_sample_worst": v.fit.worst, "held_out_rows": len(oos),
                "out_of_sample_rms": fit.rms(oos) if oos else None,
                "out_of_sample_worst": max(abs(e) for e in oos) if oos else None,
                "held_out": [{"table": h.row.table, "system": h.row.system, "gpus": h.row.gpus,
                              "global_batch": h.row.global_batch, "paper_mfu": h.row.paper_mfu,
                              "target_mfu": h.target, "error": h.error,
                              "micro_batch_range": [h.low, h.high], "distance": h.distance,
                              "same_run_as_fitted": h.duplicate} for h in v.held_out],
                "constants": {n: getattr(v.fit.constants, n) for n in v.fit.names}})
  return out


def run_validation(out_dir: str, hw_name: str = "a100_megascale",
                   points: int = fit.GRID_POINTS, compare_off: bool = True,
                   validations: list | None = None, names=None) -> dict:
  """Runs `fit.validate` (or takes `validations`), writes validation.md and a record.

  With `compare_off`, the protocols run again with every scale effect off, so the report shows
  what the scale mechanisms do to the out-of-sample errors. `names` runs only those protocols
  (their record is named after them, and no validation.md is written).
  """
  from experiments.results import write_record
  hw = hardware.get_hardware(hw_name)
  c = constants.DEFAULT
  if validations is None:
    validations = fit.validate(hw, c, points=points, names=names, progress=progress)
  off = dataclasses.replace(c, **{s: False for s in report.SCALE_SWITCHES})
  validations_off = (fit.validate(hw, off, points=points, names=names, progress=progress)
                     if compare_off else [])
  counted = [v for v in validations if v.counted]
  model = error_model(counted)
  cov = coverage(counted, model) if len(counted) > 1 else {"pooled": float("nan"),
                                                            "calibration": float("nan")}
  full = [v for v in validations if v.protocol.name == "full"]
  same = bool(full) and all(getattr(full[0].fit.constants, n) == getattr(c, n)
                            for n in constants.FITTED)
  lines = validation_markdown(validations, validations_off, model, cov, c, hw,
                              first_contact(out_dir))
  if full:
    lines.insert(2, f"The default constants {'are' if same else 'are NOT'} the 'full' "
                 "protocol's fit.\n")
  os.makedirs(out_dir, exist_ok=True)
  paths = {}
  if names is None:
    paths["validation.md"] = os.path.join(out_dir, "validation.md")
    with open(paths["validation.md"], "w") as f:
      f.write("\n".join(lines) + "\n")
  name = "scaling_curves-validate" if names is None else (
      "scaling_curves-protocol_" + "".join(sorted(names)))
  paths["record"] = write_record(
      name, validation_figures(validations), out_dir=out_dir,
      device={"platform": "model", "device_kind": hw.name},
      extra={"grid_points": points, "defaults_are_full_fit": same, "nominal": NOMINAL,
             "error_model": dataclasses.asdict(model), "coverage": cov,
             "scale_effects_off": validation_figures(validations_off)})
  return {"paths": paths, "validations": validations, "lines": lines,
          "defaults_are_full_fit": same, "coverage": cov, "error_model": model}
