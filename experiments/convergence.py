r"""Do MegaScale's algorithmic changes keep model quality? Figure 10 at small scale, with seeds.

  python -m experiments.convergence                       # both figures, 3 seeds (~20-45 min)
  python -m experiments.convergence --quick               # smoke version (~3 min)
  python -m experiments.convergence --figures=fig10a --config.seeds=5

  fig10a  sequential block + full attention (baseline) / parallel block (PTB) / sliding-window
          attention (SWA) / PTB + SWA; AdamW at batch B.
  fig10b  AdamW at batch B (the baseline) / LAMB at 4B / AdamW at 4B, learning rates at 4B
          scaled by sqrt(4) as in the LAMB paper; 4B runs take 1/4 of the steps (equal tokens).
  sdp4bit SDP4Bit's quantized data-parallel collectives on 8 devices (data=2 x fsdp=4): exact
          collectives (its baseline) / qWD only (4-bit weight differences) / TLq-HS only
          (8/4-bit gradients, Hadamard) / both / the weights themselves at 4 bits (the
          ablation that motivates qWD). Simulates 8 CPU devices when asked for.

Every variant is the config's `run` with one switch changed, trained by the project's Trainer on
one device, once per seed (seed s sets both the initialisation and the data order, so seed s of
every variant sees the same training windows in the same order). All runs are evaluated on the
same held-out windows (whole files the training stream never contains; the record holds their
fingerprint). Variants shared by both figures run once.

Seeds of one variant differ only in constants of the initialisation, so their train and eval
steps compile once: JAX's persistent compilation cache is switched on in WORKDIR/jax_cache.

Outputs: per-run folders (metrics.jsonl, TensorBoard events, the final checkpoint, which
`experiments/sample.py` reads) under --workdir; under --out_dir a JSON record (via
`experiments/results.py`), fig10a.png / fig10b.png (mean over seeds with the min-max band,
against tokens) and convergence.md (the tables). Differences to the baseline are paired by
seed: mean of (variant - baseline) over seeds +- its standard error.
"""
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import sys
import time

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mscale_jax.errors import ConfigError


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  global _CONFIG, _QUICK, _FIGURES, _WORKDIR, _OUT_DIR, _REPLOT
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "experiments/configs/convergence.py", "ml_collections config file; override any "
      "field with --config.<field>=value (the baseline run is --config.run.*).", lock_config=True)
  _QUICK = flags.DEFINE_bool("quick", False, "Smoke version: the config's `quick` sizes replace "
                             "the full ones (a few minutes).")
  _FIGURES = flags.DEFINE_list("figures", ["fig10a", "fig10b"], "Which comparisons to run.")
  _WORKDIR = flags.DEFINE_string("workdir", None, "Folder for the runs (default "
                                 "runs/convergence-<UTC time>); must be new or empty.")
  _OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the record, plots and table "
                                 "(default results/convergence; with --quick, WORKDIR/results).")
  _REPLOT = flags.DEFINE_string("replot", None, "Train nothing: redraw the plots and table of "
                                "this record (a convergence JSON), beside it.")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One switch setting of the baseline run."""
  name: str
  label: str
  block: str = "sequential"
  sliding_window: bool = False
  optimizer: str = "adamw"
  large_batch: bool = False          # batch_scale x the batch, 1 / batch_scale of the steps
  dp_comm: str = "none"
  sdp4bit: tuple = ()                 # (field, value) pairs of optimizer.sdp4bit
  devices: int = 1                   # > 1: the sdp4bit_mesh (data x fsdp) over that many


BASELINE = Variant("baseline", "sequential + full attention, AdamW @ B")
FIGURES = {
    "fig10a": (BASELINE,
               Variant("ptb", "parallel block (PTB)", block="parallel"),
               Variant("swa", "sliding-window attention", sliding_window=True),
               Variant("ptb_swa", "PTB + sliding window", block="parallel",
                       sliding_window=True)),
    "fig10b": (BASELINE,
               Variant("lamb_4b", "LAMB @ 4B, sqrt-scaled lr", optimizer="lamb",
                       large_batch=True),
               Variant("adamw_4b", "AdamW @ 4B, sqrt-scaled lr", large_batch=True)),
    "sdp4bit": (Variant("dp8_exact", "8 devices, exact collectives", devices=8),
                Variant("qwd", "qWD: 4-bit weight differences", devices=8, dp_comm="sdp4bit",
                        sdp4bit=(("gradients", False),)),
                Variant("tlq_hs", "TLq-HS: 8/4-bit gradients + Hadamard", devices=8,
                        dp_comm="sdp4bit", sdp4bit=(("weights", "none"),)),
                Variant("sdp4bit", "SDP4Bit: qWD + TLq-HS", devices=8, dp_comm="sdp4bit"),
                Variant("weights_4bit", "4-bit weights (no differences)", devices=8,
                        dp_comm="sdp4bit", sdp4bit=(("weights", "weights"),
                                                    ("gradients", False)))),
}
SDP4BIT_MESH = {"data": 2, "fsdp": 4}


def settings_from_flags():
  """The config with --quick's sizes applied (a ConfigDict)."""
  settings = _CONFIG.value
  if _QUICK.value:
    quick = settings.quick.to_dict()
    with settings.unlocked():
      settings.update(quick)
  return settings


def variant_config(settings, variant: Variant, seed: int):
  """The `Config` of one run: the baseline with the variant's switches, seed `seed`.

  Raises:
    ConfigError: a cadence of the baseline is not divisible by batch_scale (the 4B runs could
      not see exactly the same tokens), or a field is invalid.
  """
  from mscale_jax.config import Config
  run = Config.from_dict(settings.run.to_dict())
  if run.model.block != "sequential" or run.model.attention_window is not None \
      or run.optimizer.name != "adamw":
    raise ConfigError("run", f"block={run.model.block!r}, attention_window="
                      f"{run.model.attention_window}, optimizer={run.optimizer.name!r}",
                      "the baseline: block='sequential', attention_window=None, "
                      "optimizer='adamw' (variants switch these)")
  scale = settings.batch_scale if variant.large_batch else 1
  t, o = run.train, run.optimizer
  cadences = {"run.train.steps": t.steps, "run.train.log_every": t.log_every,
              "run.train.eval_every": t.eval_every, "run.train.eval_batches": t.eval_batches,
              "run.train.checkpoint_every": t.checkpoint_every,
              "run.optimizer.warmup_steps": o.warmup_steps}
  for field, value in cadences.items():
    if value % scale:
      raise ConfigError(field, value, f"a multiple of batch_scale={scale}, so that the "
                        f"{scale}B runs see the same tokens and held-out windows")
  base_lr = settings.lamb_learning_rate if variant.optimizer == "lamb" else o.learning_rate
  mesh = SDP4BIT_MESH if variant.devices > 1 else {}
  config = run.replace(
      mesh=mesh,
      model={"block": variant.block,
             "attention_window": settings.window if variant.sliding_window else None},
      optimizer={"name": variant.optimizer, "learning_rate": base_lr * math.sqrt(scale),
                 "warmup_steps": o.warmup_steps // scale, "dp_comm": variant.dp_comm,
                 "sdp4bit": dataclasses.replace(o.sdp4bit, **dict(variant.sdp4bit))},
      train={"seed": seed, "global_batch": t.global_batch * scale, "steps": t.steps // scale,
             "log_every": t.log_every // scale, "eval_every": t.eval_every // scale,
             "eval_batches": t.eval_batches // scale,
             "checkpoint_every": t.checkpoint_every // scale},
      data={"seed": seed})
  return dataclasses.replace(config, name=f"convergence-{variant.name}")


def eval_fingerprint(batches) -> str:
  """sha256 of the held-out windows in order (equal for any split of them into batches)."""
  import numpy as np
  digest = hashlib.sha256()
  for key in ("inputs", "targets"):
    digest.update(np.concatenate([b[key] for b in batches]).astype(np.int32).tobytes())
  return digest.hexdigest()[:16]


def verbatim_overlap(corpus, batches) -> int | None:
  """How many held-out windows also occur byte for byte in the training text (stdlib only).

  Whole files are held out, but boilerplate (licence headers, common idioms) repeats across
  files; this says how much of the held-out set a model could have memorised verbatim.
  """
  import numpy as np
  if corpus.kind != "stdlib":
    return None
  train = corpus.train.tobytes()
  count = 0
  for b in batches:
    windows = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1).astype(np.uint8)
    count += sum(row.tobytes() in train for row in windows)
  return count


def devices_of(config) -> int:
  """Devices a run's mesh takes (one, or the sdp4bit figure's data x fsdp)."""
  return config.mesh.data * config.mesh.fsdp if config.mesh.data > 0 else 1


def train_one(config, workdir: str):
  """Trains one run with the project's Trainer on its devices: (curves and timing, Trainer)."""
  import jax
  from mscale_jax.train import Trainer
  trainer = Trainer(config, workdir, devices=jax.devices()[:devices_of(config)],
                    show_progress=False)
  fingerprint = eval_fingerprint(trainer.eval_batches)
  start = time.perf_counter()
  summary = trainer.train()
  wall_s = time.perf_counter() - start
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  tokens_per_step = config.train.global_batch * config.model.seq_len
  return {
      "seed": config.train.seed,
      "final_eval_loss": summary["last_eval_loss"],
      "train": [[r["step"] * tokens_per_step, r["loss"]] for r in records],
      "eval": [[r["step"] * tokens_per_step, r["eval_loss"]] for r in records
               if "eval_loss" in r],
      "wall_s": wall_s,
      "compile_s": summary["compile_s"],
      "tokens_per_s": summary["mean_tokens_per_s"],
      "num_params": summary["num_params"],
      "eval_fingerprint": fingerprint,
      "workdir": workdir,
  }, trainer


def summarize(runs: list[dict]) -> dict:
  """Mean, std (ddof=1), min and max over seeds of the final held-out loss and of each curve."""
  import numpy as np
  final = np.array([r["final_eval_loss"] for r in runs])
  out = {"final_eval_loss": {"mean": float(final.mean()), "std": _std(final),
                             "per_seed": final.tolist()}}
  for key in ("train", "eval"):
    tokens = [x for x, _ in runs[0][key]]
    values = np.array([[y for _, y in r[key]] for r in runs])
    out[key] = {"tokens": tokens, "mean": values.mean(0).tolist(),
                "min": values.min(0).tolist(), "max": values.max(0).tolist()}
  return out


def paired_difference(runs: list[dict], baseline: list[dict]) -> dict:
  """Final held-out loss minus the baseline's, paired by seed: mean and its standard error."""
  import numpy as np
  by_seed = {r["seed"]: r["final_eval_loss"] for r in baseline}
  diffs = np.array([r["final_eval_loss"] - by_seed[r["seed"]] for r in runs])
  stderr = _std(diffs) / math.sqrt(diffs.size) if diffs.size > 1 else float("nan")
  return {"mean": float(diffs.mean()), "stderr": stderr, "per_seed": diffs.tolist()}


def _std(values) -> float:
  return float(values.std(ddof=1)) if len(values) > 1 else float("nan")


def plot_figure(path: str, figure: str, variants, stats: dict, title: str) -> None:
  """Training and held-out loss against tokens: mean over seeds, min-max band."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for ax, key, name in ((axes[0], "train", "training loss (one batch)"),
                        (axes[1], "eval", "held-out loss")):
    for variant in variants:
      s = stats[variant.name][key]
      tokens = [x / 1e6 for x in s["tokens"]]
      line, = ax.plot(tokens, s["mean"], label=variant.label, lw=1.5)
      ax.fill_between(tokens, s["min"], s["max"], color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel(f"{name}, nats/byte")
    ax.grid(alpha=0.3)
    # Each panel from its second point on: the loss at initialisation (~5.5) would flatten
    # the rest.
    shown = [y for v in variants for y in _band_after_first(stats[v.name][key])]
    if shown:
      ax.set_ylim(min(shown) - 0.02, max(shown) + 0.02)
  axes[1].legend(fontsize=8)
  fig.suptitle(f"{figure}: {title}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _band_after_first(curve: dict) -> list[float]:
  """The band's values from the curve's second point on."""
  return curve["min"][1:] + curve["max"][1:]


def table(figure: str, variants, stats: dict, diffs: dict, seeds: int) -> str:
  """Markdown table of final held-out loss and the paired difference to the baseline."""
  lines = [f"**{figure}** ({seeds} seeds; difference paired by seed, +- standard error)", "",
           "| variant | final held-out loss (mean +- std) | minus baseline |",
           "|---|---|---|"]
  for variant in variants:
    f = stats[variant.name]["final_eval_loss"]
    if variant.name == variants[0].name:
      diff = "-"
    else:
      d = diffs[figure][variant.name]
      diff = f"{d['mean']:+.4f} +- {d['stderr']:.4f}"
    lines.append(f"| {variant.label} | {f['mean']:.4f} +- {f['std']:.4f} | {diff} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)
  for name in ("mscale_jax", "pallas_kernels"):
    logging.getLogger(name).setLevel(logging.WARNING)
  if _REPLOT.value:
    replot(_REPLOT.value)
    return
  try:
    settings = settings_from_flags()
    unknown = [f for f in _FIGURES.value if f not in FIGURES]
    if unknown or not _FIGURES.value:
      raise ConfigError("--figures", ",".join(_FIGURES.value),
                        f"a comma-separated subset of {', '.join(FIGURES)}")
    if isinstance(settings.seeds, bool) or settings.seeds < 1:
      raise ConfigError("seeds", settings.seeds, "a positive integer")
    variants = list({v.name: v for f in _FIGURES.value for v in FIGURES[f]}.values())
    configs = {v.name: [variant_config(settings, v, s) for s in range(settings.seeds)]
               for v in variants}
    from mscale_jax.config import validate
    for runs in configs.values():
      validate(runs[0], devices_of(runs[0]))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    workdir = os.path.abspath(_WORKDIR.value or os.path.join("runs", f"convergence-{stamp}"))
    if os.path.isdir(workdir) and os.listdir(workdir):
      raise ConfigError("--workdir", workdir, "a new or empty folder (it holds earlier runs)")
    default_out = (os.path.join(workdir, "results") if _QUICK.value
                   else os.path.join("results", "convergence"))
    out_dir = os.path.abspath(_OUT_DIR.value or default_out)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)

  if "sdp4bit" in _FIGURES.value:
    from experiments.host_devices import simulate_cpu_devices
    simulate_cpu_devices(8)
  import jax
  # Seeds of a variant share their compiled train and eval steps through this cache.
  jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  from experiments import results as results_lib
  commit = results_lib.git_commit()    # of the code that runs (later edits do not affect it)
  total = sum(len(c) for c in configs.values())
  print(f"[convergence] {', '.join(_FIGURES.value)}: {len(variants)} variants x "
        f"{settings.seeds} seeds = {total} runs; workdir {workdir}", flush=True)
  results, done, start = {}, 0, time.perf_counter()
  corpus_check = None
  for variant in variants:
    results[variant.name] = []
    for config in configs[variant.name]:
      run_dir = os.path.join(workdir, variant.name, f"seed{config.train.seed}")
      run, trainer = train_one(config, run_dir)
      if corpus_check is None:
        corpus_check = {"corpus": trainer.corpus.description,
                        "heldout_windows": len(trainer.eval_batches) * config.train.global_batch,
                        "heldout_windows_verbatim_in_train": verbatim_overlap(
                            trainer.corpus, trainer.eval_batches)}
      results[variant.name].append(run)
      done += 1
      elapsed = time.perf_counter() - start
      print(f"[convergence] {done}/{total} {variant.name} seed {config.train.seed}: held-out "
            f"loss {run['final_eval_loss']:.4f}, {run['wall_s']:.0f} s (compile "
            f"{run['compile_s']:.0f} s); elapsed {elapsed / 60:.1f} min, ~"
            f"{elapsed / done * (total - done) / 60:.1f} min left", flush=True)

  fingerprints = {r["eval_fingerprint"] for runs in results.values() for r in runs}
  if len(fingerprints) != 1:
    raise RuntimeError(f"variants were evaluated on different held-out windows: {fingerprints}")
  stats = {name: summarize(runs) for name, runs in results.items()}
  diffs = {f: {v.name: paired_difference(results[v.name], results[FIGURES[f][0].name])
               for v in FIGURES[f][1:]} for f in _FIGURES.value}
  write_outputs(settings, variants, configs, results, stats, diffs, corpus_check,
                fingerprints.pop(), out_dir, commit)


def write_outputs(settings, variants, configs, results, stats, diffs, corpus_check,
                  fingerprint, out_dir, commit) -> None:
  """The JSON record, one PNG per figure and the markdown tables, under `out_dir`."""
  from experiments import results as results_lib
  os.makedirs(out_dir, exist_ok=True)
  run = configs[variants[0].name][0]
  m, t = run.model, run.train
  tokens = t.steps * t.global_batch * m.seq_len
  title = (f"{results[variants[0].name][0]['num_params']:,}-parameter byte-level GPT "
           f"({m.num_layers} x d={m.hidden}, seq {m.seq_len}), {tokens:,} tokens, "
           f"B={t.global_batch}, window {settings.window}, {settings.seeds} seeds")
  paths = draw(title, _FIGURES.value, stats, diffs, settings.seeds, out_dir)
  runs = {name: [{k: v for k, v in r.items() if k not in ("train", "eval")} for r in rs]
          for name, rs in results.items()}
  figures = {
      "summary": title,
      "final_eval_loss": {name: s["final_eval_loss"] for name, s in stats.items()},
      "difference_to_baseline": diffs,
      "curves": {name: {"train": s["train"], "eval": s["eval"]} for name, s in stats.items()},
      "runs": runs,
  }
  extra = {
      "settings": settings.to_dict(),
      "quick": _QUICK.value,
      "variants": {v.name: {**dataclasses.asdict(v),
                            "learning_rate": configs[v.name][0].optimizer.learning_rate,
                            "global_batch": configs[v.name][0].train.global_batch,
                            "steps": configs[v.name][0].train.steps} for v in variants},
      "learning_rate_rule": "sqrt: lr(kB) = lr(B) * sqrt(k) (LAMB paper), for LAMB from "
                            "lamb_learning_rate and for AdamW from run.optimizer.learning_rate",
      "heldout": {**corpus_check, "fingerprint": fingerprint,
                  "note": "the same windows for every run (equal fingerprints checked)"},
      "statistics": "mean and std (ddof=1) over seeds; difference to the baseline paired by "
                    "seed (seed s: same init seed and data order), mean +- standard error",
      "outputs": paths,
      "commit": commit,
  }
  name = "convergence-quick" if _QUICK.value else "convergence"
  paths["record"] = results_lib.write_record(name, figures, out_dir=out_dir, extra=extra)
  print(open(paths["table"]).read())
  for key, path in paths.items():
    print(f"[convergence] {key}: {path}")


def draw(title: str, figures, stats: dict, diffs: dict, seeds: int, out_dir: str) -> dict:
  """Writes FIGURE.png for each figure and convergence.md; returns their paths."""
  paths, tables = {}, []
  for figure in figures:
    paths[figure] = os.path.join(out_dir, f"{figure}.png")
    plot_figure(paths[figure], figure, FIGURES[figure], stats, title)
    tables.append(table(figure, FIGURES[figure], stats, diffs, seeds))
  paths["table"] = os.path.join(out_dir, "convergence.md")
  with open(paths["table"], "w") as f:
    f.write(f"{title}\n\n" + "\n".join(tables))
  return paths


def replot(record_path: str) -> None:
  """Redraws the plots and table of a convergence record (e.g. after a cosmetic change)."""
  with open(record_path) as f:
    record = json.load(f)
  figures = record["figures"]
  stats = {name: {**curves, "final_eval_loss": figures["final_eval_loss"][name]}
           for name, curves in figures["curves"].items()}
  diffs = figures["difference_to_baseline"]
  paths = draw(figures["summary"], list(diffs), stats, diffs, record["settings"]["seeds"],
               os.path.dirname(os.path.abspath(record_path)))
  for key, path in paths.items():
    print(f"[convergence] {key}: {path}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
