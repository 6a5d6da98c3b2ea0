"""The pipeline executor: runs a schedule table (`parallel/schedule.py`) over the 'stage' axis.

SPMD: every stage runs the same program inside `jax.shard_map`, manual over 'stage' only (data,
fsdp and tensor stay automatic, so the tensor-parallel region works inside a stage as it does
without a pipeline). A `lax.scan` walks the ticks; at each tick a stage reads its row of the
table (indexed by `axis_index('stage')`) and `lax.switch`es to one of:
  idle            nothing (no compute on idle ticks);
  forward         its chunk of layers on a microbatch (embedding first on chunk 0 of stage 0;
                  the model's last chunk only stashes its input: its backward recomputes it);
  backward        `jax.vjp` of the chunk from its stashed input (recompute), weight gradients
                  accumulated, the input cotangent sent back (the loss head on the last chunk,
                  the embedding on the first).
Forward outputs travel a ring `ppermute` to stage s+1 (stage p-1 -> 0 is interleaving's wrap-
around), input cotangents one to stage s-1. Received messages wait in receive slots, chunk
inputs in stash slots, both assigned from the table's message and in-flight lifetimes, so
memory follows the schedule: 1F1B stashes at most ~p chunk inputs where GPipe stashes m * v.

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
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from mscale_jax.mesh import RESIDUAL, constrain
from mscale_jax.parallel import schedule as schedule_lib

AXIS = "stage"
BLOCKS = "blocks"
# lax.switch branches; the model's first chunk runs FORWARD / BACKWARD with `first` set.
IDLE, FORWARD, FORWARD_LAST, BACKWARD, BACKWARD_LAST = range(5)


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


@dataclasses.dataclass(frozen=True)
class Plan:
  """The table as per-tick integer arrays [ticks, stages], plus buffer sizes."""
  table: schedule_lib.Table
  fields: dict         # name -> np.int32 [ticks, stages]
  stash_slots: int
  inbox_slots: int


def _assign(lifetimes: dict) -> tuple[dict, int]:
  """Buffer slots for {key: (first tick, last tick)}: a slot is reused once its last tick has
  passed. Greedy by first tick, so as few slots as lifetimes ever overlap. (slots, count)."""
  last_tick, slots = [], {}
  for key, (start, end) in sorted(lifetimes.items(), key=lambda kv: kv[1]):
    slot = next((k for k, busy in enumerate(last_tick) if busy < start), len(last_tick))
    if slot == len(last_tick):
      last_tick.append(end)
    last_tick[slot] = end
    slots[key] = slot
  return slots, max(len(last_tick), 1)


@functools.lru_cache(maxsize=64)
def make_plan(schedule: str, stages: int, virtual: int, microbatches: int,
              overlap: bool = True) -> Plan:
  """The executor's view of `schedule.build(...)`: what each stage does at each tick, which
  stash and receive slot it reads and writes, and where arriving messages go."""
  p, v = stages, virtual
  table = schedule_lib.build(schedule, p, v, microbatches, latency=1 if overlap else 0)
  names = ("op", "first", "chunk", "microbatch", "x_slot", "g_slot", "stash_slot", "recv_f",
           "recv_b")
  fields = {name: np.full((table.ticks, p), -1, np.int32) for name in names}
  fields["op"][:] = IDLE
  # Receive slots: a message is in its slot from `ready` to the tick that uses it.
  arrivals, uses = {}, {}
  for msg in table.messages:
    action = schedule_lib.Action(msg.kind, msg.microbatch, msg.chunk)
    arrivals[(msg.dst, action)] = msg
    uses[(msg.dst, action)] = (msg.ready, table.tick_of(msg.dst, action))
  inbox_slots = stash_slots = 1
  for s in range(p):
    inbox, count = _assign({k: span for k, span in uses.items() if k[0] == s})
    inbox_slots = max(inbox_slots, count)
    stash, count = _assign({a: (t, table.tick_of(s, schedule_lib.Action("B", a.microbatch,
                                                                      a.chunk)))
                        for a, t in zip(table.orders[s], table.starts[s]) if a.kind == "F"})
    stash_slots = max(stash_slots, count)       # the table's peak in-flight count
    for action, t in zip(table.orders[s], table.starts[s]):
      first, last = (s, action.chunk) == (0, 0), (s, action.chunk) == (p - 1, v - 1)
      f = fields
      f["chunk"][t, s], f["microbatch"][t, s] = action.chunk, action.microbatch
      f["first"][t, s] = int(first)
      f["stash_slot"][t, s] = stash[schedule_lib.Action("F", action.microbatch, action.chunk)]
      if action.kind == "F":
        f["op"][t, s] = FORWARD_LAST if last else FORWARD
        if not first:
          f["x_slot"][t, s] = inbox[(s, action)]
      else:
        f["op"][t, s] = BACKWARD_LAST if last else BACKWARD
        if not last:
          f["g_slot"][t, s] = inbox[(s, action)]
    for (dst, action), msg in arrivals.items():
      if dst == s:
        # Filed into its slot at the end of tick ready - 1.
        fields["recv_f" if msg.kind == "F" else "recv_b"][msg.ready - 1, s] = inbox[(s, action)]
  # Ticks that receive nothing file the ring's payload into a spare last slot.
  for name in ("recv_f", "recv_b"):
    fields[name][fields[name] < 0] = inbox_slots
  return Plan(table, fields, stash_slots, inbox_slots)


def value_and_grad(params, graphdef, batch, *, schedule: str, stages: int, virtual: int,
                   microbatches: int, overlap: bool = True):
  """Loss and gradients of one pipelined step; equal to `jax.value_and_grad` of the mean
  next-token loss on the unpipelined model (with params in `layer_order`).

  Args:
    params: pure-dict model parameters; block leaves [L, ...] in pipeline layer order, their
      layer axis sharded over 'stage'.
    graphdef: the model's NNX graphdef.
    batch: {'inputs', 'targets'}: int32 [batch, seq], batch over (data, fsdp). Microbatch i
      is rows i, i + m, i + 2m, ...: each data shard splits its own rows.
  Returns:
    (loss, grads), grads laid out like params. Call under `jax.set_mesh(mesh)` inside jit.
  """
  plan = make_plan(schedule, stages, virtual, microbatches, overlap)
  shared = {k: v for k, v in params.items() if k != BLOCKS}
  spec = lambda tree, s: jax.tree.map(lambda _: s, tree)
  in_specs = (spec(params[BLOCKS], P(AXIS)), spec(shared, P()), spec(batch, P()))
  out_specs = (P(), spec(params[BLOCKS], P(AXIS)), spec(shared, P()))
  run = jax.shard_map(functools.partial(_per_stage, graphdef=graphdef, plan=plan,
                                        overlap=overlap),
                      in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                      check_vma=False)
  loss, block_grads, shared_grads = run(params[BLOCKS], shared, batch)
  return loss, {**shared_grads, BLOCKS: block_grads}


def _per_stage(blocks, shared, batch, *, graphdef, plan: Plan, overlap: bool):
  """One stage's program: the scan over ticks. `blocks` is this stage's [v * L_c, ...].

  Long on purpose: the tick's five branches (idle, forward, forward of the last chunk,
  backward, backward with the loss) are closures over the tick's own locals (its chunk,
  microbatch, stash slot, received activations), so they live inside `tick`, beside the sends
  and receives that follow them.
  """
  table = plan.table
  p, v, m = table.stages, table.virtual, table.microbatches
  stage = jax.lax.axis_index(AXIS)
  chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), blocks)

  def split(x):   # [batch, seq] -> [m, batch / m, seq]: microbatch i is rows i::m.
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
  inputs, targets = split(batch["inputs"]), split(batch["targets"])

  def model(chunk_params, shared_params):
    return nnx.merge(graphdef, {**shared_params, BLOCKS: chunk_params})

  def run(cp, sp, x):
    return model(cp, sp).run_blocks(x)

  def run_and_loss(cp, sp, x, tgt):
    mod = model(cp, sp)
    return _cross_entropy(mod.head(mod.run_blocks(x)), tgt) / m

  first_chunk = jax.tree.map(lambda a: a[0], chunks)
  shape = jax.eval_shape(lambda: model(first_chunk, shared).embed_tokens(inputs[0]))
  act = jnp.zeros(shape.shape, shape.dtype)    # one microbatch's activations

  def slots(n):
    return constrain(jnp.zeros((n,) + shape.shape, shape.dtype), (None,) + RESIDUAL)

  zeros_like = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  add_at = lambda acc, c, g: jax.tree.map(lambda a, b: a.at[c].add(b), acc, g)

  embed_names = [k for k in ("embed", "pos_embed") if k in shared]

  def tick(carry, row):
    f = {k: a[stage] for k, a in row.items()}
    c, i, op = f["chunk"], f["microbatch"], f["op"]
    cp = jax.tree.map(lambda a: a[c], chunks)
    tokens, tgt = inputs[i], targets[i]
    # The embedding (a gather, O(batch * seq * hidden)) runs on every stage at every tick,
    # outside the switch: inside it XLA partitions the gather with collective-permutes over
    # all devices, which deadlock when the stages take different branches.
    x_embed, embed_vjp = jax.vjp(
        lambda emb: model(cp, {**shared, **emb}).embed_tokens(tokens),
        {k: shared[k] for k in embed_names})
    first = f["first"] == 1
    x_in = jnp.where(first, x_embed,
                     carry["inbox"][jnp.maximum(f["x_slot"], 0)])
    g_in = carry["inbox"][jnp.maximum(f["g_slot"], 0)]
    stashed = carry["stash"][jnp.maximum(f["stash_slot"], 0)]
    state = (carry["stash"], carry["grad_chunks"], carry["grad_shared"], carry["loss"])

    def store(stash, x):
      return stash.at[f["stash_slot"]].set(x)

    def idle(state):
      return state, act, act

    def forward(state):
      stash, gc, gs, loss = state
      return (store(stash, x_in), gc, gs, loss), run(cp, shared, x_in), act

    def forward_last(state):   # the backward recomputes it from the stash, with the loss
      stash, gc, gs, loss = state
      return (store(stash, x_in), gc, gs, loss), act, act

    def backward(state):
      stash, gc, gs, loss = state
      _, vjp = jax.vjp(lambda cp, x: run(cp, shared, x), cp, stashed)
      d_cp, d_x = vjp(g_in)
      return (stash, add_at(gc, c, d_cp), gs, loss), act, d_x

    def backward_last(state):
      stash, gc, gs, loss = state
      value, vjp = jax.vjp(lambda cp, sp, x: run_and_loss(cp, sp, x, tgt), cp, shared,
                           stashed)
      d_cp, d_sp, d_x = vjp(jnp.ones_like(value))
      return ((stash, add_at(gc, c, d_cp), jax.tree.map(jnp.add, gs, d_sp), loss + value),
              act, d_x)

    # The model's first chunk runs the plain forward / backward on the embedding's output;
    # its input cotangent goes to the embedding's backward below (and, harmlessly, into the
    # ring, where no receive slot takes it).
    branches = (idle, forward, forward_last, backward, backward_last)
    state, out_f, out_b = jax.lax.switch(op, branches, state)
    stash, grad_chunks, grad_shared, loss = state
    (d_embed,) = embed_vjp(jnp.where(first & (op == BACKWARD), out_b, 0).astype(out_b.dtype))
    grad_shared = {**grad_shared,
                   **{k: grad_shared[k] + d_embed[k] for k in embed_names}}

    if overlap:   # send the previous tick's outputs while this tick computed
      send_f, send_b = carry["out_f"], carry["out_b"]
    else:
      send_f, send_b = out_f, out_b
    recv_f = jax.lax.ppermute(send_f, AXIS, _ring(p, +1, wrap=v > 1))
    recv_b = jax.lax.ppermute(send_b, AXIS, _ring(p, -1, wrap=v > 1))
    inbox = carry["inbox"].at[f["recv_f"]].set(recv_f).at[f["recv_b"]].set(recv_b)
    carry = {"inbox": inbox, "stash": stash, "grad_chunks": grad_chunks,
             "grad_shared": grad_shared, "loss": loss}
    if overlap:
      carry.update(out_f=out_f, out_b=out_b)
    return carry, None

  carry = {"inbox": slots(plan.inbox_slots + 1), "stash": slots(plan.stash_slots),
           "grad_chunks": zeros_like(chunks), "grad_shared": zeros_like(shared),
           "loss": jnp.zeros((), jnp.float32)}
  if overlap:
    carry.update(out_f=act, out_b=act)
  rows = {k: jnp.asarray(a) for k, a in plan.fields.items()}
  carry, _ = jax.lax.scan(tick, carry, rows)
  grad_blocks = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), carry["grad_chunks"])
  loss = jax.lax.psum(carry["loss"], AXIS)
  grad_shared = jax.lax.psum(carry["grad_shared"], AXIS)
  return loss, grad_blocks, grad_shared


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, picking the target's log-probability with a one-hot
  product: XLA's SPMD partitioner aborts on the label gather of
  `optax.softmax_cross_entropy_with_integer_labels` over tensor-sharded logits inside a
  region manual over 'stage' only (jax 0.10.2). Same value within float32 rounding."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -(log_probs * jax.nn.one_hot(targets, logits.shape[-1], dtype=log_probs.dtype)
           ).sum(-1).mean()


def _ring(p: int, step: int, wrap: bool):
  pairs = [(s, (s + step) % p) for s in range(p)]
  if not wrap:
    pairs = [(a, b) for a, b in pairs if 0 <= a + step < p]
  return pairs
