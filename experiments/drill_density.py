r"""The fault drill's rate against fault density: a model from a drill record's measured costs.

  python -m experiments.drill_density results/fault_drill-gpt_tiny-cpu-20261126T235744.json
  python -m experiments.drill_density results/fault_drill-*.json   # each that can be modelled

The drill's headline, the fault run's rate as a fraction of the fault-free run's, depends on how
densely the faults strike: the drill places the same 12 faults in any run length, and a fault
costs about the same seconds however long the run. So a record's rate holds at its own density
only. This model restates it at any density from what the record measured:

  retained(rho) = (1 - rho * c / 3600) / (1 + delta)

rho: faults per hour of the fault run's wall time (the record's `faults_per_hour`); c: the mean
seconds one fault costs (its detection, self-check, restart, replay, slowdown: the record's
per-fault phases, summed over all faults injected and divided by their number); delta: the
costs that do not scale with faults (the fault run's start-up, checkpoint stalls, evaluations
and steady steps, each less the reference's), as a fraction of the reference's wall time. (With
W_f = W_ref (1 + delta) + n c and rho = 3600 n / W_f, retained = W_ref / W_f is the formula.
The start-up difference, a per-run cost, sits in delta at the record's length: a small error at
other lengths.)
What no part measures (the driver's shutdown, both runs' unaccounted seconds) is left out, so the
model's prediction at the record's own density is a check: within TOLERANCE of the measured
rate it fits, else the record says it does not. The density where retained(rho) crosses the
issue's 95% target: rho_95 = 3600 (1 - 0.95 (1 + delta)) / c (none where delta alone costs 5%).

The reference's gain: side by side on a shared host, the fault-free run speeds up while the
fault run is down (`reference_gain_while_fault_run_down`). No fault-free job on a cluster of its
own gains that way, so the model's line leaves it out (the reference's wall time plus what it
saved; checked against `rate_vs_fault_free_without_that_gain`). As measured, it arises only
while the fault run is down, so the `as_measured` variant counts it as a per-fault cost (its
seconds over the faults), checked against `rate_vs_fault_free`.

For context, the plot marks a real large job's density: Llama 3's 405B pre-training (466 job
interruptions, 47 planned and 419 unexpected, in a 54-day snapshot on 16,384 H100s;
mscale_jax/goodput/sources.py). Writes a results/drill_density-* record and a PNG beside it.
"""
import json
import math
import os

from absl import app, flags

TARGET = 0.95       # the fault run keeps this fraction of the fault-free rate (issue 18)
TOLERANCE = 0.01    # the model fits where it predicts the measured rate within 1 point
PHASES = ("detection_s", "diagnosis_s", "restart_s", "replay_s", "slowdown_s")


def per_fault_costs(figures: dict) -> list[dict]:
  """Each injected fault's measured seconds: the sum of its phases (a fault recovered without a
  cost of its own, e.g. a bad slot found by another restart's self-check, costs 0)."""
  return [{"injected": r["injected"],
           "seconds": sum(r.get("phases", {}).get(p) or 0.0 for p in PHASES)}
          for r in figures["faults"]]


def non_fault_costs(figures: dict) -> dict:
  """Seconds the fault run spent over the reference that do not come per fault, each measured on
  its own: start-up, checkpoint stalls, evaluations, and its steps (each step once, without each
  restart's first new step and contend's slowdown, which are per-fault costs), each less the
  reference's; `steps_s` also less the reference's gain (`reference_gain_s`), which the model
  treats apart. Raises KeyError where a record lacks a part (older records)."""
  split, ref = figures["where_time_went"], figures["reference_where_time_went"]
  other, of_which = split["other_split"], split["other_split"]["of_which"]
  gain = figures["reference_gain_while_fault_run_down"]["reference_saved_s"]
  steps = (split["training_s"] + other["steps_slower_than_steady_s"]
           - of_which["first_new_steps_in_restart_s"] - of_which["slowdown_in_steps_slower_s"])
  return {"startup_s": split["startup_s"] - ref["startup_s"],
          "checkpoint_stall_s": other["checkpoint_stall_s"] - ref["checkpoint_stall_s"],
          "evaluation_s": other["evaluation_s"] - ref["evaluation_s"],
          "steps_s": steps - (ref["training_s"] + gain), "reference_gain_s": gain}


def retained(rho: float, per_fault_s: float, delta: float) -> float:
  """The model's rate (fraction of the fault-free run's) at `rho` faults per hour."""
  return (1.0 - rho * per_fault_s / 3600.0) / (1.0 + delta)


def crossing(per_fault_s: float, delta: float, target: float = TARGET) -> float | None:
  """Faults per hour where `retained` falls to `target`; None where it is below `target` with
  no faults at all (delta alone costs more). Infinite where faults cost nothing."""
  room = 1.0 - target * (1.0 + delta)
  if room <= 0:
    return None
  return math.inf if per_fault_s <= 0 else 3600.0 * room / per_fault_s


def _variant(reference_s: float, faults_s: float, n: int, non_fault_s: float, rho: float,
             measured: float) -> dict:
  """One model (per-fault mean, delta) and its check at the measured density `rho`."""
  per_fault, delta = faults_s / n, non_fault_s / reference_s
  predicted = retained(rho, per_fault, delta)
  fits = abs(predicted - measured) <= TOLERANCE
  return {"per_fault_mean_s": per_fault, "non_fault_s": non_fault_s, "delta": delta,
          "reference_wall_s": reference_s, "measured_rate": measured,
          "predicted_rate_at_measured_density": predicted, "fits": fits,
          "crossing_faults_per_hour": crossing(per_fault, delta) if fits else None,
          "crossing_if_it_fitted": crossing(per_fault, delta),
          "verdict": (f"fits: predicts {predicted:.1%} at {rho:.1f} faults/h, measured "
                      f"{measured:.1%} (tolerance {TOLERANCE:.0%})") if fits else
                     (f"the model does not fit: predicts {predicted:.1%} at {rho:.1f} faults/h, "
                      f"measured {measured:.1%} (tolerance {TOLERANCE:.0%})")}


def model(figures: dict) -> dict:
  """The density model of one drill record's figures (module docstring): the measured point, the
  per-fault and non-fault costs, and for the gain-free model (the line) and the as-measured one
  each the prediction at the measured density, whether it fits and the 95% crossing."""
  costs, other = per_fault_costs(figures), non_fault_costs(figures)
  n, gain = len(costs), other["reference_gain_s"]
  faults_s = sum(c["seconds"] for c in costs)
  non_fault_s = sum(v for k, v in other.items() if k != "reference_gain_s")
  rho, ref_s = figures["faults_per_hour"], figures["reference_wall_s"]
  return {
      "measured": {"faults_per_hour": rho, "faults": n, "steps": figures.get("steps"),
                   "wall_s": figures["wall_s"], "reference_wall_s": ref_s,
                   "rate_vs_fault_free": figures["rate_vs_fault_free"],
                   "rate_vs_fault_free_without_that_gain":
                       figures["rate_vs_fault_free_without_that_gain"]},
      "per_fault_s": costs, "per_fault_total_s": faults_s, "non_fault_split_s": other,
      "model": _variant(ref_s + gain, faults_s, n, non_fault_s, rho,
                        figures["rate_vs_fault_free_without_that_gain"]),
      "as_measured": _variant(ref_s, faults_s + gain, n, non_fault_s, rho,
                              figures["rate_vs_fault_free"]),
      "unmodelled_s": figures["wall_s"] - ref_s - faults_s - non_fault_s - gain,
      "unmodelled_split_s": _unaccounted(figures),
      "target": TARGET, "tolerance": TOLERANCE,
      "formula": "retained(rho) = (1 - rho * per_fault_mean_s / 3600) / (1 + delta); rho in "
                 "faults per hour of the fault run's wall time; delta = non_fault_s / "
                 "reference_wall_s",
      "reference_gain_treatment": "model: left out (the reference's wall time plus its gain, "
                                  "checked against rate_vs_fault_free_without_that_gain): a "
                                  "fault-free job with a machine of its own does not speed up "
                                  "while another is down. as_measured: counted as a per-fault "
                                  "cost (it arises only while the fault run is down), checked "
                                  "against rate_vs_fault_free",
      "unmodelled_note": "unmodelled_s: the fault run's wall time that no modelled part holds, "
                         "less the reference's (unmodelled_split_s: each run's unaccounted "
                         "seconds: driver shutdowns, the relaunch after kill_driver); the reason "
                         "a prediction can miss. Negative where the drill's accounting counted "
                         "seconds twice (the fault run's unaccounted_s below 0)"}


def _unaccounted(figures: dict) -> dict:
  """Each run's seconds that no measured part holds: the fault run's `unaccounted_s`, and the
  reference's wall time less its start-up, steps, checkpoint stalls and evaluations."""
  ref = figures["reference_where_time_went"]
  parts = ("startup_s", "training_s", "checkpoint_stall_s", "evaluation_s")
  return {"fault_run_s": figures["where_time_went"]["other_split"]["unaccounted_s"],
          "reference_s": figures["reference_wall_s"] - sum(ref[k] for k in parts)}


def real_job_density() -> dict:
  """A real large job's interruptions per hour: Llama 3's 54-day snapshot (the project's cited
  inputs, mscale_jax/goodput/sources.py)."""
  from mscale_jax.goodput.sources import LLAMA3, value
  hours = value("llama3.days") * 24
  unexpected, planned = value("llama3.unexpected"), value("llama3.planned")
  return {"name": "Llama 3 405B pre-training", "source": f"{LLAMA3} 3.3.4",
          "cited": f"{unexpected + planned:.0f} job interruptions ({planned:.0f} planned, "
                   f"{unexpected:.0f} unexpected) in a {value('llama3.days'):.0f}-day snapshot "
                   f"on {value('llama3.gpus'):.0f} H100 GPUs",
          "interruptions": unexpected + planned, "days": value("llama3.days"),
          "gpus": value("llama3.gpus"), "interruptions_per_hour": (unexpected + planned) / hours,
          "unexpected_per_hour": unexpected / hours}


def label(record: dict) -> str:
  """A short name of a drill record for the plot's legend."""
  return f"{record['date'][:16]} ({record['figures'].get('steps')} steps)"


def _legend(name: str, m: dict) -> str:
  fits = m["model"]["fits"] and m["as_measured"]["fits"]
  return (f"{name}: {m['model']['per_fault_mean_s']:.1f} s/fault "
          f"({m['as_measured']['per_fault_mean_s']:.1f} as measured)"
          f"{'' if fits else ', DOES NOT FIT'}")


def plot(entries: list[tuple[str, dict]], path: str) -> None:
  """Retained rate vs faults per hour (log x): each record's model line (gain-free, solid; as
  measured, dashed), its measured points, the 95% target and the real job's density."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  real = real_job_density()
  rhos = [m["measured"]["faults_per_hour"] for _, m in entries]
  lo, hi = min([real["unexpected_per_hour"]] + rhos) / 3, max(rhos) * 5
  xs = [lo * (hi / lo) ** (i / 199) for i in range(200)]
  fig, ax = plt.subplots(figsize=(10, 4.5))
  for i, (name, m) in enumerate(entries):
    color = f"C{i % 10}"
    for key, style, point, measured in (
        ("model", "-", "o", "rate_vs_fault_free_without_that_gain"),
        ("as_measured", "--", "s", "rate_vs_fault_free")):
      v = m[key]
      ax.plot(xs, [retained(x, v["per_fault_mean_s"], v["delta"]) for x in xs], style,
              color=color, lw=1.2, alpha=1.0 if v["fits"] else 0.35,
              label=_legend(name, m) if key == "model" else None)
      ax.plot([m["measured"]["faults_per_hour"]], [m["measured"][measured]], point,
              color=color, mfc=color if key == "model" else "none")
  ax.axhline(TARGET, color="gray", ls=":", lw=1)
  ax.text(lo * 1.1, TARGET - 0.004, f"target {TARGET:.0%}", fontsize=8, color="gray",
          va="top")
  ax.axvline(real["interruptions_per_hour"], color="k", ls="-.", lw=1)
  ax.text(real["interruptions_per_hour"] * 1.08, 0.64,
          f"{real['name']}:\n{real['interruptions_per_hour']:.2f} interruptions/h\n"
          f"({real['interruptions']:.0f} in {real['days']:.0f} days, {real['gpus']:,.0f} GPUs)",
          fontsize=7)
  ax.set_xscale("log")
  ax.set_ylim(0.6, 1.01)
  ax.set_xlabel("faults per hour (log)")
  ax.set_ylabel("rate retained vs the fault-free run")
  ax.set_title("fault drill: retained rate vs fault density. Solid, filled: without the "
               "reference's side-by-side gain; dashed, hollow: as measured", fontsize=8)
  ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), title="record: model",
            title_fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def summary_line(m: dict) -> str:
  """One line of a model's headline numbers (the gain-free model's)."""
  v, rho = m["model"], m["measured"]["faults_per_hour"]
  cross = v["crossing_if_it_fitted"]
  where = "not even without faults" if cross is None else f"{cross:.1f} faults/h"
  return (f"{rho:.1f} faults/h: measured {v['measured_rate']:.1%} (gain-free), model "
          f"{v['predicted_rate_at_measured_density']:.1%} ({'fits' if v['fits'] else 'NO FIT'});"
          f" {v['per_fault_mean_s']:.1f} s per fault, non-fault {v['delta']:+.1%}; 95% at "
          f"{where}; as measured (gain per fault): 95% at "
          f"{m['as_measured']['crossing_if_it_fitted'] or float('nan'):.1f} faults/h")


def load(paths: list[str]) -> tuple[list[tuple[str, dict, dict]], dict]:
  """(name, record, model) of each record that can be modelled, and {path: why not} of the
  rest."""
  out, skipped = [], {}
  for path in paths:
    with open(path) as f:
      record = json.load(f)
    try:
      out.append((path, record, model(record["figures"])))
    except (KeyError, TypeError, ZeroDivisionError) as e:
      skipped[path] = f"lacks what the model needs ({type(e).__name__}: {e})"
  return out, skipped


def write(paths: list[str], out_dir: str | None = None, name: str | None = None) -> tuple:
  """Models each record of `paths`, writes a drill_density record and its PNG; returns both
  paths and the record's figures. `name`: the record's name (default drill_density-<config of
  the first record>)."""
  from experiments import results
  loaded, skipped = load(paths)
  if not loaded:
    raise SystemExit(f"[density] no record can be modelled: {skipped}")
  config = loaded[0][1]["name"].removeprefix("fault_drill-")
  figures = {"records": {os.path.basename(p): m for p, _, m in loaded},
             "skipped": skipped, "real_job": real_job_density(), "target": TARGET,
             "tolerance": TOLERANCE}
  device = {**loaded[0][1]["device"], "note": "the drill records' device (this record only "
            "reads them)"}
  path = results.write_record(name or f"drill_density-{config}", figures, out_dir=out_dir,
                              device=device)
  png = path[:-len(".json")] + ".png"
  plot([(label(r), m) for _, r, m in loaded], png)
  return path, png, figures


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_string("out_dir", None, "Folder for the record (default results/).")


def main(argv):
  paths = argv[1:]
  if not paths:
    raise app.UsageError("name one or more fault_drill records")
  path, png, figures = write(paths, flags.FLAGS.out_dir)
  for name, m in figures["records"].items():
    print(f"[density] {name}: {summary_line(m)}")
  for name, why in figures["skipped"].items():
    print(f"[density] skipped {name}: {why}")
  print(f"[density] wrote {path} and {png}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
