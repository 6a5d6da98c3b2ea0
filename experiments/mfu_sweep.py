r"""Measured MFU over configurations on the devices at hand: MegaScale's ablation on one device.

  python -m experiments.mfu_sweep                                   # gpt_125m, the ladder
  python -m experiments.mfu_sweep --config=experiments/configs/gpt_1p3b.py \
      --variants=baseline,megascale
  python -m experiments.mfu_sweep --config=experiments/configs/gpt_tiny.py --steps=2 --rounds=1

The paper's Table 3 adds its techniques one at a time to Megatron-LM on 256 GPUs. The ones that
act inside one device are the parallel transformer block, sliding-window attention, efficient
operators and LAMB's larger batch, so on one device the ladder is (each row adds to the last):

  baseline     sequential block, XLA attention, XLA LayerNorm, AdamW (Megatron-LM's choices)
  ptb          + parallel transformer block
  flash        + flash attention (Pallas: Triton on GPU)
  swa          + sliding window of seq_len / 4 (the paper gives no size); the FLOPs count
               keeps full causal attention, as the paper's does, so skipped blocks show as MFU
  fused_ln     + fused LayerNorm (Pallas)
  lamb_x3      + fused LAMB and 3x the global batch (the paper's last row)

Off the ladder: `cudnn` (the ptb row with cuDNN's attention) and `megascale` (= lamb_x3).

Each variant is compiled with the Trainer's own step program; then each of --rounds rounds
times --steps steps (state donated, batches on device before timing, one sync per round).
Reported per variant: the median step time over rounds, tokens/s, TFLOP/s per device and MFU =
tokens/s x Megatron FLOPs per token (no recomputation; `mscale_jax.flops`) / (devices x the
dense bf16 peak of the data sheet; on CPU the host's measured matmul rate). Every variant's
config is validated before the first compiles (a ConfigError exits with status 2); a variant that
fails later (out of memory, a kernel that does not compile) is recorded with its error and the
sweep goes on.
"""
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback

from experiments.host_devices import simulate_cpu_devices

simulate_cpu_devices(8)

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from mscale_jax.errors import ConfigError  # noqa: E402

# name -> (what it adds, {section: {field: value}}); `None` values are filled from the config.
LADDER = (
    ("baseline", "Megatron-LM's choices", {
        "model": {"block": "sequential", "attention_impl": "xla", "norm_impl": "xla",
                  "attention_window": None},
        "optimizer": {"name": "adamw"}}),
    ("ptb", "+ parallel transformer block", {"model": {"block": "parallel"}}),
    ("flash", "+ flash attention (Pallas)", {"model": {"attention_impl": "pallas"}}),
    ("swa", "+ sliding window, seq_len / 4", {"model": {"attention_window": "quarter"}}),
    ("fused_ln", "+ fused LayerNorm (Pallas)", {"model": {"norm_impl": "pallas"}}),
    ("lamb_x3", "+ fused LAMB, global batch x3", {"optimizer": {"name": "lamb_fused"},
                                                  "train": {"global_batch": "x3"}}),
)
EXTRA = {
    "cudnn": ("ptb", "ptb with cuDNN attention", {"model": {"attention_impl": "cudnn"}}),
    "megascale": ("lamb_x3", "every technique above", {}),
}
VARIANTS = tuple(name for name, _, _ in LADDER) + tuple(EXTRA)


def define_flags():
  """The command line (defined only when run as a script, so importing defines no flags)."""
  config_flags.DEFINE_config_file(
      "config", "experiments/configs/gpt_125m.py", "ml_collections config file whose model, "
      "batch and data the variants modify; --config.<section>.<field>=value overrides.")
  flags.DEFINE_list("variants", list(name for name, _, _ in LADDER),
                    f"Variants to measure, in order; any of {', '.join(VARIANTS)}.")
  flags.DEFINE_integer("steps", 10, "Timed steps per round.")
  flags.DEFINE_integer("rounds", 3, "Timed rounds per variant; the median round is reported.")
  flags.DEFINE_integer("warmup", 2, "Untimed steps after compiling.")
  flags.DEFINE_string("out_dir", None, "Folder for the record (default results/).")


def overrides(name: str, config) -> dict:
  """{section: {field: value}} that turns `config` into variant `name` (the ladder cumulative).

  Raises ConfigError for an unknown name.
  """
  if name in EXTRA:
    base, _, own = EXTRA[name]
    return _merge(overrides(base, config), own)
  names = [n for n, _, _ in LADDER]
  if name not in names:
    raise ConfigError("variants", name, f"one of {', '.join(VARIANTS)}")
  out = {}
  for step_name, _, step in LADDER[:names.index(name) + 1]:
    out = _merge(out, step)
  if out.get("model", {}).get("attention_window") == "quarter":
    out["model"]["attention_window"] = max(config.model.seq_len // 4, 1)
  if out.get("train", {}).get("global_batch") == "x3":
    out["train"]["global_batch"] = 3 * config.train.global_batch
  return out


def _merge(a: dict, b: dict) -> dict:
  return {s: {**a.get(s, {}), **b.get(s, {})} for s in {*a, *b}}


def describe(name: str) -> str:
  """One line on what variant `name` is."""
  for step_name, what, _ in LADDER:
    if step_name == name:
      return what
  return EXTRA[name][1]


def measure(config, *, steps: int, rounds: int, warmup: int) -> dict:
  """Compiles `config`'s train step on all devices and times it; the figures of one row."""
  import jax
  from mscale_jax.train import Trainer
  with tempfile.TemporaryDirectory(prefix="mfu_sweep-") as workdir:
    trainer = Trainer(config, workdir, show_progress=False)
    state = trainer.init_state()
    batches = [trainer.device_batch(next(trainer.train_iter)) for _ in range(2)]
    start = time.perf_counter()
    program = trainer.lower_step(state, batches[0]).compile()
    compile_s = time.perf_counter() - start
    memory = program.memory_analysis()

    def run(n):
      nonlocal state
      metrics = None
      for i in range(n):
        state, metrics = program(state, batches[i % len(batches)])
      jax.block_until_ready((state, metrics))    # the last update too, not only its loss
      return metrics

    try:
      run(warmup)
      times = []
      for _ in range(rounds):
        start = time.perf_counter()
        metrics = run(steps)
        times.append((time.perf_counter() - start) / steps)
    finally:
      trainer.train_iter.close()
  step_s = statistics.median(times)
  tokens_per_s = config.train.global_batch * config.model.seq_len / step_s
  devices = len(trainer.devices)
  row = {
      "step_s": step_s, "step_s_rounds": times, "tokens_per_s": tokens_per_s,
      "tflops_per_device": tokens_per_s * trainer.flops_per_token / devices / 1e12,
      "mfu": tokens_per_s * trainer.flops_per_token / trainer.peak.flops,
      "flops_per_token": trainer.flops_per_token, "peak_flops": trainer.peak.flops,
      "peak_source": trainer.peak.source, "compile_s": compile_s,
      "last_loss": float(metrics["loss"]), "devices": devices,
      "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
      "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
  }
  return row


def run_variant(name: str, base, **timing) -> dict:
  """Measures one variant (`timing`: measure's steps, rounds, warmup); an error becomes the
  row's `error` and the sweep goes on. main() has validated every variant's config already."""
  changes = overrides(name, base)
  row = {"variant": name, "adds": describe(name), "overrides": changes}
  try:
    row.update(measure(base.replace(**changes), **timing))
  except Exception as error:  # pylint: disable=broad-except  (OOM, a kernel that won't build)
    row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
    if not isinstance(error, ConfigError):
      traceback.print_exc(limit=3)
  return row


def _device_count():
  import jax
  return len(jax.devices())


def _platform():
  import jax
  return jax.devices()[0].platform


def format_row(row: dict) -> str:
  """One printed line per variant."""
  if "error" in row:
    return f"  {row['variant']:10s} FAILED {row['error']}"
  return (f"  {row['variant']:10s} {1e3 * row['step_s']:9.1f} ms/step "
          f"{row['tokens_per_s']:11,.0f} tok/s {row['tflops_per_device']:7.1f} TFLOP/s "
          f"MFU {100 * row['mfu']:5.1f}%  (compile {row['compile_s']:.0f} s)  {row['adds']}")


def plot(rows: list[dict], title: str, path: str) -> None:
  """Bar chart of MFU per variant (failed ones marked)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 2, 3.5))
  names = [r["variant"] for r in rows]
  values = [100 * r.get("mfu", 0.0) for r in rows]
  bars = ax.bar(names, values, color=["#bbb" if "error" in r else "#3a7" for r in rows])
  for bar, r in zip(bars, rows):
    label = "failed" if "error" in r else f"{100 * r['mfu']:.1f}"
    ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center", va="bottom", fontsize=8)
  ax.set_ylabel("MFU (%)")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  import logging
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)     # orbax's INFO lines; ours stay
  for name in ("mscale_jax", "pallas_kernels"):
    logging.getLogger(name).setLevel(logging.INFO)
  import jax
  from experiments import results
  from mscale_jax.config import Config, validate
  f = flags.FLAGS
  try:
    base = Config.from_dict(f.config.to_dict())
    for name in f.variants:       # every variant's config checked before the first compiles
      validate(base.replace(**overrides(name, base)), _device_count(), platform=_platform())
    for field, least in (("steps", 1), ("rounds", 1), ("warmup", 0)):
      if getattr(f, field) < least:
        raise ConfigError(field, getattr(f, field), f"at least {least}")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  devices = jax.devices()
  print(f"[mfu_sweep] {base.name} on {len(devices)} x {devices[0].device_kind}: "
        f"{len(f.variants)} variants, {f.rounds} rounds x {f.steps} steps after {f.warmup} "
        f"warm-up steps", flush=True)
  if devices[0].platform == "cpu":
    print("[mfu_sweep] CPU: simulated devices share this host's cores and Pallas kernels run in "
          "the interpreter; a GPT-3-sized config takes long here (try "
          "--config=experiments/configs/gpt_tiny.py for a smoke run)", flush=True)
  rows = []
  for name in f.variants:
    print(f"[mfu_sweep] {name}: compiling ...", flush=True)
    rows.append(run_variant(name, base, steps=f.steps, rounds=f.rounds, warmup=f.warmup))
    print(format_row(rows[-1]), flush=True)
    gc.collect()        # the last variant's buffers go before the next one allocates
  figures = {"variants": rows, "ladder": [n for n, _, _ in LADDER],
             "mfu_formula": "tokens/s x Megatron-LM FLOPs per token (no recomputation, full "
                            "causal attention whatever the window) / (devices x peak)"}
  path = results.write_record(f"mfu_sweep-{base.name}", figures, out_dir=f.out_dir,
                              extra={"config": base.to_dict(),
                                     "timing": {"steps": f.steps, "rounds": f.rounds,
                                                "warmup": f.warmup}})
  png = path[:-len(".json")] + ".png"
  plot(rows, f"{base.name} on {len(devices)} x {devices[0].device_kind}: MFU per variant "
             f"(Megatron FLOPs; {rows[0].get('peak_source', '')[:60]})", png)
  print(f"[mfu_sweep] wrote {path} and {png}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
