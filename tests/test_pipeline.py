"""The pipeline executor (mscale_jax/parallel/pipeline.py) on 8 simulated CPU devices.

Every variant is compiled once (module-scoped cache) and checked against the unpipelined
model on the same parameters and batch: loss and every gradient. The compiled programs are
reused for the overlap structure test.
"""
import functools
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mscale_jax import mesh as mesh_lib
from mscale_jax.config import Config, ModelConfig, validate
from mscale_jax.errors import ConfigError
from mscale_jax.model import GPT
from mscale_jax.parallel import pipeline
from mscale_jax.parallel import pipeline_chunks
from mscale_jax.parallel import pipeline_plan as plan_lib
from mscale_jax.parallel import pipeline_pools as pools_lib
from mscale_jax.model import abstract_model
from mscale_jax.step import loss_fn
from mscale_jax.train import Trainer

BATCH, SEQ, VOCAB = 8, 16, 64


def _model_config(layers: int, block: str) -> ModelConfig:
  return ModelConfig(vocab_size=VOCAB, num_layers=layers, hidden=32, num_heads=4, mlp_dim=64,
                     seq_len=SEQ, block=block, attention_window=8)


@functools.cache
def _params(layers: int, block: str):
  with nnx.use_eager_sharding(False):
    model = GPT(_model_config(layers, block), rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  # Random (not zero-initialised) biases and norm offsets, so every gradient is exercised.
  keys = iter(jax.random.split(jax.random.key(1), 64))
  return jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), params)


def _batch():
  rng = np.random.default_rng(0)
  return {k: rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
          for k in ("inputs", "targets")}


@functools.cache
def _reference(layers: int, block: str):
  """Loss and gradients of the unpipelined model (natural layer order) on one device."""
  graphdef, _, _ = abstract_model(_model_config(layers, block))
  with jax.set_mesh(mesh_lib.make_mesh({"data": 1, "fsdp": 1, "stage": 1, "tensor": 1})):
    loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(
        _params(layers, block), graphdef, _batch())
  return float(loss), jax.tree.map(np.asarray, grads)


# (schedule, stages, virtual, microbatches, tensor, layers, block, overlap, recompute): every
# schedule with each recompute mode, both blocks, stage 1, 2 and 4, v 1 and 2 (4 layers: v=2
# needs stage <= 2), m = p and m > p, tensor=2 inside a stage for some, with and without the
# overlapped sends. Each is a compilation of ~10-40 s on 2 shared CPU cores, so not the whole
# cross product. The batch is 8 rows: m divides it.
VARIANTS = [
    ("1f1b", 2, 1, 4, 2, 4, "parallel", True, "none"),
    ("1f1b", 4, 1, 4, 2, 4, "sequential", False, "full"),
    ("1f1b", 4, 1, 8, 2, 4, "parallel", True, "none"),
    ("1f1b", 2, 1, 2, 1, 4, "sequential", False, "none"),
    ("gpipe", 2, 1, 2, 2, 4, "parallel", True, "full"),
    ("gpipe", 2, 1, 4, 2, 4, "sequential", False, "none"),
    ("interleaved_1f1b", 2, 2, 4, 2, 4, "sequential", True, "none"),
    ("interleaved_1f1b", 2, 2, 4, 2, 4, "parallel", False, "full"),
    ("zb_h1", 2, 1, 4, 2, 4, "parallel", False, "none"),
    ("zb_h1", 4, 1, 8, 2, 4, "sequential", True, "full"),
    ("zb_h1", 2, 1, 2, 2, 4, "sequential", True, "none"),
    # One stage: the one chunk embeds, runs every layer and computes the loss.
    ("1f1b", 1, 1, 2, 2, 4, "parallel", False, "none"),
    ("interleaved_1f1b", 1, 2, 2, 2, 4, "sequential", True, "full"),
    # Selective recomputation (attention's core redone in the backward).
    ("1f1b", 2, 1, 4, 2, 4, "sequential", True, "selective"),
    ("interleaved_1f1b", 2, 2, 4, 2, 4, "parallel", True, "selective"),
    ("zb_h1", 2, 1, 4, 2, 4, "parallel", True, "selective"),
]


@functools.cache
def _compiled(variant):
  """(compiled step, its arguments, the mesh) for one variant."""
  schedule, p, v, m, tensor, layers, block, overlap, recompute = variant
  mesh = mesh_lib.make_mesh({"data": 8 // (p * tensor), "fsdp": 1, "stage": p,
                             "tensor": tensor})
  graphdef, _, names = abstract_model(_model_config(layers, block))
  params = pipeline.reorder_layers(_params(layers, block), layers, (1, 1), (p, v))
  params = jax.device_put(params, mesh_lib.shardings_for(mesh, names))
  batch = jax.device_put(_batch(), mesh_lib.batch_sharding(mesh))
  step = jax.jit(functools.partial(pipeline.value_and_grad, graphdef=graphdef,
                                   schedule=schedule, stages=p, virtual=v, microbatches=m,
                                   overlap=overlap, recompute=recompute))
  with jax.set_mesh(mesh):
    compiled = step.lower(params, batch=batch).compile()
  return compiled, (params, batch), mesh


def _assert_equal_to_reference(loss, grads, layers, block):
  want_loss, want_grads = _reference(layers, block)
  assert float(loss) == pytest.approx(want_loss, rel=1e-6)
  flat_want = jax.tree_util.tree_leaves_with_path(want_grads)
  flat_got = dict(jax.tree_util.tree_leaves_with_path(grads))
  assert len(flat_want) == len(flat_got)
  for path, want in flat_want:
    got = flat_got[path]
    assert got.shape == want.shape
    scale = np.abs(want).max()
    assert scale > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))


# The fast tier runs the first variant (the overlap test below compiles it anyway).
@pytest.mark.parametrize("variant", VARIANTS[:1] + [pytest.param(v, marks=pytest.mark.slow)
                                                    for v in VARIANTS[1:]],
                         ids=lambda v: "-".join(map(str, v)))
def test_loss_and_every_gradient_equal_unpipelined(variant):
  schedule, p, v, m, tensor, layers, block, overlap, recompute = variant
  compiled, (params, batch), mesh = _compiled(variant)
  with jax.set_mesh(mesh):
    loss, grads = compiled(params, batch=batch)
  grads = pipeline.reorder_layers(jax.tree.map(np.asarray, grads), layers, (p, v), (1, 1))
  _assert_equal_to_reference(loss, grads, layers, block)


@pytest.mark.parametrize("pipeline_fields,match", [
    (dict(recompute="some"), r"pipeline.recompute='some'.*'none', 'selective', 'full'"),
    (dict(schedule="zb_h1", virtual_stages=2), r"pipeline.virtual_stages=2.*'zb_h1'"),
    (dict(schedule="zb", virtual_stages=1), r"pipeline.schedule='zb'.*zb_h1"),
])
def test_pipeline_fields_are_checked_before_compiling(pipeline_fields, match):
  config = Config().replace(mesh=dict(stage=2), model=dict(num_layers=4),
                            pipeline=pipeline_fields)
  with pytest.raises(ConfigError, match=match):
    validate(config, 8, platform="cpu")


def test_layer_order_is_megatrons_interleaving():
  # 8 layers, 2 stages, 2 chunks each: stage 0 holds chunks of layers [0,1] and [4,5].
  assert pipeline.layer_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  assert pipeline.layer_order(8, 4, 1).tolist() == list(range(8))
  tree = {"blocks": {"w": np.arange(8)}, "embed": np.arange(8)}
  moved = pipeline.reorder_layers(tree, 8, (1, 1), (2, 2))
  assert moved["blocks"]["w"].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  assert moved["embed"].tolist() == list(range(8))
  back = pipeline.reorder_layers(moved, 8, (2, 2), (4, 2))
  assert back["blocks"]["w"].tolist() == pipeline.layer_order(8, 4, 2).tolist()


def test_plan_slots_follow_the_schedule():
  """Stash slots are the table's peak in-flight count: 1F1B's stays at p whatever m (at most
  2p - 1 with overlap's latency, as the table places it), GPipe's is m; the pool of what only
  the last chunk stashes holds one (its backward follows its forward)."""
  for m in (4, 16):
    for overlap in (False, True):
      one_f_one_b = plan_lib.make_plan("1f1b", 4, 1, m, overlap=overlap)
      gpipe = plan_lib.make_plan("gpipe", 4, 1, m, overlap=overlap)
      table = one_f_one_b.table
      assert one_f_one_b.stash_slots[plan_lib.MAIN] == max(table.peak_inflight)
      assert one_f_one_b.stash_slots[plan_lib.MAIN] <= (2 * 4 - 1 if overlap else 4)
      assert one_f_one_b.stash_slots[plan_lib.LAST] == 1
      assert gpipe.stash_slots[plan_lib.MAIN] == m
    zb = plan_lib.make_plan("zb_h1", 4, 1, m, overlap=False)
    assert zb.split_backward and zb.stash_slots[plan_lib.MAIN] <= 4
    assert zb.cotangent_slots == max(zb.table.peak_awaiting_weight)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_no_weight_is_stashed(schedule, recompute):
  """A stashing backward reads the stage's weights in place: no stash pool array (nor, for
  zb_h1, any array B keeps for W: W computes the weight gradients) has the shape of a
  parameter (block weights stacked [L_c, ...], the shared ones), while the vjps' residuals
  do include the weights (dot(x, w)'s backward needs w). p=4 has a first, a middle and a
  last chunk (which reads every shared parameter)."""
  config = _model_config(4, "sequential")
  graphdef, _, _ = abstract_model(config)
  params = _params(4, "sequential")
  shared = {k: v for k, v in params.items() if k != pipeline.BLOCKS}
  cp = jax.tree.map(lambda a: a[:1], params[pipeline.BLOCKS])    # one chunk: L/p = 1 layer
  inputs = jnp.asarray(_batch()["inputs"][:3])   # 48 tokens: no activation shaped as a weight
  plan = plan_lib.make_plan(schedule, 4, 1, 4, overlap=False)
  found = {}

  def trace(shared, cp):   # traced: the executor builds these inside jit
    program = pipeline_chunks.Chunks(graphdef, shared, 4, recompute,
                                     example=(cp, inputs, inputs))
    found["pools"] = pools_lib.Pools(program, plan).arrays
    if plan.split_backward:   # what B keeps for W: activations and cotangents, no weight
      found["kept"] = {"kept": pools_lib.Kept({(op.first, op.last): program.kept_shapes(op)
                                               for op in plan.ops if op.kind == "B"}, 1).keys}
    for op in plan.ops:
      if op.kind == "F":
        _, vjp = program._vjp(op, cp, program.act, inputs)
        found[op] = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in jax.tree.leaves(vjp)]
    return 0
  with jax.set_mesh(mesh_lib.make_mesh({"data": 1, "fsdp": 1, "stage": 1, "tensor": 1})):
    jax.eval_shape(trace, shared, cp)
  weights = {(tuple(a.shape), jnp.dtype(a.dtype)) for a in jax.tree.leaves((params, cp))}
  stashed = [key[:2] for keys in found.pop("pools").values() for key in keys]
  assert stashed and not weights & set(stashed)
  kept = [key[:2] for keys in found.pop("kept", {}).values() for key in keys]
  assert (schedule == "zb_h1") == bool(kept) and not weights & set(kept)
  assert len(found) == 3 and all(weights & set(residuals) for residuals in found.values())


def _temp_bytes(schedule: str, microbatches: int, recompute: str) -> int:
  """XLA's compiled temp memory per device of a stage=2 step, 2 sequences per microbatch."""
  config = ModelConfig(vocab_size=VOCAB, num_layers=2, hidden=32, num_heads=4, mlp_dim=64,
                       seq_len=64)
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "stage": 2, "tensor": 1})
  graphdef, params, names = abstract_model(config)
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        params, mesh_lib.shardings_for(mesh, names))
  batch = {k: jax.ShapeDtypeStruct((2 * microbatches, 64), jnp.int32,
                                   sharding=mesh_lib.batch_sharding(mesh))
           for k in ("inputs", "targets")}
  step = jax.jit(functools.partial(pipeline.value_and_grad, graphdef=graphdef,
                                   schedule=schedule, stages=2, virtual=1,
                                   microbatches=microbatches, recompute=recompute))
  with jax.set_mesh(mesh):
    return step.lower(params, batch=batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_1f1b_temp_memory_grows_far_slower_with_microbatches_than_gpipe(recompute):
  """From XLA's compiled memory analysis (memory, not speed): going from 2 to 16 microbatches
  of a fixed size, GPipe stashes 14 more microbatches (chunk inputs, or with recompute='none'
  or 'selective' the backward's residuals, several times larger), 1F1B at most one more (overlap's
  warm-up). results/pipeline_bench-*.json records the same at a larger size."""
  growth = {schedule: _temp_bytes(schedule, 16, recompute) - _temp_bytes(schedule, 2, recompute)
            for schedule in ("gpipe", "1f1b")}
  slot = 2 * 64 * 32 * 4                      # one microbatch's chunk input, float32
  assert growth["gpipe"] >= 14 * slot * (1 if recompute == "full" else 2)
  assert growth["gpipe"] > 4 * growth["1f1b"]


# ----------------------------------------------------------------------------- PP overlap


def _computation(hlo: str, name: str) -> str:
  """The body of computation `name` in an HLO module's text ('' if absent)."""
  match = re.search(r"^%?" + re.escape(name) + r" .*?\{\n(.*?)\n\}", hlo, re.S | re.M)
  return match.group(1) if match else ""


def _while_bodies(hlo: str) -> list[str]:
  """The computations used as while-loop bodies in an HLO module's text."""
  return [body for name in set(re.findall(r"body=%?([\w.\-]+)", hlo))
          if (body := _computation(hlo, name))]


def _graph(body: str):
  """{instruction: (opcode, operand names, JAX op name)} of one HLO computation."""
  graph = {}
  for line in body.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)        # tuple types carry /*index=5*/ comments
    match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = [^=]*?\b([\w\-]+)\((.*)", line)
    if match:
      name, opcode, rest = match.groups()
      operands = rest.split("metadata=")[0]
      op_name = re.search(r'op_name="([^"]*)"', rest)
      graph[name] = (opcode, set(re.findall(r"%([\w.\-]+)", operands)),
                     op_name.group(1) if op_name else "")
  return graph


def _reaches(graph, start: str, targets: set) -> bool:
  seen, stack = set(), [start]
  while stack:
    node = stack.pop()
    if node in targets:
      return True
    if node in seen or node not in graph:
      continue
    seen.add(node)
    stack.extend(graph[node][1])
  return False


def _tick_structure(variant):
  """For the loop body that holds the pipeline's sends: for each of them, (depends on the
  tick's compute, tick's compute depends on it). A send is a conditional whose branch issues
  a jax.lax.ppermute (a tick where no stage receives sends nothing); the tick's compute is
  every other conditional: one per op (forward, backward, ...) that runs it or passes the
  buffers through, and the embedding's backward."""
  compiled, _, _ = _compiled(variant)
  hlo = compiled.as_text()
  permuting = {name for name in re.findall(r"branch_computations=\{([^}]*)\}", hlo)
               for name in re.findall(r"%?([\w.\-]+)", name)
               if any(op.startswith("collective-permute") and jax_op.endswith("/ppermute")
                      for op, _, jax_op in _graph(_computation(hlo, name)).values())}
  for body in _while_bodies(hlo):
    graph = _graph(body)
    branches = {n: re.findall(r"%?([\w.\-]+)", called) for n, called in
                re.findall(r"%?([\w.\-]+) = .*? conditional\(.*?branch_computations=\{([^}]*)\}",
                           body)}
    permutes = [n for n, called in branches.items() if permuting & set(called)]
    computes = {n for n in branches if n not in permutes}
    if permutes and computes:
      return [(any(_reaches(graph, p, {c}) for c in computes),
               any(_reaches(graph, c, {p}) for c in computes)) for p in permutes]
  raise AssertionError("no loop body with both the sends and the tick's compute")


def test_overlapped_sends_are_independent_of_the_ticks_compute():
  """MegaScale's PP overlap in the compiled program: the collective-permutes issued in a tick
  carry the previous tick's outputs, so they neither wait for this tick's forward/backward
  (the switch) nor feed it. On GPU this lets the async start/done pair run around the compute;
  XLA:CPU has no async collectives, so CPU shows the dependence structure only."""
  structure = _tick_structure(VARIANTS[0])          # 1f1b, overlap=True
  assert len(structure) == 2                        # forward ring and backward ring
  assert all(not waits and not feeds for waits, feeds in structure)


@pytest.mark.slow
def test_without_overlap_sends_wait_for_the_compute():
  """Negative control: without overlap each send carries this tick's own output."""
  structure = _tick_structure(VARIANTS[1])          # 1f1b, overlap=False
  assert len(structure) == 2
  assert all(waits and not feeds for waits, feeds in structure)


def _dus_and_copy_shapes(body: str) -> tuple[list, list]:
  """(output shapes of the dynamic-update-slices, of the copies) at the top level of one HLO
  computation (a fusion XLA named for a dynamic-update-slice counts; a copy inside a fusion
  is no copy)."""
  found = {"dus": [], "copy": []}
  for name, shape, opcode in re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+\[[\d,]*\])\S* ([\w\-]+)\(",
                                        body, re.M):
    if opcode == "dynamic-update-slice" or (opcode == "fusion" and "dynamic-update-slice" in name):
      found["dus"].append(shape)
    elif opcode == "copy":
      found["copy"].append(shape)
  return found["dus"], found["copy"]


@pytest.mark.parametrize("variant", [VARIANTS[8], VARIANTS[0]], ids=["zb_h1", "1f1b"])
def test_each_op_files_its_records_in_place(variant):
  """A tick writes only what its op made: the stash (and, for zb_h1, kept) slots are written
  inside the branch of the op that files there, so the tick loop's own dynamic-update-slices
  are the two receive-slot puts only (a switch over all ops returned a record from every
  branch, zeros where none, and wrote it into a slot after it on every tick); and no loop
  body or branch copies a slot array whole (XLA does where one op's cond reads a buffer that
  a later cond writes)."""
  hlo = _compiled(variant)[0].as_text()
  # The tick loop: its sends and its ops are conditionals (the sends' permutes sit in branches).
  (body,) = [b for b in _while_bodies(hlo) if len(re.findall(r" conditional\(", b)) >= 4]
  puts, _ = _dus_and_copy_shapes(body)
  assert len(puts) == 2 and len(set(puts)) == 1      # forward and backward messages
  branches = [c for names in re.findall(r" conditional\(.*?branch_computations=\{([^}]*)\}",
                                        body)
              for c in re.findall(r"%?([\w.\-]+)", names)]
  slot_arrays = {shape for name in branches for shape in _dus_and_copy_shapes(
      _computation(hlo, name))[0] if shape not in puts}
  assert len(slot_arrays) >= (8 if variant[0] == "zb_h1" else 4)
  copied = [shape for name in [*branches, None] for shape in
            _dus_and_copy_shapes(body if name is None else _computation(hlo, name))[1]]
  assert not slot_arrays & set(copied)


# ----------------------------------------------------------------------------- the trainer


def _curve(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """20 steps of data=2, tensor=4 (no pipeline) and of data=2, stage=2, tensor=2 (interleaved
  1F1B, 2 chunks per stage), both checkpointing at step 10."""
  def base(**sections):   # conftest's tiny_config, at module scope
    return Config(name="test").replace(
        model=dict(num_layers=2, hidden=32, num_heads=4, mlp_dim=64, seq_len=32,
                   attention_window=8),
        optimizer=dict(warmup_steps=2), data=dict(kind="stdlib", prefetch=0),
        train=dict(eval_batches=1)).replace(**sections)
  root = tmp_path_factory.mktemp("pipeline_runs")
  common = dict(model=dict(num_layers=4),
                train=dict(steps=20, global_batch=8, log_every=1, eval_every=20,
                           checkpoint_every=10, async_checkpoint=False))
  configs = {
      "flat": base(mesh=dict(data=2, tensor=4), **common),
      "pipelined": base(mesh=dict(data=2, stage=2, tensor=2),
                        pipeline=dict(schedule="interleaved_1f1b", virtual_stages=2,
                                      microbatches=4), **common),
  }
  for name, config in configs.items():
    Trainer(config, root / name, show_progress=False).train()
  return root, configs


@pytest.mark.slow
def test_pipelined_loss_curve_matches_unpipelined(runs):
  root, _ = runs
  flat, pipelined = _curve(root / "flat"), _curve(root / "pipelined")
  assert sorted(flat) == sorted(pipelined) == list(range(1, 21))
  for step in flat:
    assert pipelined[step] == pytest.approx(flat[step], rel=2e-4), step
  assert flat[20] < flat[1] - 0.1          # it learns: not a flat, trivially equal curve


@pytest.mark.slow
@pytest.mark.parametrize("source,target", [("pipelined", "flat"), ("flat", "1f1b")])
def test_checkpoint_restores_across_pipeline_layouts(runs, source, target):
  """Step 10 of one layout continues in another (stage 2 -> 1 with v 2 -> 1, and stage 1 ->
  2) on the same loss curve as the uninterrupted unpipelined run."""
  root, configs = runs
  workdir = root / f"{source}-to-{target}"
  shutil.copytree(root / source, workdir)
  shutil.rmtree(workdir / "checkpoints" / "20")
  os.remove(workdir / "metrics.jsonl")
  config = configs[target] if target in configs else configs["pipelined"].replace(
      pipeline=dict(schedule="1f1b", virtual_stages=1, microbatches=2))
  summary = Trainer(config, workdir, show_progress=False).train()
  assert summary["start_step"] == 10
  resumed, flat = _curve(workdir), _curve(root / "flat")
  assert sorted(resumed) == list(range(11, 21))
  for step in resumed:
    assert resumed[step] == pytest.approx(flat[step], rel=2e-4), step
