r"""The main job: train a GPT on a device mesh, or print what a config would need (--dry_run).

  scripts/train.sh                                       # gpt_tiny, 8 CPU devices or the GPU
  python -m experiments.train --config=experiments/configs/gpt_tiny.py \
      --config.mesh.tensor=2 --config.model.block=sequential --config.train.steps=100
  python -m experiments.train --config=experiments/configs/gpt_175b.py --dry_run

Run as one of several processes (by `experiments.launch`, Slurm or Kubernetes), it joins the
job as the MSCALE_* environment variables say (mscale_jax/resilience/worker/), sends heartbeats
to the driver and fires the faults it was given. A non-finite loss with train.on_nonfinite=stop
exits with status 3.

Outputs go to --workdir (default runs/<config>-<UTC timestamp>): metrics.jsonl, TensorBoard
events in tensorboard/, checkpoints/ and summary.json. A workdir that holds checkpoints is
resumed. A bad configuration prints one line and exits with status 2 before anything compiles.
"""
from experiments.host_devices import simulate_cpu_devices

simulate_cpu_devices(8)

import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mscale_jax.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/configs/gpt_tiny.py", "ml_collections config file; override any "
    "field with --config.<section>.<field>=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default runs/<config>-<time>); "
                               "an existing one with checkpoints is resumed.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print parameter count, FLOPs per token and "
                             "per-device memory from jax.eval_shape on the config's mesh; "
                             "allocate nothing.")
_FAULTS = flags.DEFINE_multi_string("fault", [], "Inject a fault (drills and tests), e.g. "
                                     "nan:step=60 or kill:rank=0:step=37; repeatable. See "
                                     "mscale_jax/resilience/faults.py.")
_RECORD = flags.DEFINE_bool("record", False, "Also write the run summary as a JSON record "
                            "to results/ (for figures the README cites).")


def _config():
  from mscale_jax.config import Config
  return Config.from_dict(_CONFIG.value.to_dict())


def dry_run(config) -> dict:
  """Parameter count, FLOPs per token and per-device bytes of params/grads/optimizer state."""
  from mscale_jax import flops, mesh as mesh_lib
  from mscale_jax.config import MESH_AXES, validate
  from mscale_jax.model import abstract_model
  import jax
  requested = {axis: max(getattr(config.mesh, axis), 1) for axis in MESH_AXES}
  mesh_shape = validate(config, math.prod(requested.values()))
  _, params, names = abstract_model(config.model)
  leaves = jax.tree.leaves(params)
  name_leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
  local = sum(math.prod(mesh_lib.shard_shape(p.shape, n, mesh_shape))
              for p, n in zip(leaves, name_leaves))
  m = config.model
  gib = 2.0 ** 30
  report = {
      "config": config.name,
      "mesh": mesh_shape,
      "devices": math.prod(mesh_shape.values()),
      "num_params": sum(math.prod(p.shape) for p in leaves),
      "flops_per_token": flops.model_flops_per_token(m),
      "params_per_device": local,
      "per_device_gib": {"params_fp32": 4 * local / gib, "grads_fp32": 4 * local / gib,
                         "optimizer_fp32": 8 * local / gib, "total": 16 * local / gib},
      "note": "parameters, gradients and two optimizer moments in float32, sharded as the mesh "
              "rules say (layers over stage, heads/mlp/vocab over tensor, embed over fsdp); "
              "activations depend on the micro-batch and pipeline schedule and are not "
              "included (see mscale_jax.perf for them).",
  }
  return report


def worker_callbacks(heartbeats, env=None) -> list:
  """The callbacks of a worker: heartbeats when the driver listens (MSCALE_HEARTBEAT_URL), the
  faults asked for (MSCALE_FAULTS, then --fault), if any, and a bad slot's corruption
  (MSCALE_BAD_SLOT)."""
  from mscale_jax.callbacks.worker import BadSlot, FaultInjection, Heartbeats
  from mscale_jax.resilience.faults import parse_faults
  env = os.environ if env is None else env
  faults = parse_faults(json.loads(env.get("MSCALE_FAULTS", "[]")) + list(_FAULTS.value))
  bad_from = int(env.get("MSCALE_BAD_SLOT", "0") or 0)
  return ([Heartbeats(heartbeats)] if heartbeats.url else []) + \
      ([FaultInjection(faults)] if faults else []) + \
      ([BadSlot(bad_from, int(env.get("MSCALE_SLOT", "0")))] if bad_from else [])


def main(argv):
  del argv
  # Our own INFO lines (data, optimizer, attention choices) stay; libraries' INFO chatter goes.
  absl_logging.set_verbosity(absl_logging.WARNING)
  for name in ("mscale_jax", "pallas_kernels"):
    logging.getLogger(name).setLevel(logging.INFO)
  from mscale_jax.resilience import events
  from mscale_jax.resilience.worker import distributed, selfcheck
  from mscale_jax.resilience.worker.heartbeat import HeartbeatClient
  try:
    config = _config()
    if _DRY_RUN.value:
      print(json.dumps(dry_run(config), indent=2))
      return
    distributed.initialize_distributed()
    heartbeats = HeartbeatClient.from_env()
    callbacks = worker_callbacks(heartbeats)
    from mscale_jax.train import Trainer
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    workdir = _WORKDIR.value or os.path.join("runs", f"{config.name}-{stamp}")
    selfcheck.self_check_if_asked(heartbeats, workdir)   # a restarted group checks its slots
    trainer = Trainer(config, workdir, callbacks=callbacks, attempt=heartbeats.beat.attempt)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  import jax
  print(f"[train] {config.name}: {trainer.num_params:,} parameters on "
        f"{len(trainer.devices)} x {trainer.devices[0].device_kind}, mesh "
        f"{dict(trainer.mesh.shape)}; data: {trainer.corpus.description}; workdir {workdir}",
        flush=True)
  from mscale_jax.errors import NonFiniteError
  try:
    summary = trainer.train()
  except ConfigError as e:   # raised while tracing, e.g. a kernel's block size
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except NonFiniteError as e:   # the Heartbeats callback has told the driver
    print(f"error: {e}", file=sys.stderr)
    sys.exit(events.EXIT_NONFINITE)
  if jax.process_index() != 0:
    return
  print("[train] summary:")
  for key in ("first_loss", "last_loss", "last_eval_loss", "mean_tokens_per_s", "mfu",
              "peak_source", "compile_s", "metrics", "tensorboard", "checkpoints"):
    value = summary[key]
    if key == "mfu":
      value = f"{100 * value:.2f}% (Megatron FLOPs/token {summary['flops_per_token']:.4g})"
    print(f"  {key:18s} {value}")
  saves = [s for s in summary["checkpoint_saves"] if s["write_s"] is not None]
  if saves:
    print(f"  {'checkpoint_stall':18s} {max(s['stall_s'] for s in saves):.2f} s at most, "
          f"then {max(s['write_s'] for s in saves):.2f} s of background write "
          f"({len(saves)} saves)")
  if summary["nonfinite_steps"]:
    print(f"  {'nonfinite_steps':18s} {summary['nonfinite_steps']} "
          f"({summary['on_nonfinite']}, {summary['rollbacks']} rollbacks)")
  if config.train.timeline and not os.environ.get("MSCALE_COORDINATOR"):
    from mscale_jax.observability import trace   # under the driver, the driver merges
    merged = trace.merge(workdir)
    print(f"  {'timeline':18s} {merged['trace']} (heat-map {merged['heatmap']})")
  if _RECORD.value:
    from experiments import results
    path = results.write_record(f"train-{config.name}", summary,
                                extra={"config": config.to_dict()})
    print(f"[train] wrote {path}")


if __name__ == "__main__":
  app.run(main)
