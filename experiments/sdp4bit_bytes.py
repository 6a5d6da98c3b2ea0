r"""Bytes on the wire of one train step, none vs SDP4Bit, counted from the compiled program.

  python -m experiments.sdp4bit_bytes                       # gpt_tiny and gpt_125m, 8 devices
  python -m experiments.sdp4bit_bytes --configs=gpt_tiny --mesh=data=2,fsdp=4

Each config's train step is compiled (not run) on the simulated CPU devices with
optimizer.dp_comm='none' and 'sdp4bit', and every collective of the optimized HLO is sized
(`mscale_jax/sdp4bit/wire.py`: operand bytes per device, and the bytes a ring sends for it,
counted as often as it runs, so the scan over layers counts once per layer). The record lists
them per collective kind, the totals and their ratios, next to what the bit widths predict.

Data-parallel traffic does not depend on the batch or the sequence, so the larger configs are
compiled with a short sequence and a small batch (--seq_len, --global_batch) to keep XLA's CPU
compile short. Parameters and gradients are float32 here; the paper's baseline communicates
bfloat16, so its ratios are half of ours for the same bit widths.
"""
from experiments.host_devices import simulate_cpu_devices

simulate_cpu_devices(8)

import importlib  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments.kernel_bench import format_table  # noqa: E402
from experiments.results import write_record  # noqa: E402
from mscale_jax.checkpoint import abstract_like  # noqa: E402
from mscale_jax.config import Config  # noqa: E402
from mscale_jax.sdp4bit import wire  # noqa: E402
from mscale_jax.sdp4bit.quant import Quantizer  # noqa: E402
from mscale_jax.train import Trainer  # noqa: E402

_CONFIGS = flags.DEFINE_list("configs", ["gpt_tiny", "gpt_125m"], "Config files to compile.")
_MESH = flags.DEFINE_string("mesh", "data=2,fsdp=4", "Data-parallel mesh (tensor = stage = 1).")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Sequence length to compile with (at most the "
                            "config's).")
_BATCH = flags.DEFINE_integer("global_batch", 16, "Global batch to compile with.")
_OUT_DIR = flags.FLAGS["out_dir"]    # defined by experiments.kernel_bench (its table printer)


def _config(name: str, dp_comm: str, mesh: dict) -> Config:
  module = importlib.import_module(f"experiments.configs.{name}")
  config = Config.from_dict(module.get_config().to_dict())
  return config.replace(
      model={"seq_len": min(_SEQ.value, config.model.seq_len), "attention_window": None},
      mesh={"data": 1, "fsdp": 1, "stage": 1, "tensor": 1, "shrink_to_fit": False, **mesh},
      optimizer={"dp_comm": dp_comm},
      data={"kind": "synthetic", "prefetch": 0},
      train={"global_batch": _BATCH.value, "timeline": False, "log_every": 1,
             "eval_every": config.train.steps, "checkpoint_every": config.train.steps})


def compiled_step_text(config: Config) -> tuple[str, int]:
  """(optimized HLO text of the train step, parameter count), compiled on abstract arrays."""
  trainer = Trainer(config, tempfile.mkdtemp(prefix="sdp4bit_bytes-"), show_progress=False)
  with jax.set_mesh(trainer.mesh):
    state = abstract_like(jax.eval_shape(trainer._fresh_state), trainer.state_shardings)
  shape = (config.train.global_batch, config.model.seq_len)
  batch = {key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=trainer.batch_sharding)
           for key in ("inputs", "targets")}
  text = trainer.lower_step(state, batch).compile().as_text()
  trainer.train_iter.close()
  return text, trainer.num_params


def predicted_ratio(config: Config, mesh: dict) -> dict:
  """What the bit widths alone predict: float32 bytes / SDP4Bit bytes per collective role."""
  q = config.optimizer.sdp4bit
  weights = Quantizer(q.weight_bits, q.weight_group).wire_bits_per_value()
  intra = Quantizer(q.grad_bits_intra, q.grad_group).wire_bits_per_value()
  inter = Quantizer(q.grad_bits_inter, q.grad_group).wire_bits_per_value()
  return {"weight_all_gather": 32 / weights,
          "gradient_intra_level": 32 / intra if mesh.get("fsdp", 1) > 1 else None,
          "gradient_inter_level": 32 / inter if mesh.get("data", 1) > 1 else None}


def main(argv):
  del argv
  mesh = {k: int(v) for k, v in (item.split("=") for item in _MESH.value.split(","))}
  figures, rows = {}, []
  for name in _CONFIGS.value:
    per = {}
    for dp_comm in ("none", "sdp4bit"):
      config = _config(name, dp_comm, mesh)
      print(f"compiling {name} with dp_comm={dp_comm} on mesh {mesh} ...", flush=True)
      text, num_params = compiled_step_text(config)
      per[dp_comm] = wire.bytes_by_kind(text)
    totals = {d: {k: sum(r[k] for r in per[d].values()) for k in ("operand_bytes", "sent_bytes")}
              for d in per}
    figures[name] = {
        "num_params": num_params, "by_kind": per, "totals": totals,
        "reduction": {k: totals["none"][k] / totals["sdp4bit"][k]
                      for k in ("operand_bytes", "sent_bytes")},
        "predicted_ratio_vs_float32": predicted_ratio(config, mesh)}
    for d in per:
      for kind, r in sorted(per[d].items()):
        rows.append({"config": name, "dp_comm": d, "kind": kind, "ops": r["ops"],
                     "runs": r["executions"], "operand_MB": r["operand_bytes"] / 1e6,
                     "sent_MB": r["sent_bytes"] / 1e6})
    rows.append({"config": name, "dp_comm": "ratio", "kind": "total",
                 "operand_MB": figures[name]["reduction"]["operand_bytes"],
                 "sent_MB": figures[name]["reduction"]["sent_bytes"]})
  print(format_table(rows))
  path = write_record("sdp4bit_bytes", figures, out_dir=_OUT_DIR.value, extra={
      "mesh": mesh, "seq_len": _SEQ.value, "global_batch": _BATCH.value,
      "notes": "per device, per train step, from the optimized HLO on simulated CPU devices; "
               "'ratio' rows: none / sdp4bit. On CPU, XLA reduces gradients with all-reduce "
               "(no reduce-scatter pass); parameters and gradients are float32."})
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
