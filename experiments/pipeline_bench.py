r"""Pipeline step vs the unpipelined step: compiled temp memory and FLOPs per step, per schedule
and recompute choice.

  python -m experiments.pipeline_bench            # 8 simulated CPU devices; writes results/
  python -m experiments.pipeline_bench --microbatches=4,8 --schedules=1f1b --recompute=none

For m microbatches of 2 sequences each (the batch grows with m, as it does when a run adds
microbatches to fill the pipeline), each schedule (stage=4, tensor=2, 8 layers; interleaved
with 2 chunks per stage) and each `pipeline.recompute`, and the unpipelined step (stage=1,
tensor=2) on the same batch:
  temp_bytes   XLA's compiled memory analysis (temp buffers per device): activations, stash,
               cotangent and receive slots; with recompute='none' the stash holds each chunk's
               backward residuals, so 1F1B's must stay flat in m and GPipe's grow with it;
  flops        per device per step. XLA's cost analysis counts a while-loop body once and a
               conditional as its costliest branch, so the pipelined step's FLOPs are summed
               from the table instead: for every action a stage runs, XLA's cost of that
               action compiled alone (the executor's own code for it: `pipeline_chunks.Chunks`);
               the unpipelined step is costed whole with its layers unrolled. The check is
               two-sided: the overhead over stage=1 must be what the recompute choice
               accounts for (none: 0; selective: attention's QK^T and PV again,
               4 s^2 d FLOPs per layer and sequence; full: one more forward of every chunk
               but the last)
               within 2% of stage=1's FLOPs, neither more nor less;
  step_s       wall time per step (median of --steps after a warm-up). On CPU this shows
               overhead only: the 8 "devices" share this host's cores.
"""
import functools
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

from experiments import results  # noqa: E402


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  global _MICROBATCHES, _SCHEDULES, _RECOMPUTE, _STEPS, _OUT_DIR
  _MICROBATCHES = flags.DEFINE_list("microbatches", ["4", "8", "16"], "Values of m.")
  _SCHEDULES = flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"],
                                 "Schedules to measure.")
  _RECOMPUTE = flags.DEFINE_list("recompute", ["none", "selective", "full"],
                                 "pipeline.recompute values.")
  _STEPS = flags.DEFINE_integer("steps", 2, "Timed steps per configuration (0: no timing).")
  _OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the record (default results/).")


STAGES, TENSOR, LAYERS, MICRO = 4, 2, 8, 2   # MICRO: sequences per microbatch
SEQ, HIDDEN, VOCAB = 128, 64, 256   # activations large next to the parameters
TOLERANCE = 0.02                    # of stage=1's FLOPs, either way


def _model_config(scan_layers=True):
  from mscale_jax.config import ModelConfig
  return ModelConfig(vocab_size=VOCAB, num_layers=LAYERS, hidden=HIDDEN, num_heads=4,
                     mlp_dim=4 * HIDDEN, seq_len=SEQ, scan_layers=scan_layers)


def _time(fn, *args):
  import jax
  if not _STEPS.value:
    return None
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _setup(stages, batch_size, scan_layers=True):
  import numpy as np
  from flax import nnx
  from mscale_jax import mesh as mesh_lib
  from mscale_jax.model import GPT, abstract_model
  config = _model_config(scan_layers)
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "stage": stages, "tensor": TENSOR})
  graphdef, _, names = abstract_model(config)
  with nnx.use_eager_sharding(False):
    params = nnx.to_pure_dict(nnx.state(GPT(config, rngs=nnx.Rngs(0)), nnx.Param))
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(0, VOCAB, (batch_size, SEQ)).astype(np.int32)
           for k in ("inputs", "targets")}
  return mesh, graphdef, params, names, batch


def unpipelined(microbatches):
  """Compiled temp bytes, FLOPs (layers unrolled) and step time of the stage=1 step, and its
  FLOPs with every layer's forward recomputed in the backward (model.remat='full') and with
  attention's core recomputed (model.remat='dots')."""
  import dataclasses
  import jax
  from mscale_jax import mesh as mesh_lib
  from mscale_jax.model import abstract_model
  from mscale_jax.step import loss_fn
  mesh, graphdef, params, names, batch = _setup(1, microbatches * MICRO, scan_layers=False)
  remat_graphdef, _, _ = abstract_model(dataclasses.replace(_model_config(False), remat="full"))
  dots_graphdef, _, _ = abstract_model(dataclasses.replace(_model_config(False), remat="dots"))
  with jax.set_mesh(mesh):
    params = jax.device_put(params, mesh_lib.shardings_for(mesh, names))
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    step = jax.jit(lambda p, b: jax.value_and_grad(loss_fn)(p, graphdef, b))
    compiled = step.lower(params, batch).compile()
    remat = jax.jit(lambda p, b: jax.value_and_grad(loss_fn)(p, remat_graphdef, b))
    dots = jax.jit(lambda p, b: jax.value_and_grad(loss_fn)(p, dots_graphdef, b))
    return {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "flops_per_device": compiled.cost_analysis()["flops"],
            "flops_per_device_remat": remat.lower(params, batch).compile().cost_analysis()[
                "flops"],
            "flops_per_device_remat_dots": dots.lower(params, batch).compile().cost_analysis()[
                "flops"],
            "step_s": _time(compiled, params, batch)}


@functools.lru_cache(maxsize=None)
def op_flops(op, recompute, split, microbatches):
  """XLA's FLOPs per device of `op` on one layer (a chunk's scan body), compiled alone on a
  tensor=2 mesh from the executor's own chunk code for one microbatch; `split`: the backward
  is split into B and W (zb_h1). What an op reads of another op's work (the stash of its F,
  what its B kept for W) arrives laid out as that op's compiled program leaves it, as in the
  executor: fed unsharded kept values, a W would compute the unembedding's weight gradient
  whole instead of its tensor half."""
  import jax
  import jax.numpy as jnp
  from mscale_jax.parallel import pipeline, pipeline_chunks
  mesh, graphdef, params, _, batch = _setup(1, MICRO)
  layer = jax.tree.map(lambda a: a[:1], params[pipeline.BLOCKS])
  shared = {k: a for k, a in params.items() if k != pipeline.BLOCKS}
  tokens, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
  x = jnp.zeros((MICRO, SEQ, HIDDEN), jnp.float32)   # one microbatch's activations
  g = jnp.ones((), jnp.float32) if op.last else x

  def chunks(shared):
    return pipeline_chunks.Chunks(graphdef, shared, microbatches, recompute,
                                   example=(layer, tokens, targets))

  def action(shared, cp, x, tokens, tgt, leaves, kept, op):
    if op.kind == "F":
      return chunks(shared).forward(op, cp, x, tgt)
    if split and not op.first:    # the executor's B and W
      if op.kind == "B":
        return chunks(shared).backward_input(op, cp, leaves, tgt, g)
      return chunks(shared).backward_weights(op, kept, cp, leaves, tgt)
    vjp, value = chunks(shared).vjp(op, cp, leaves, tokens, tgt)
    return value, vjp(g)

  def compiled(op, leaves=(), kept=()):
    fn = jax.jit(functools.partial(action, op=op))
    return fn.lower(shared, layer, x, tokens, targets, list(leaves), list(kept)).compile()

  def outputs(program, k):   # zeros laid out as `program`'s k-th output (a list) is
    return [jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding)
            for s in jax.tree.leaves(program.out_info[k])]

  with jax.set_mesh(mesh):
    leaves, kept = [], []
    if op.kind != "F":   # an F reads no stash
      leaves = outputs(compiled(op._replace(kind="F")), 1)
    if op.kind == "W" and not op.first:
      kept = outputs(compiled(op._replace(kind="B"), leaves), 2)
    return compiled(op, leaves, kept).cost_analysis().get("flops", 0.0)


def action_flops(plan, recompute):
  """{Op: XLA's FLOPs per device} of each op of `plan` (`op_flops`). XLA's cost analysis
  counts a while body once, so a chunk's layer scan is costed with one layer, and the
  L / (p * v) - 1 others at the cost of a middle chunk's one layer (under a split backward
  the first chunk's W at a middle chunk's B and W: it runs the whole backward)."""
  from mscale_jax.parallel.pipeline_plan import IDLE
  p, v, m = plan.table.stages, plan.table.virtual, plan.table.microbatches
  cost = functools.partial(op_flops, recompute=recompute, split=plan.split_backward,
                           microbatches=m)
  out, per_chunk = {}, LAYERS // (p * v)
  for op in plan.ops:
    if op == IDLE:
      continue
    if plan.split_backward and op.kind == "B" and op.first:
      out[op] = 0.0         # files the cotangent for its W, computes nothing
    else:
      middle = op._replace(first=False, last=False)
      rest = cost(middle)
      if plan.split_backward and op.kind == "W" and op.first:
        rest += cost(middle._replace(kind="B"))   # its W runs the whole backward
      out[op] = cost(op) + (per_chunk - 1) * rest
  return out


@functools.lru_cache(maxsize=None)
def _action_flops_cached(schedule, virtual, recompute):
  """`action_flops` of the schedule's ops, which do not depend on m (the smallest m with every
  op kind: 2 * stages microbatches)."""
  from mscale_jax.parallel import pipeline_plan
  return action_flops(pipeline_plan.make_plan(schedule, STAGES, virtual, 2 * STAGES),
                      recompute)


def pipelined(schedule, microbatches, recompute):
  """Temp bytes, table-summed FLOPs per device and step time of one pipelined step."""
  import jax
  from mscale_jax import mesh as mesh_lib
  from mscale_jax.parallel import pipeline, pipeline_plan
  virtual = 2 if schedule == "interleaved_1f1b" else 1
  mesh, graphdef, params, names, batch = _setup(STAGES, microbatches * MICRO)
  params = pipeline.reorder_layers(params, LAYERS, (1, 1), (STAGES, virtual))
  with jax.set_mesh(mesh):
    params = jax.device_put(params, mesh_lib.shardings_for(mesh, names))
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    step = jax.jit(lambda p, b: pipeline.value_and_grad(
        p, graphdef, b, schedule=schedule, stages=STAGES, virtual=virtual,
        microbatches=microbatches, recompute=recompute))
    compiled = step.lower(params, batch).compile()
    step_s = _time(compiled, params, batch)
  plan = pipeline_plan.make_plan(schedule, STAGES, virtual, microbatches)
  costs = _action_flops_cached(schedule, virtual, recompute)
  ops = plan.fields["op"]
  per_stage = [sum(costs[plan.ops[k]] for k in ops[:, s] if k) for s in range(STAGES)]
  return {"virtual": virtual, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
          "flops_per_device_by_stage": per_stage, "flops_all_stages": sum(per_stage),
          "action_flops": {"-".join(map(str, op)): f for op, f in costs.items()},
          "ticks": plan.table.ticks, "bubble_fraction": plan.table.bubble_fraction,
          "stash_slots": plan.stash_slots, "receive_slots": plan.inbox_slots,
          "cotangent_slots": plan.cotangent_slots if plan.split_backward else 0,
          "step_s": step_s}, costs


def expected_overhead(row, base):
  """What the table should cost over stage=1, as a fraction of stage=1's FLOPs, from
  references the executor does not shape: recompute='none' runs no forward twice (0);
  'selective' redoes attention's core: QK^T and PV once more per layer and sequence,
  2 * s^2 * d FLOPs each (counted from the model's shape; stage=1 with model.remat='dots',
  the same policy, costs only +0.8% in XLA's analysis, which we could not explain, so it is
  recorded, not used);
  'full' recomputes the forward of every chunk but the last (whose forward runs in its
  backward only): stage=1 with every layer rematerialised, less the last chunk's share. A
  split backward (zb_h1) adds nothing: W computes only the weight gradients, from what B
  kept (`parallel/backward_split.py`)."""
  flat, chunks, m = base["flops_per_device"], STAGES * row["virtual"], row["microbatches"]
  extra = 0.0
  if row["recompute"] == "full":
    extra = (base["flops_per_device_remat"] - flat) * (chunks - 1) / chunks
  if row["recompute"] == "selective":   # attention's core again: QK^T and PV, 2*b*s^2*d each
    extra = LAYERS * 2 * 2 * m * MICRO * SEQ**2 * HIDDEN / TENSOR
  return extra / flat


def main(argv):
  del argv
  import jax
  rows, bases = [], {}
  for m in map(int, _MICROBATCHES.value):
    base = bases[m] = unpipelined(m)
    print(f"[pipeline_bench] stage=1, batch {m * MICRO}: temp "
          f"{base['temp_bytes'] / 2**20:.2f} MiB, {base['flops_per_device'] / 1e9:.3f} "
          f"GFLOP/device", flush=True)
    for schedule in _SCHEDULES.value:
      for recompute in _RECOMPUTE.value:
        row = {"schedule": schedule, "microbatches": m, "recompute": recompute}
        figures, costs = pipelined(schedule, m, recompute)
        row.update(figures)
        # stage=1 runs the same batch on TENSOR devices; the pipeline on STAGES * TENSOR.
        flat = base["flops_per_device"]
        row["flops_overhead"] = row["flops_all_stages"] / flat - 1
        row["expected_overhead"] = expected_overhead(row, base)
        row["flops_check"] = abs(row["flops_overhead"] - row["expected_overhead"]) <= TOLERANCE
        rows.append(row)
        print(f"[pipeline_bench] {schedule:>16} m={m:>2} recompute={recompute:<4}: temp "
              f"{row['temp_bytes'] / 2**20:6.2f} MiB, stash {row['stash_slots']}, FLOPs "
              f"overhead {100 * row['flops_overhead']:5.1f}% over stage=1 (expected "
              f"{100 * row['expected_overhead']:.1f}% +- {100 * TOLERANCE:.0f}: "
              f"{'ok' if row['flops_check'] else 'FAIL'}), bubble "
              f"{row['bubble_fraction']:.3f}", flush=True)
  path = results.write_record("pipeline_bench", {"unpipelined_by_m": bases, "pipelined": rows},
                              out_dir=_OUT_DIR.value, extra={
      "setup": f"{LAYERS} layers, hidden {HIDDEN}, seq {SEQ}, vocab {VOCAB}, batch {MICRO} * m;"
               f" pipelined: stage={STAGES}, tensor={TENSOR}; unpipelined: stage=1, "
               f"tensor={TENSOR}",
      "flops_check": all(r["flops_check"] for r in rows),
      "flops_note": "pipelined FLOPs are summed over the table's actions from XLA's cost of "
                    "each action compiled alone with the executor's chunk code (XLA's cost "
                    "analysis counts a while body once); overhead = all stages' FLOPs / "
                    "unpipelined FLOPs per tensor group - 1, checked two-sided against "
                    "expected_overhead (none: 0; selective: attention's QK^T and PV again, "
                    "4 s^2 d per layer and sequence; full: one more forward of every chunk but the"
                    " last; zb_h1: the same as 1F1B, its W only the weight gradients). Idle "
                    "ticks compute nothing: the bubble costs time, not FLOPs.",
      "wall_time_note": f"{jax.devices()[0].platform}: on CPU the simulated devices share the "
                        f"host's cores; times show overhead, not pipeline speed-up."})
  print(f"[pipeline_bench] wrote {path}")
  if not all(r["flops_check"] for r in rows):
    raise SystemExit("[pipeline_bench] FLOPs check failed (see flops_overhead vs expected)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
