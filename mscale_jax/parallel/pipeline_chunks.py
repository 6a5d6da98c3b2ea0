"""A pipeline chunk's forward and backward (`Chunks`), what the executor (`pipeline.py`) runs in
its branches: the forward with the residuals its backward will read (the stash), and that
backward from them, whole or split into B and W (`backward_split`).
"""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mscale_jax.parallel import backward_split

BLOCKS = "blocks"
EMBEDDINGS = ("embed", "pos_embed")   # the shared parameters the first chunk reads

# What a stashing backward keeps of each layer's forward (and of the loss head's), besides the
# layer's input: the rest it recomputes, layer by layer inside the backward's layer scan. Never
# a weight (see `Chunks._parameter_residuals`). 'none': every matmul output, so no matmul runs
# twice; the backward gathers each layer's (normalized) input again over 'tensor' rather than
# stashing it gathered (4x the sequence shard at tensor=4; measured faster on CPU).
# 'selective': the matmul outputs but attention's batched ones (QK^T and PV), whose core
# (scores, softmax, PV) the backward recomputes: Megatron's selective activation recomputation
# (Korthikanti et al., 2022), a few percent more FLOPs for the stash's largest part at long
# sequences.
STASH_POLICIES = {"none": jax.checkpoint_policies.dots_saveable,
                  "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Chunks:
  """A chunk's forward and its vjp, for each kind of chunk (`Op.first`: it embeds the
  tokens; `Op.last`: it ends in the loss head and returns its share of the mean loss).

  A chunk differentiates its block parameters, the shared parameters it uses (embedding on
  the first, all of them on the last, whose head may be tied to the embedding) and its input.
  The first chunk's input is the embedding of its tokens, looked up (in its branch) in a copy
  of the tables replicated over the stage's devices, gathered once per step before the ticks;
  the embedding's backward runs outside the switch (`pipeline._per_stage`). Inside the switch XLA
  partitions a gather from a tensor-sharded table, and the scatter-add of its backward, with
  collective-permutes over every device, which deadlock when the stages take different
  branches (XLA:CPU, jax 0.10).
  """

  def __init__(self, graphdef, shared, microbatches: int, recompute: str, example):
    self.graphdef, self.shared, self.m, self.recompute = graphdef, shared, microbatches, recompute
    self.example = example    # (chunk params, tokens, targets) of one microbatch
    cp, tokens, _ = example
    shape = jax.eval_shape(lambda: self._model(cp, {}).embed_tokens(tokens))
    self.act = jnp.zeros(shape.shape, shape.dtype)    # one microbatch's activations
    self.replicated = {k: _replicated(shared[k]) for k in EMBEDDINGS if k in shared}
    self._layouts = {}   # (op.first, op.last) -> `_residual_layout`

  def _model(self, cp, sp):
    return nnx.merge(self.graphdef, {**self.shared, **sp, BLOCKS: cp})

  def embed(self, tokens, tables=None):
    """The first chunk's input [batch, seq, hidden] from `tables` (default: the replicated
    copy; no gradient flows from the chunk into it: see `pipeline._per_stage`)."""
    tables = self.replicated if tables is None else tables
    return self._model(self.example[0], tables).embed_tokens(tokens)

  def _own(self, op) -> dict:
    """The shared parameters `op`'s chunk reads and differentiates."""
    return self.shared if op.last else {}

  def _fn(self, op, tgt, policy=None):
    """The chunk as fn(cp, sp, x); with a checkpoint `policy`, each layer and the loss head
    are checkpointed with it."""
    def loss(cp, sp, h):
      return _cross_entropy(self._model(cp, sp).head(h), tgt) / self.m
    if policy is not None:
      loss = jax.checkpoint(loss, policy=policy)

    def fn(cp, sp, x):
      h = self._model(cp, sp).run_blocks(x, remat_policy=policy)
      return loss(cp, sp, h) if op.last else h
    return fn

  def _vjp(self, op, cp, x, tgt):
    # With a stash policy the stash holds what its backward needs (the policy's outputs and
    # each layer's input), not every intermediate jax.vjp would otherwise save. Checkpointed
    # per layer, the backward redoes a layer's elementwise work inside its own iteration of
    # the layer scan; checkpointed whole, it would replay the chunk's forward in a scan of its
    # own first and keep all of that replay for the backward's scan.
    return jax.vjp(self._fn(op, tgt, STASH_POLICIES.get(self.recompute)), cp, self._own(op), x)

  def apply(self, op, cp, x, tgt):
    """The chunk's output (its loss share on the last chunk), no vjp."""
    return self._fn(op, tgt)(cp, self._own(op), x)

  def forward(self, op, cp, x, tgt):
    """(output, leaves to stash): output is the chunk's activations (the loss share on the
    last chunk under recompute='none'; nothing under 'full', whose backward computes it)."""
    if self.recompute == "full":
      stash = [] if op.first else [x]
      if op.last:
        return None, stash
      return self.apply(op, cp, x, tgt), stash
    out, vjp = self._vjp(op, cp, x, tgt)
    return out, self._activations(op, cp, vjp)

  def stash_shapes(self, op) -> list:
    """ShapeDtypeStructs of what `forward(op, ...)` stashes."""
    cp, _, tgt = self.example
    return jax.eval_shape(lambda *a: self.forward(op, *a)[1], cp, self.act, tgt)

  def vjp(self, op, cp, leaves, tokens, tgt):
    """(vjp, loss share or None) from what `forward` stashed; vjp(g) -> (d_cp, d_sp, d_x)."""
    if self.recompute == "full":
      value, vjp = self._vjp(op, cp, self.embed(tokens) if op.first else leaves[0], tgt)
      return vjp, (value if op.last else None)
    structure, where = self._residual_layout(op)
    params, leaves = jax.tree.leaves((cp, self._own(op))), iter(leaves)
    residuals = [next(leaves) if i is None else params[i] for i in where]
    return jax.tree.unflatten(structure, residuals), None

  def _backward(self, op):
    """(b, w) of `op`'s backward split by `backward_split`: B the input cotangent and the
    loss share (0 unless recomputed), W the parameter gradients; W reads no cotangent."""
    def fn(cp, leaves, tgt, g):
      vjp, value = self.vjp(op, cp, leaves, None, tgt)
      d_cp, d_sp, d_x = vjp(g)
      return (d_x, jnp.zeros((), jnp.float32) if value is None else value), (d_cp, d_sp)
    return backward_split.split(fn, b_outputs=2, b_only=1)

  def backward_input(self, op, cp, leaves, tgt, g):
    """B of a split backward (not the model's first chunk): (d_x, loss share or 0, the values
    `backward_weights` reads)."""
    (d_x, value), saved = self._backward(op)[0](cp, leaves, tgt, g)
    return d_x, value, saved

  def backward_weights(self, op, saved, cp, leaves, tgt):
    """W of a split backward: (d_cp, d_sp) from what `backward_input` kept."""
    g = self._seed_shape(op)
    g = jnp.zeros(g.shape, g.dtype)     # read by no equation of W: B kept what W needs of it
    grads = self._backward(op)[1](saved, cp, leaves, tgt, g)
    return jax.tree.unflatten(jax.tree.structure((cp, self._own(op))), grads)

  def _seed_shape(self, op):
    """The output cotangent's shape: the loss's (a float32 scalar) or the activations'."""
    return jax.ShapeDtypeStruct(*(((), jnp.float32) if op.last else
                                  (self.act.shape, self.act.dtype)))

  def kept_shapes(self, op) -> list:
    """ShapeDtypeStructs of what the split backward's B of `op` keeps for its W (the model's
    first chunk: its output cotangent, as its W runs the whole backward)."""
    g = self._seed_shape(op)
    if op.first:
      return [g]
    cp, _, tgt = self.example
    return jax.eval_shape(lambda cp, leaves, g: self.backward_input(op, cp, leaves, tgt, g)[2],
                          cp, self.stash_shapes(op), g)

  def _parameter_residuals(self, op, cp, vjp) -> list:
    """Per residual leaf of `vjp`: the index of the parameter leaf (of (cp, the shared
    parameters `op` reads)) it is, or None for an activation. The backward reads the weights
    where they are; stashing them would copy every weight once per microbatch."""
    params = jax.tree.leaves((cp, self._own(op)))
    return [next((i for i, p in enumerate(params) if leaf is p), None)
            for leaf in jax.tree.leaves(vjp)]

  def _activations(self, op, cp, vjp) -> list:
    """The residual leaves of `vjp` to stash: all but the parameters."""
    return [leaf for leaf, i in zip(jax.tree.leaves(vjp), self._parameter_residuals(op, cp, vjp))
            if i is None]

  def _residual_layout(self, op):
    """(tree structure of `op`'s vjp, `_parameter_residuals` of it), from one trace per kind
    of chunk (its B and W share it; it depends on shapes only)."""
    key = (op.first, op.last)
    if key not in self._layouts:
      where = []

      def trace(cp, x, tgt):
        _, vjp = self._vjp(op, cp, x, tgt)
        where.extend(self._parameter_residuals(op, cp, vjp))
        return vjp
      cp, _, tgt = self.example
      structure = jax.tree.structure(jax.eval_shape(trace, cp, self.act, tgt))
      self._layouts[key] = structure, where
    return self._layouts[key]



def _replicated(x):
  return jax.lax.with_sharding_constraint(x, P(*(None,) * x.ndim))


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, picking the target's log-probability with a one-hot
  product: XLA's SPMD partitioner aborts on the label gather of
  `optax.softmax_cross_entropy_with_integer_labels` over tensor-sharded logits inside a
  region manual over 'stage' only (jax 0.10.2). Same value within float32 rounding."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -(log_probs * jax.nn.one_hot(targets, logits.shape[-1], dtype=log_probs.dtype)
           ).sum(-1).mean()

