r"""Tokens/s of a pipelined layout against the unpipelined one, same model, same global batch.

  python -m experiments.pipeline_throughput         # 8 simulated CPU devices; writes results/
  python -m experiments.pipeline_throughput --repeats=7 --steps=3

The issue's comparison, as a new user would run it: a 4-layer, hidden-256 GPT, seq 256, 4
sequences per step (`train.global_batch`), one Trainer step (forward, backward, optimizer)
per call. Layouts: `data=2, tensor=4` (no pipeline) and `stage=2, tensor=4` with each
schedule and recompute choice listed in LAYOUTS (4 microbatches of 1 sequence). Every
layout is compiled first; then each repeat times --steps steps of every layout in turn, so
load on this shared machine falls on all of them alike. Reported: the median over repeats
of tokens/s per layout, and per pipelined layout the median of its per-repeat ratio to the
unpipelined layout (the figure the issue's targets are about: >= 0.9 for 1F1B and ZB-H1
with recompute='none', >= 0.85 for interleaved with overlap on; the same targets are shown
for 'selective', which the issue did not name).

On CPU the 8 "devices" share this host's cores, so a bubble costs little wall time; what
this measures is the executor's own overhead (recompute, branches, buffers), not a GPU's
pipeline speed-up.
"""
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

from experiments import results  # noqa: E402

_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds over every layout.")
_STEPS = flags.DEFINE_integer("steps", 3, "Steps per layout per round.")
_ONLY = flags.DEFINE_list("layouts", [], "Names of LAYOUTS to run (default: all).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the record (default results/).")

LAYERS, HIDDEN, SEQ, BATCH, MICROBATCHES = 4, 256, 256, 4, 4
FLAT = "data2-tensor4"
# name -> (mesh, pipeline); every pipelined layout is stage=2, tensor=4.
LAYOUTS = {
    FLAT: (dict(data=2, tensor=4), {}),
    "1f1b-none": (dict(stage=2, tensor=4), dict(schedule="1f1b", recompute="none")),
    "zb_h1-none": (dict(stage=2, tensor=4), dict(schedule="zb_h1", recompute="none")),
    "interleaved-v2-overlap-none": (dict(stage=2, tensor=4), dict(
        schedule="interleaved_1f1b", virtual_stages=2, overlap=True, recompute="none")),
    "1f1b-selective": (dict(stage=2, tensor=4), dict(schedule="1f1b", recompute="selective")),
    "zb_h1-selective": (dict(stage=2, tensor=4), dict(schedule="zb_h1", recompute="selective")),
    "interleaved-v2-overlap-selective": (dict(stage=2, tensor=4), dict(
        schedule="interleaved_1f1b", virtual_stages=2, overlap=True, recompute="selective")),
    "1f1b-full": (dict(stage=2, tensor=4), dict(schedule="1f1b", recompute="full")),
    "interleaved-v2-overlap-full": (dict(stage=2, tensor=4), dict(
        schedule="interleaved_1f1b", virtual_stages=2, overlap=True, recompute="full")),
}
TARGETS = {f"{name}-{recompute}": target for recompute in ("none", "selective")
           for name, target in (("1f1b", 0.9), ("zb_h1", 0.9), ("interleaved-v2-overlap", 0.85))}


def _config(mesh, pipeline):
  from mscale_jax.config import Config
  return Config(name="pipeline_throughput").replace(
      model=dict(num_layers=LAYERS, hidden=HIDDEN, num_heads=4, mlp_dim=4 * HIDDEN,
                 seq_len=SEQ),
      mesh=mesh, pipeline=dict(microbatches=MICROBATCHES, **pipeline),
      data=dict(kind="stdlib", prefetch=0),
      train=dict(global_batch=BATCH, steps=10**6, timeline=False, async_checkpoint=False))


class _Layout:
  """One layout's Trainer, state and fixed batch; `run(n)` -> seconds for n steps."""

  def __init__(self, name, workdir):
    import jax
    import numpy as np
    from mscale_jax.train import Trainer
    mesh, pipeline = LAYOUTS[name]
    self.trainer = Trainer(_config(mesh, pipeline), workdir, show_progress=False)
    self.state = self.trainer.init_state()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (BATCH, SEQ + 1)).astype(np.int32)
    self.batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    self.state, metrics = self.trainer.train_step(self.state, self.batch)   # compiles
    jax.block_until_ready(metrics)
    self.loss = float(metrics["loss"])

  def run(self, steps: int) -> float:
    """Seconds for `steps` train steps, synchronised at the end."""
    import jax
    start = time.perf_counter()
    for _ in range(steps):
      self.state, metrics = self.trainer.train_step(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))
    return time.perf_counter() - start


def main(argv):
  del argv
  import jax
  names = [FLAT] + [n for n in LAYOUTS if n != FLAT and (not _ONLY.value or n in _ONLY.value)]
  tokens_per_step = BATCH * SEQ
  with tempfile.TemporaryDirectory() as root:
    layouts = {}
    for name in names:
      start = time.perf_counter()
      layouts[name] = _Layout(name, os.path.join(root, name))
      print(f"[pipeline_throughput] {name}: compiled in {time.perf_counter() - start:.0f} s, "
            f"first loss {layouts[name].loss:.4f}", flush=True)
    rates = {name: [] for name in names}
    for r in range(_REPEATS.value):
      for name in names:
        rates[name].append(_STEPS.value * tokens_per_step / layouts[name].run(_STEPS.value))
      print(f"[pipeline_throughput] round {r + 1}/{_REPEATS.value}: " + ", ".join(
          f"{n} {rates[n][-1]:.0f}" for n in names) + " tokens/s", flush=True)
  rows = {}
  for name in names:
    ratios = [a / b for a, b in zip(rates[name], rates[FLAT])]
    rows[name] = {"mesh": LAYOUTS[name][0], "pipeline": LAYOUTS[name][1],
                  "tokens_per_s": rates[name], "median_tokens_per_s": statistics.median(
                      rates[name]), "ratio_to_unpipelined": ratios,
                  "median_ratio": statistics.median(ratios), "target": TARGETS.get(name),
                  "first_loss": layouts[name].loss}
    target = TARGETS.get(name)
    verdict = "" if target is None else (
        f" (target >= {target}: {'met' if rows[name]['median_ratio'] >= target else 'MISSED'})")
    print(f"[pipeline_throughput] {name:>28}: {rows[name]['median_tokens_per_s']:8.0f} "
          f"tokens/s, {rows[name]['median_ratio']:.3f}x unpipelined{verdict}")
  path = results.write_record("pipeline_throughput", rows, out_dir=_OUT_DIR.value, extra={
      "setup": f"{LAYERS} layers, hidden {HIDDEN}, seq {SEQ}, global batch {BATCH}, "
               f"{MICROBATCHES} microbatches; Trainer steps (optimizer "
               f"{_config({}, {}).optimizer.name}) on a fixed batch",
      "method": f"{_REPEATS.value} rounds; each round times {_STEPS.value} steps of every "
                f"layout in turn; medians over rounds",
      "note": f"{jax.devices()[0].platform}: 8 simulated devices share the host's cores, "
              f"which other jobs also used (load average at the end: {os.getloadavg()[0]:.1f})"})
  print(f"[pipeline_throughput] wrote {path}")


if __name__ == "__main__":
  app.run(main)
