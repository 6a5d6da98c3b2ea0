"""The pipeline executor: runs a schedule table (`parallel/schedule.py`) over the 'stage' axis.

SPMD: every stage runs the same program inside `jax.shard_map`, manual over 'stage' only (data,
fsdp and tensor stay automatic, so the tensor-parallel region works inside a stage as it does
without a pipeline). A `lax.scan` walks the ticks; at each tick a stage reads its row of the
plan (`pipeline_plan.py`, indexed by `axis_index('stage')`) and runs the branch of its
action, one per (kind, first chunk?, last chunk?) the table uses:
  idle      nothing;
  F         its chunk of layers on a microbatch; the model's first chunk embeds the tokens
            first, its last ends in the loss head. With recompute='none' or 'selective'
            it runs under `jax.vjp` and stashes the vjp's activation residuals (a pytree
            of arrays: each layer's input and matmul outputs, but attention's matmuls'
            with 'selective', as each layer is checkpointed with a policy,
            `pipeline_chunks.STASH_POLICIES`; weights are read in place, never stashed);
            with 'full' it stashes the chunk input only (and the last chunk defers
            everything to its B);
  B         the chunk's vjp applied to the output cotangent (the received message, or 1 for
            the loss): from the stashed residuals, or by running the forward again from the
            stashed input ('full'); weight gradients accumulated, the input cotangent sent
            back. With a split backward (zb_h1, `backward_split`) B computes the input
            cotangent only and files what its W reads of that work (each weight matmul's
            output cotangent; a matmul's input where W cannot derive it again cheaply from
            the stash) in kept slots (`pipeline_pools.Kept`) for
  W         the weight gradients of that (microbatch, chunk), its weight matmuls only, from
            those and the same stash (the model's first chunk: its whole backward).
The loss head runs on the last chunk's ticks only and the embedding lookup on the first
chunk's forward ticks only; the embedding's backward (a scatter-add into the table gradient)
runs outside the branches, on every stage at the ticks where the first chunk's backward runs
(zeros on the other stages): inside it, XLA:CPU partitions that scatter-add with collectives
over all devices, which deadlock when stages take different branches. Forward outputs travel
a ring `ppermute` to stage s+1 (stage p-1 -> 0 is interleaving's wrap-around), input
cotangents one to stage s-1, at the ticks where some stage receives one. Messages wait in
receive slots and stashes in stash slots, assigned from the table's lifetimes, so memory
follows the schedule: 1F1B stashes ~p microbatches where GPipe stashes m * v. `loss` runs
the forwards alone (evaluation).

A tick's fixed cost is kept small (on CPU it is paid every tick): each op's branch runs
under a `lax.cond` of its own whose other branch passes the buffers through, and files its
record into its slots and adds its gradients into the sums itself, so XLA updates the buffers
in place and a tick writes only what its op made (a `lax.switch` over all ops would have to
return a record and gradients from every branch: zeros where the op made none, then written
or added into the buffers on every tick). A collective outside the branches (a send, the
embedding's backward) runs only at the ticks that need it, under a condition the same on
every stage (`Plan.every_stage`).

PP overlap (MegaScale section 3.2): with `overlap=True` the executor runs the table with one
tick of latency. Tick t's outputs are carried to tick t+1, which issues their ppermutes
alongside its own compute and files the results into receive slots for tick t+2; nothing tick
t+1 computes reads them, so on GPU the async collective-permute overlaps with the compute.
With `overlap=False` each tick's outputs are sent at its end and usable at the next tick.

Parameters: the stacked layer axis of every block parameter is in pipeline order (see
`layer_order`) and sharded over 'stage', so each stage holds its v chunks of L/(p*v) layers
as one local [v * L/(p*v), ...] block. Other parameters are replicated over 'stage'; their
gradients (embedding on the first stage, head on the last) are summed over 'stage' at the end.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mscale_jax.mesh import RESIDUAL, constrain
from mscale_jax.parallel import pipeline_chunks as chunks_lib
from mscale_jax.parallel import pipeline_plan as plan_lib
from mscale_jax.parallel import pipeline_pools as pools_lib
from mscale_jax.parallel import schedule as schedule_lib

AXIS = "stage"
BLOCKS = chunks_lib.BLOCKS


def layer_order(num_layers: int, stages: int, virtual: int) -> np.ndarray:
  """Natural layer index held at each position of the pipeline-ordered layer axis.

  Position (s * v + c) * L_c + l (stage s's chunk c, its l-th layer) holds Megatron's layer
  (c * p + s) * L_c + l; with v = 1 this is the identity, so stage s holds layers
  s * L/p ... (s+1) * L/p - 1 in order.
  """
  per_chunk = num_layers // (stages * virtual)
  order = np.arange(num_layers).reshape(virtual, stages, per_chunk)
  return order.transpose(1, 0, 2).reshape(-1)


def reorder_layers(tree, num_layers: int, source: tuple[int, int], target: tuple[int, int]):
  """Moves every leaf under a 'blocks' key from `source` (stages, virtual) layer order to
  `target`'s (params, or optimizer states that mirror them); other leaves pass through."""
  to_natural = np.argsort(layer_order(num_layers, *source))
  index = to_natural[layer_order(num_layers, *target)]
  if np.array_equal(index, np.arange(num_layers)):
    return tree

  def move(path, leaf):
    under_blocks = any(getattr(k, "key", None) == BLOCKS for k in path)
    return jnp.take(leaf, index, axis=0) if under_blocks and leaf.ndim else leaf
  return jax.tree_util.tree_map_with_path(move, tree)


RECOMPUTE = ("full", "selective", "none")


def value_and_grad(params, graphdef, batch, *, schedule: str, stages: int, virtual: int,
                   microbatches: int, overlap: bool = True, recompute: str = "full"):
  """Loss and gradients of one pipelined step; equal to `jax.value_and_grad` of the mean
  next-token loss on the unpipelined model (with params in `layer_order`).

  Args:
    params: pure-dict model parameters; block leaves [L, ...] in pipeline layer order, their
      layer axis sharded over 'stage'.
    graphdef: the model's NNX graphdef.
    batch: {'inputs', 'targets'}: int32 [batch, seq], batch over (data, fsdp). Microbatch i
      is rows i, i + m, i + 2m, ...: each data shard splits its own rows.
    recompute: 'full' stashes chunk inputs and runs each forward again in its backward;
      'none' stashes the backward's residuals (activations: each layer's input and every
      matmul output), so no matmul runs twice; 'selective' stashes them but attention's
      core, which the backward recomputes (`pipeline_chunks.STASH_POLICIES`).
  Returns:
    (loss, grads), grads laid out like params. Call under `jax.set_mesh(mesh)` inside jit.
  """
  if recompute not in RECOMPUTE:
    raise ValueError(f"recompute={recompute!r}: one of {', '.join(RECOMPUTE)}")
  overlap = overlap and stages > 1      # one stage sends nothing between devices
  plan = plan_lib.make_plan(schedule, stages, virtual, microbatches, overlap)
  loss, block_grads, shared_grads = _run(params, graphdef, batch, plan, overlap, recompute)
  return loss, {**shared_grads, BLOCKS: block_grads}


def loss(params, graphdef, batch, *, schedule: str, stages: int, virtual: int,
         microbatches: int, overlap: bool = True):
  """The mean next-token loss of `batch` through the pipeline, forwards only (evaluation):
  each stage runs the forwards of `schedule`'s table with its own layers, so no stage ever
  holds another's. Arguments as `value_and_grad`'s."""
  overlap = overlap and stages > 1
  plan = plan_lib.make_plan(schedule, stages, virtual, microbatches, overlap, forward=True)
  return _run(params, graphdef, batch, plan, overlap, recompute=None)


def _run(params, graphdef, batch, plan, overlap, recompute):
  """`_per_stage` under shard_map, manual over 'stage' only. recompute=None: forwards only,
  returns the loss alone."""
  shared = {k: v for k, v in params.items() if k != BLOCKS}
  spec = lambda tree, s: jax.tree.map(lambda _: s, tree)
  in_specs = (spec(params[BLOCKS], P(AXIS)), spec(shared, P()), spec(batch, P()))
  out_specs = P()
  if recompute is not None:
    out_specs = (P(), spec(params[BLOCKS], P(AXIS)), spec(shared, P()))
  run = jax.shard_map(functools.partial(_per_stage, graphdef=graphdef, plan=plan,
                                        overlap=overlap, recompute=recompute),
                      in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                      check_vma=False)
  return run(params[BLOCKS], shared, batch)


def _per_stage(blocks, shared, batch, *, graphdef, plan: plan_lib.Plan, overlap: bool,
               recompute: str):
  """One stage's program: the scan over ticks. `blocks` is this stage's [v * L_c, ...]."""
  table = plan.table
  p, v, m = table.stages, table.virtual, table.microbatches
  stage = jax.lax.axis_index(AXIS)
  chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), blocks)
  inputs, targets = _split(batch["inputs"], m), _split(batch["targets"], m)
  program = chunks_lib.Chunks(graphdef, shared, m, recompute,
                    example=(jax.tree.map(lambda a: a[0], chunks), inputs[0], targets[0]))
  act = program.act
  pools = pools_lib.Pools(program, plan)
  if plan.split_backward:
    kept = pools_lib.Kept({(op.first, op.last): program.kept_shapes(op) for op in plan.ops
                           if op.kind == schedule_lib.BACKWARD}, plan.cotangent_slots)

  # An op's branch takes the buffers it may write ("m": slots it files into, sums it adds
  # to, its outputs) and the tick's inputs ("t"), and returns the buffers, updated in place.
  def accumulate(m, t, d_cp, d_sp):
    grads = jax.tree.map(lambda a, b: a.at[t["c"]].add(b), m["grad_chunks"], d_cp)
    shared = {**m["grad_shared"], **jax.tree.map(jnp.add, {k: m["grad_shared"][k] for k in d_sp},
                                                 d_sp)}
    return {**m, "grad_chunks": grads, "grad_shared": shared}

  def add_loss(m, value):
    return {**m, "loss": m["loss"] + value}

  def forward(op, m, t):
    x = program.embed(t["tokens"]) if op.first else t["x_in"]
    if recompute is None:   # evaluation
      out = program.apply(op, t["cp"], x, t["tgt"])
      return add_loss(m, out) if op.last else {**m, "out_f": out}
    out, leaves = program.forward(op, t["cp"], x, t["tgt"])
    m = {**m, "pools": pools.file(m["pools"], op, leaves, t["stash_slots"])}
    if op.last:
      return m if recompute == "full" else add_loss(m, out)
    return {**m, "out_f": out}

  def backward_of(op, m, t):
    """The chunk's vjp, from its stash (and, with recompute, the loss it recomputed)."""
    leaves = pools.load(m["pools"], op, t["stash_slots"])
    return program.vjp(op, t["cp"], leaves, t["tokens"], t["tgt"])

  def seed(op, t):   # the output cotangent: 1 for the loss, else the received message
    return jnp.ones((), jnp.float32) if op.last else t["g_in"]

  def backward(op, m, t):
    g = seed(op, t)
    if plan.split_backward:   # B: the input cotangent; W gets what it needs of B's work
      if op.first:    # nothing to send; its W runs the whole backward, into the embedding
        return {**m, "cot": kept.file(m["cot"], op, [g], t["cot_slot"])}
      leaves = pools.load(m["pools"], op, t["stash_slots"])
      d_x, value, saved = program.backward_input(op, t["cp"], leaves, t["tgt"], g)
      m = add_loss(m, value)
      return {**m, "cot": kept.file(m["cot"], op, saved, t["cot_slot"]), "out_b": d_x}
    vjp, value = backward_of(op, m, t)
    m = m if value is None else add_loss(m, value)
    d_cp, d_sp, d_x = vjp(g)
    return {**accumulate(m, t, d_cp, d_sp), "out_b": d_x}

  def weight(op, m, t):
    saved = kept.load(m["cot"], op, t["cot_slot"])
    if op.first:
      vjp, _ = backward_of(op, m, t)
      d_cp, d_sp, d_x = vjp(saved[0])
      return {**accumulate(m, t, d_cp, d_sp), "out_b": d_x}
    leaves = pools.load(m["pools"], op, t["stash_slots"])
    return accumulate(m, t, *program.backward_weights(op, saved, t["cp"], leaves, t["tgt"]))

  kinds = {schedule_lib.FORWARD: forward, schedule_lib.BACKWARD: backward,
           schedule_lib.WEIGHT: weight}
  mutable = ("loss", "pools", "cot", "grad_chunks", "grad_shared")
  # The ops' conds in this order: forwards (they write the stash), B (reads it, writes kept),
  # W (reads both). XLA copies a buffer whole where one cond reads it and a later one writes.
  order = sorted((k for k, op in enumerate(plan.ops) if op != plan_lib.IDLE),
                 key=lambda k: list(kinds).index(plan.ops[k].kind))
  embeds_back = jnp.asarray([op.first and op.kind == table.release_kind for op in plan.ops])
  ring_f, ring_b = _ring(p, +1, wrap=v > 1), _ring(p, -1, wrap=v > 1)

  def tick(carry, rows):
    row, every = rows
    f = {k: a[stage] for k, a in row.items()}
    c, i = jnp.maximum(f["chunk"], 0), jnp.maximum(f["microbatch"], 0)
    slot = lambda name: jnp.maximum(f[name], 0)
    t = {"c": c, "cp": jax.tree.map(lambda a: a[c], chunks), "tokens": inputs[i],
         "tgt": targets[i], "x_in": carry["inbox"][slot("x_slot")],
         "g_in": carry["inbox"][slot("g_slot")],
         "stash_slots": {plan_lib.MAIN: slot("stash_slot"), plan_lib.LAST: slot("last_slot")},
         "cot_slot": slot("cot_slot")}
    state = {k: carry[k] for k in mutable if k in carry} | {"out_f": act, "out_b": act}
    for k in order:   # the stage's op of this tick (none on an idle tick)
      op = plan.ops[k]
      state = jax.lax.cond(f["op"] == k, functools.partial(kinds[op.kind], op),
                           lambda state, t: state, state, t)
    out_f, out_b = state.pop("out_f"), state.pop("out_b")
    if recompute is not None and program.replicated:
      # The embedding's backward, outside the branches (see `pipeline_chunks.Chunks`), at
      # ticks where a stage runs the first chunk's backward, on every stage: fed that chunk's
      # input cotangent there, zeros elsewhere. (Kept per microbatch and run once after the
      # ticks instead, its buffer would grow with m and undo 1F1B's bounded memory.)
      def embed_backward(grads):
        _, embed_vjp = jax.vjp(lambda tables: program.embed(t["tokens"], tables),
                               {k: shared[k] for k in program.replicated})
        cot = jnp.where(embeds_back[f["op"]], out_b, 0).astype(out_b.dtype)
        (d_tables,) = embed_vjp(cot)
        return {k: grads[k] + g for k, g in d_tables.items()}
      tables = {k: state["grad_shared"][k] for k in program.replicated}
      tables = jax.lax.cond(every["embed_back"], embed_backward, lambda g: g, tables)
      state["grad_shared"] = {**state["grad_shared"], **tables}
    if overlap:   # send the previous tick's outputs while this tick computed
      send_f, send_b = carry["out_f"], carry["out_b"]
    else:
      send_f, send_b = out_f, out_b
    inbox = carry["inbox"]
    if ring_f:   # a tick where no stage receives files zeros into every stage's spare slot
      inbox = pools_lib.put(inbox, _permute(send_f, ring_f, every["send_f"]), f["recv_f"])
      inbox = pools_lib.put(inbox, _permute(send_b, ring_b, every["send_b"]), f["recv_b"])
    carry = {**state, "inbox": inbox}
    if overlap:
      carry.update(out_f=out_f, out_b=out_b)
    return carry, None

  carry = {"inbox": _slots(plan.inbox_slots + 1, act), "loss": jnp.zeros((), jnp.float32)}
  if recompute is not None:
    carry.update(pools=pools.zeros(), grad_chunks=jax.tree.map(jnp.zeros_like, chunks),
                 grad_shared=jax.tree.map(jnp.zeros_like, shared))
  if plan.split_backward:
    carry.update(cot=kept.zeros())
  if overlap:
    carry.update(out_f=act, out_b=act)
  rows = {k: jnp.asarray(a) for k, a in plan.fields.items()}
  carry, _ = jax.lax.scan(tick, carry, (rows, jax.tree.map(jnp.asarray, plan.every_stage)))
  if recompute is None:
    return _sum_stages(carry["loss"], p)
  grad_blocks = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), carry["grad_chunks"])
  loss = _sum_stages(carry["loss"], p)
  grad_shared = _sum_stages(carry["grad_shared"], p)
  return loss, grad_blocks, grad_shared


# With one stage a collective over 'stage' is the identity; XLA's partitioner refuses some
# over an axis of size 1 ("Cross-partition allreduce must be in manual partitioning mode").
def _sum_stages(tree, stages: int):
  return tree if stages == 1 else jax.lax.psum(tree, AXIS)


def _permute(x, pairs, active):
  """`x` sent along `pairs` where `active` (the same on every stage), else zeros."""
  send = (lambda x: x) if pairs == [(0, 0)] else (lambda x: jax.lax.ppermute(x, AXIS, pairs))
  return jax.lax.cond(active, send, jnp.zeros_like, x)


def _split(x, m):
  """[batch, ...] -> [m, batch / m, ...]: microbatch i is rows i::m."""
  return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _slots(n, like):
  return constrain(jnp.zeros((n,) + like.shape, like.dtype), (None,) + RESIDUAL)


def _ring(p: int, step: int, wrap: bool):
  pairs = [(s, (s + step) % p) for s in range(p)]
  if not wrap:
    pairs = [(a, b) for a, b in pairs if 0 <= a + step < p]
  return pairs

