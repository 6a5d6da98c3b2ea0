r"""Searches TP, PP, virtual stages, DP, micro-batch, global batch and technique switches.

  python -m experiments.plan --model=175B --gpus=256,1024,12288
  python -m experiments.plan --model=530B --gpus=2240 --global_batch=2240 --hardware=h100_dgx
  python -m experiments.plan --model=175B --gpus=1024 --dp_comm=sdp4bit --node_gbps=400

For each GPU count prints the configurations with the highest predicted MFU that fit in memory,
with their breakdowns, then the paper's layout (Table 1) and why the best one beats it (the
breakdown terms that differ most). Predictions come from mscale_jax.perf with one set of
constants (or a calibrated copy, --calibrate).
"""
import sys

from absl import app, flags

from mscale_jax.config import DP_COMMS
from mscale_jax.errors import ConfigError
from mscale_jax.perf import calibrate, constants, dp_comm as dp_comms, hardware, paper, search
from mscale_jax.perf.iteration import BREAKDOWN_KEYS
from mscale_jax.perf.workload import MODELS


def describe(pred) -> str:
  """One line: layout, pipeline schedule, switches that are off, MFU, iteration, memory and
  the recomputation that fits."""
  lay, tech = pred.layout, pred.techniques
  off = [name for name in search.SWITCHES if not getattr(tech, name)]
  switches = "all MegaScale switches" if not off else (
      "Megatron-LM baseline" if len(off) == len(search.SWITCHES) else f"all but {','.join(off)}")
  schedule = "zb_h1" if tech.zb_h1 else ("interleaved_1f1b" if lay.vpp > 1 else "1f1b")
  return (f"tp={lay.tp} pp={lay.pp} vpp={lay.vpp} dp={lay.dp} mb={lay.micro_batch} "
          f"batch={lay.global_batch} {schedule} | {switches} | MFU {100 * pred.mfu:.1f}% | "
          f"iter {pred.iteration_s:.2f}s | {pred.memory.total / 2**30:.1f} GiB, "
          f"recompute={pred.recompute}")


def summary(pred) -> dict:
  """A configuration as JSON: its line, MFU, iteration time, memory and breakdown (seconds)."""
  return {"layout": describe(pred), "mfu": pred.mfu, "iteration_s": pred.iteration_s,
          "memory_gib": pred.memory.total / 2**30, "recompute": pred.recompute,
          "breakdown_s": {k: pred.breakdown[k] for k in BREAKDOWN_KEYS}}


def breakdown(pred) -> str:
  """The iteration's breakdown in seconds, indented under its configuration."""
  return "    " + "  ".join(f"{k}={pred.breakdown[k]:.2f}" for k in BREAKDOWN_KEYS)


def why(best, ref) -> str:
  """The breakdown terms where `best` saves the most against `ref`, per `ref`'s batch."""
  scale = ref.layout.global_batch / best.layout.global_batch
  deltas = sorted(((ref.breakdown[k] - scale * best.breakdown[k], k) for k in BREAKDOWN_KEYS),
                  reverse=True)
  parts = [f"{k} {d:+.2f}s" for d, k in deltas if abs(d) >= 0.01][:4]
  return "saves " + ", ".join(parts) if parts else "no term differs by more than 10 ms"


def plan(model_name: str, gpus: int, hw_name: str, batch: int, scale: int, top: int,
         c, dp_comm: str = "none", node_gbps: float = 0.0) -> list:
  """Prints and returns the top configurations for one GPU count.

  dp_comm='sdp4bit' searches with SDP4Bit's two-level quantized DP collectives
  (`perf/compressed.py`) instead of NCCL's rings ('none', `perf/comm.ring_link`); node_gbps > 0
  sets the inter-node bandwidth per node (Gb/s).
  """
  if model_name not in MODELS:
    raise ConfigError("model", model_name, f"one of {sorted(MODELS)}")
  techniques = dp_comms.techniques(paper.MEGASCALE, dp_comm)
  model = MODELS[model_name]
  hw = dp_comms.at_node_gbps(hardware.get_hardware(hw_name), node_gbps)
  batch = batch or (768 if gpus <= 1024 else 6144)
  best = search.search(model, gpus, hw, batch, techniques, c, max_batch_scale=scale, top=top)
  print(f"\n== {model.name} on {gpus} x {hw.name}, global batch {batch}, dp_comm={dp_comm}"
        f"{f', {node_gbps:g} Gb/s per node' if node_gbps else ''} ==")
  for i, pred in enumerate(best):
    print(f"{i + 1}. {describe(pred)}")
    print(breakdown(pred))
  tp, pp, vpp = paper.PARALLELISM[model.name]
  if gpus % (tp * pp):
    print(f"paper layout tp={tp} pp={pp} does not divide {gpus} GPUs")
    return best
  refs = paper.micro_batch_choices(model, gpus, batch, paper.MEGASCALE, hw, c)
  if not refs:
    print(f"paper layout tp={tp} pp={pp} vpp={vpp}: no micro-batch gives a valid layout that "
          f"fits here")
    return best
  ref = paper.tuned(refs)
  others = ", ".join(f"mb={p.layout.micro_batch} {100 * p.mfu:.1f}%" for p in refs if p is not ref)
  print(f"paper layout (micro-batch by the rule scaling_curves uses): {describe(ref)}")
  print(breakdown(ref))
  if others:
    print(f"  the paper gives no micro-batch; the other candidates: {others}")
  gain = 100 * (best[0].mfu - ref.mfu)
  if best[0].layout == ref.layout and best[0].techniques == ref.techniques:
    print("the search finds the paper's layout")
  else:
    print(f"best beats it by {gain:.1f} MFU points: per iteration of {batch} sequences it "
          f"{why(best[0], ref)}")
  return best


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_string("model", "175B", "Model preset: 175B or 530B.")
  flags.DEFINE_list("gpus", ["256", "1024", "12288"], "Accelerator counts to plan for.")
  flags.DEFINE_string("hardware", "a100_megascale", "Hardware preset.")
  flags.DEFINE_integer("global_batch", 0, "Global batch in sequences; 0 takes the paper's: "
                       "768 up to 1,024 GPUs, 6,144 above.")
  flags.DEFINE_integer("max_batch_scale", 1, "Also try the batch times 2..N (with LAMB on).")
  flags.DEFINE_integer("top", 5, "How many configurations to print.")
  flags.DEFINE_string("calibrate", None, "kernel_bench-gemm record to calibrate on.")
  flags.DEFINE_bool("calibrate_any_device", False, "Apply --calibrate's record even when it was "
                    "measured on another accelerator than --hardware models.")
  flags.DEFINE_enum("dp_comm", "none", list(DP_COMMS), "Data-parallel collectives: NCCL's "
                    "rings (perf/comm.ring_link), or SDP4Bit's two-level quantized ones "
                    "(perf/compressed.py).")
  flags.DEFINE_float("node_gbps", 0.0, "Inter-node bandwidth per node in Gb/s (0: the "
                     "preset's).")
  flags.DEFINE_bool("record", False, "Also write the top configurations per GPU count to a JSON "
                    "record in results/ (plan-<model>-model-<date>.json).")
  flags.DEFINE_bool("goodput", False, "Also print the best layout's tokens per wall-clock second "
                    "with failures counted (experiments.goodput.goodput_line).")


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    c, note = constants.DEFAULT, "default constants"
    if f.calibrate:
      c, note = calibrate.calibrated(c, f.calibrate, hardware.get_hardware(f.hardware),
                                     allow_other_device=f.calibrate_any_device)
    print(f"[plan] {note}")
    rows = []
    for value in f.gpus:
      try:
        gpus = int(value)
      except ValueError as e:
        raise ConfigError("gpus", value, "a comma-separated list of integers") from e
      best = plan(f.model, gpus, f.hardware, f.global_batch, f.max_batch_scale, f.top, c,
                  f.dp_comm, f.node_gbps)
      if f.goodput and best:
        from experiments.goodput import goodput_line
        print(goodput_line(best[0]))
      rows.append({"gpus": gpus, "top": [summary(p) for p in best]})
    if f.record:
      from experiments.results import write_record
      path = write_record(f"plan-{f.model}", rows,
                          device={"platform": "model", "device_kind": f.hardware},
                          extra={"constants": note, "dp_comm": f.dp_comm,
                                 "node_gbps": f.node_gbps})
      print(f"[plan] wrote {path}")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  define_flags()
  app.run(main)
