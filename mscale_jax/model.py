"""A GPT decoder in Flax NNX: the parallel transformer block (PTB), sliding-window attention.

    tokens -> embed (+ learned positions) -> L x block -> norm -> logits
    parallel block:    y = x + Attn(LN(x)) + MLP(LN(x))          (one shared norm)
    sequential block:  y = x' + MLP(LN(x')),  x' = x + Attn(LN(x))

Parameters are float32 and carry logical axis names (see `mesh.LOGICAL_RULES`); computation
runs in `config.dtype`. The fused projections are stored so each tensor-parallel shard holds
whole heads / MLP units: `w_qkv` is [d, heads * 3 * head_dim] with columns (head, q|k|v, dim),
`w_in` is [d, mlp * g] with columns (unit, gate|up) for SwiGLU (g=2) or (unit,) for GeLU.
The only communication is in `parallel.tensor`: one `gather_matmul` into the block's
column-parallel kernels and one `matmul_scatter` out of its row-parallel kernels.
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mscale_jax import attention as attention_lib
from mscale_jax.config import ModelConfig
from mscale_jax.mesh import RESIDUAL, constrain, logical_names, per_shard
from mscale_jax.parallel import tensor as tp

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _param(rngs: nnx.Rngs, shape, names, std: float | None = 0.02) -> nnx.Param:
  """A float32 parameter, normal(std) or zeros (std=None), annotated with logical `names`."""
  value = (jnp.zeros(shape, jnp.float32) if std is None else
           std * jax.random.normal(rngs.params(), shape, jnp.float32))
  return nnx.Param(value, out_sharding=names)


class Norm(nnx.Module):
  """LayerNorm (scale and offset) or RMSNorm (scale) over the last axis, statistics in float32."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.kind, self.impl, self.eps = config.norm, config.norm_impl, 1e-5
    self.scale = nnx.Param(jnp.ones((config.hidden,), jnp.float32),
                           out_sharding=("act_embed",))
    if self.kind == "layernorm":
      self.offset = _param(rngs, (config.hidden,), ("act_embed",), std=None)

  def __call__(self, x: jax.Array) -> jax.Array:
    """[..., hidden] -> same shape and dtype; the Pallas kernel when norm_impl='pallas'."""
    if self.impl == "pallas":
      return self._pallas(x)
    x32 = x.astype(jnp.float32)
    if self.kind == "layernorm":
      x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + self.eps) * self.scale[...]
    if self.kind == "layernorm":
      y = y + self.offset[...]
    return y.astype(x.dtype)

  def _pallas(self, x: jax.Array) -> jax.Array:
    from pallas_kernels import layer_norm as kernels
    if self.kind == "layernorm":
      fn = lambda x, s, o: kernels.layer_norm(x, s, o, eps=self.eps)
      params = (self.scale[...], self.offset[...])
    else:
      fn = lambda x, s: kernels.rms_norm(x, s, eps=self.eps)
      params = (self.scale[...],)
    names = (RESIDUAL,) + (("act_embed",),) * len(params)
    return per_shard(fn, in_names=names, out_names=RESIDUAL)(x, *params)


class Attention(nnx.Module):
  """Causal self-attention with an optional sliding window; heads are tensor-parallel."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c = config
    self.config = c
    out_std = 0.02 / math.sqrt(2 * c.num_layers)
    self.w_qkv = _param(rngs, (c.hidden, c.num_heads * 3 * c.head_dim), ("embed", "heads"))
    self.w_o = _param(rngs, (c.num_heads * c.head_dim, c.hidden), ("heads", "embed"), out_std)
    if c.use_bias:
      self.b_qkv = _param(rngs, (c.num_heads * 3 * c.head_dim,), ("heads",), std=None)
      self.b_o = _param(rngs, (c.hidden,), ("act_embed",), std=None)

  def mix(self, qkv: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """[b, s, heads*3*head_dim] projections -> [b, s, heads*head_dim] attention output.

    `segment_ids` (int [b, s]): attention stays within each segment (packed documents).
    """
    c = self.config
    if c.use_bias:
      qkv = qkv + self.b_qkv[...].astype(qkv.dtype)
    b, s, _ = qkv.shape
    qkv = constrain(qkv.reshape(b, s, c.num_heads, 3, c.head_dim),
                    ("batch", "seq", "heads", None, "head_dim"))
    q, k, v = (qkv[:, :, :, i] for i in range(3))
    if self.decoding:
      return self._attend_cached(q, k, v).reshape(b, s, c.num_heads * c.head_dim)
    if c.positions == "rotary":
      q, k = rotary(q), rotary(k)
    out = attention_lib.attention(q, k, v, window=c.attention_window, impl=c.attention_impl,
                                  segment_ids=segment_ids)
    return out.reshape(b, s, c.num_heads * c.head_dim)

  # -- decoding (see `init_cache`; used by mscale_jax.generate) --------------------------------

  @property
  def decoding(self) -> bool:
    """Whether `init_cache` turned on the key/value cache."""
    return hasattr(self, "cache_index")

  def init_cache(self, batch: int, capacity: int, layers: tuple[int, ...] = ()) -> None:
    """Keeps keys and values of up to `capacity` positions between calls, for decoding.

    Each later call attends its queries to the cached keys and its own, then stores its own
    (the newest `capacity` of them): position p lives in slot p % capacity, so a model with an
    attention window needs only `capacity = attention_window` (older keys are never attended)
    and a full-attention model needs the whole length. `layers` is a leading shape for layers
    stacked by scan-over-layers.
    """
    c = self.config
    shape = layers + (batch, capacity, c.num_heads, c.head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(shape, c.dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, c.dtype))
    self.cached_position = nnx.Cache(jnp.full(layers + (capacity,), -1, jnp.int32))  # -1: empty
    self.cache_index = nnx.Cache(jnp.zeros(layers, jnp.int32))    # the next token's position

  def _attend_cached(self, q, k, v) -> jax.Array:
    c = self.config
    s, capacity = q.shape[1], self.cached_key.shape[1]
    start = self.cache_index[...]
    positions = start + jnp.arange(s, dtype=jnp.int32)
    if c.positions == "rotary":
      q, k = rotary(q, offset=start), rotary(k, offset=start)
    out = attention_lib.attention_at(
        q, jnp.concatenate([self.cached_key[...], k], axis=1),
        jnp.concatenate([self.cached_value[...], v], axis=1),
        q_positions=positions,
        k_positions=jnp.concatenate([self.cached_position[...], positions]),
        window=c.attention_window)
    keep = min(s, capacity)
    slots = positions[s - keep:] % capacity
    self.cached_key[...] = self.cached_key[...].at[:, slots].set(k[:, s - keep:])
    self.cached_value[...] = self.cached_value[...].at[:, slots].set(v[:, s - keep:])
    self.cached_position[...] = self.cached_position[...].at[slots].set(positions[s - keep:])
    self.cache_index[...] = start + s
    return out

  def output_bias(self) -> jax.Array | float:
    """The row-parallel output bias, added once after the reduce-scatter."""
    return self.b_o[...].astype(self.config.dtype) if self.config.use_bias else 0.0


class MLP(nnx.Module):
  """GeLU or SwiGLU MLP; its hidden units are tensor-parallel."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.gates = 2 if c.mlp_activation == "swiglu" else 1
    out_std = 0.02 / math.sqrt(2 * c.num_layers)
    self.w_in = _param(rngs, (c.hidden, c.mlp_dim * self.gates), ("embed", "mlp"))
    self.w_out = _param(rngs, (c.mlp_dim, c.hidden), ("mlp", "embed"), out_std)
    if c.use_bias:
      self.b_in = _param(rngs, (c.mlp_dim * self.gates,), ("mlp",), std=None)
      self.b_out = _param(rngs, (c.hidden,), ("act_embed",), std=None)

  def activate(self, h: jax.Array) -> jax.Array:
    """[b, s, mlp*gates] pre-activations -> [b, s, mlp] hidden units."""
    if self.config.use_bias:
      h = h + self.b_in[...].astype(h.dtype)
    if self.gates == 1:
      return jax.nn.gelu(h)
    b, s, _ = h.shape
    h = h.reshape(b, s, self.config.mlp_dim, 2)
    return jax.nn.silu(h[..., 0]) * h[..., 1]

  def output_bias(self) -> jax.Array | float:
    """The row-parallel output bias, added once after the reduce-scatter."""
    return self.b_out[...].astype(self.config.dtype) if self.config.use_bias else 0.0


class Block(nnx.Module):
  """One transformer layer, parallel (PTB) or sequential, with sequence-parallel input/output."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.config = config
    self.norm = Norm(config, rngs)
    if config.block == "sequential":
      self.mlp_norm = Norm(config, rngs)
    self.attn = Attention(config, rngs)
    self.mlp = MLP(config, rngs)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """[b, s, d] -> [b, s, d]; sequence sharded over 'tensor' in and out. `segment_ids`
    (int [b, s], optional) keep attention within packed documents."""
    if self.config.block == "parallel":
      return self._parallel(x, segment_ids)
    return self._sequential(x, segment_ids)

  def _kernel(self, param: nnx.Param) -> jax.Array:
    return param[...].astype(self.config.dtype)

  def _parallel(self, x, segment_ids):
    tp_comm = self.config.tp_comm
    h = self.norm(x)
    qkv, ffn = tp.gather_matmul(h, [self._kernel(self.attn.w_qkv), self._kernel(self.mlp.w_in)],
                                tp_comm=tp_comm)
    attn_out, ffn_out = self.attn.mix(qkv, segment_ids), self.mlp.activate(ffn)
    y = tp.matmul_scatter([attn_out, ffn_out],
                          [self._kernel(self.attn.w_o), self._kernel(self.mlp.w_out)],
                          tp_comm=tp_comm)
    return x + y + self.attn.output_bias() + self.mlp.output_bias()

  def _sequential(self, x, segment_ids):
    tp_comm = self.config.tp_comm
    (qkv,) = tp.gather_matmul(self.norm(x), [self._kernel(self.attn.w_qkv)], tp_comm=tp_comm)
    y = tp.matmul_scatter([self.attn.mix(qkv, segment_ids)], [self._kernel(self.attn.w_o)],
                          tp_comm=tp_comm)
    x = x + y + self.attn.output_bias()
    (ffn,) = tp.gather_matmul(self.mlp_norm(x), [self._kernel(self.mlp.w_in)], tp_comm=tp_comm)
    y = tp.matmul_scatter([self.mlp.activate(ffn)], [self._kernel(self.mlp.w_out)],
                          tp_comm=tp_comm)
    return x + y + self.mlp.output_bias()


def rotary(x: jax.Array, base: float = 10000.0, offset: jax.Array | int = 0) -> jax.Array:
  """Rotary position embedding of [b, s, h, d] queries or keys at positions offset + 0..s-1."""
  s, d = x.shape[1], x.shape[-1]
  freqs = base ** (-jnp.arange(0, d // 2, dtype=jnp.float32) / (d // 2))
  positions = offset + jnp.arange(s, dtype=jnp.float32)
  angles = positions[:, None] * freqs[None, :]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class GPT(nnx.Module):
  """Decoder-only transformer: [batch, seq] int tokens -> [batch, seq, vocab] float32 logits."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed = _param(rngs, (c.vocab_size, c.hidden), ("vocab", "embed"))
    if c.positions == "learned":
      self.pos_embed = _param(rngs, (c.seq_len, c.hidden), ("positions", "embed"))
    if c.scan_layers:
      @nnx.split_rngs(splits=c.num_layers)
      @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      def make_blocks(rngs):
        return Block(c, rngs)
      self.blocks = make_blocks(rngs)
    else:
      self.blocks = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
    self.final_norm = Norm(c, rngs)
    if not c.tie_embeddings:
      self.unembed = _param(rngs, (c.hidden, c.vocab_size), ("embed", "vocab"))

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """int [batch, seq] -> float32 logits [batch, seq, vocab], batch over (data, fsdp).

    `segment_ids` (int [batch, seq], optional): a token attends only to earlier tokens of its
    own segment (documents packed into one sequence; `data.document_mask`).
    """
    return self.head(self.run_blocks(self.embed_tokens(tokens), segment_ids))

  # The three parts separately, for pipelines that run them on different devices.

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """int [batch, seq] -> [batch, seq, hidden] block input in the compute dtype."""
    c = self.config
    x = jnp.take(self.embed[...], tokens, axis=0)
    if c.positions == "learned":
      start = self.cache_index[...] if hasattr(self, "cache_index") else 0
      x = x + jax.lax.dynamic_slice_in_dim(self.pos_embed[...], start, tokens.shape[1])[None]
    if hasattr(self, "cache_index"):
      self.cache_index[...] += tokens.shape[1]
    return constrain(x.astype(c.dtype), RESIDUAL)

  def head(self, x: jax.Array) -> jax.Array:
    """Final norm and unembedding: [batch, seq, hidden] -> float32 [batch, seq, vocab]."""
    c = self.config
    x = self.final_norm(x)
    unembed = self.embed[...].T if c.tie_embeddings else self.unembed[...]
    logits = jnp.einsum("bsd,dv->bsv", x, unembed.astype(c.dtype),
                        preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab"))

  def init_cache(self, batch: int, capacity: int) -> None:
    """Turns on decoding: each call continues the sequence of the previous calls.

    Every attention layer keeps `capacity` key/value positions (`Attention.init_cache`).
    Learned position embeddings are read at the positions reached, which must stay below
    `seq_len` (the caller checks: `lax.dynamic_slice` would clamp).
    """
    c = self.config
    if c.scan_layers:
      self.blocks.attn.init_cache(batch, capacity, layers=(c.num_layers,))
    else:
      for block in self.blocks:
        block.attn.init_cache(batch, capacity)
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

  def run_blocks(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 remat_policy=None) -> jax.Array:
    """Applies the stacked blocks in order (all of them, or the chunk the model was merged
    with): [batch, seq, hidden] -> same; `segment_ids` as in `__call__`. `remat_policy` (a
    `jax.checkpoint` policy) checkpoints each block with it instead of `config.remat`'s."""
    c = self.config

    def apply(block: Block, x: jax.Array) -> jax.Array:
      return constrain(block(x, segment_ids), RESIDUAL)

    if remat_policy is None and c.remat != "none":
      remat_policy = REMAT_POLICIES[c.remat]
    if remat_policy is not None:
      apply = nnx.remat(apply, policy=remat_policy)
    if not c.scan_layers:
      for block in self.blocks:
        x = apply(block, x)
      return x

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def scan(x, block):
      return apply(block, x)

    return scan(x, self.blocks)


def count_params(state) -> int:
  """Number of parameters in a (possibly abstract) model state."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def abstract_model(config: ModelConfig):
  """(graphdef, abstract params, logical names of params), allocating nothing."""
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, nnx.to_pure_dict(params), logical_names(params)
