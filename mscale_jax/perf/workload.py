"""What is trained and how it is laid out: model shape, 3D-parallel layout, technique switches.

`validate` rejects impossible layouts with a ConfigError naming the value, before any cost is
computed.
"""
import dataclasses

from mscale_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A GPT decoder's shape (paper Table 1). FFN width is `ffn_mult * hidden`."""
  name: str
  num_layers: int
  hidden: int
  num_heads: int
  seq_len: int
  vocab: int
  ffn_mult: int = 4

  @property
  def head_dim(self) -> int:
    """Width of one attention head."""
    return self.hidden // self.num_heads

  @property
  def params_per_layer(self) -> int:
    """Weights of one block: QKV, out, two FFN matrices (biases and norms are negligible)."""
    h = self.hidden
    return 4 * h * h + 2 * self.ffn_mult * h * h

  @property
  def num_params(self) -> int:
    """All weights: the blocks plus the (tied) embedding."""
    return self.num_layers * self.params_per_layer + self.vocab * self.hidden


GPT_175B = ModelSpec("175B", num_layers=96, hidden=12288, num_heads=128, seq_len=2048,
                     vocab=64000)
GPT_530B = ModelSpec("530B", num_layers=105, hidden=20480, num_heads=160, seq_len=2048,
                     vocab=64000)
MODELS = {m.name: m for m in (GPT_175B, GPT_530B)}


@dataclasses.dataclass(frozen=True)
class Layout:
  """3D-parallel layout. Ranks are ordered TP fastest, then DP, then PP (Megatron-LM's order)."""
  tp: int
  pp: int
  vpp: int            # virtual stages (model chunks) per pipeline stage, interleaved 1F1B
  dp: int
  micro_batch: int
  global_batch: int

  @property
  def devices(self) -> int:
    """Accelerators the layout occupies: tp * pp * dp."""
    return self.tp * self.pp * self.dp

  @property
  def num_micro_batches(self) -> int:
    """Micro-batches each pipeline runs per iteration."""
    return self.global_batch // (self.dp * self.micro_batch)


@dataclasses.dataclass(frozen=True)
class Techniques:
  """MegaScale's techniques as switches (paper Table 3), each costed by its mechanism.

  lamb changes no per-iteration cost: it is what allows the larger `global_batch` (paper: 3-4x
  at the same quality), so a layout with a larger batch is only 'fair' with lamb on. Its
  optimizer update reads the parameters once more for the trust ratio.
  """
  parallel_block: bool = False   # one LN, merged GEMMs, half the TP collectives
  sliding_window: int | None = None   # attention window w (tokens), None for full causal
  tp_overlap: bool = False       # chunked GEMMs pipelined with the TP collectives
  pp_overlap: bool = False       # decoupled, asynchronous send/recv between stages
  dp_overlap: bool = False       # per-chunk ZeRO-2 all-gather/reduce-scatter behind compute
  efficient_ops: bool = False    # flash attention, fused LayerNorm/GeLU
  async_data: bool = False       # 'misc': async data loading, no host stalls per iteration
  lamb: bool = False
  # Two-level DP collectives (`compressed.DPCompression`: SDP4Bit or uncompressed); None: rings.
  dp_compression: object | None = None
  zb_h1: bool = False            # ZB-H1 pipeline schedule (vpp = 1) instead of (interleaved) 1F1B
  # Asynchronous checkpoint saves (train.async_checkpoint): the train state is copied into fresh
  # device buffers before the background write (mscale_jax/checkpoint.py), one more state's
  # device memory. Off by default: the paper's tables count no such copy (MegaScale copies to
  # host memory).
  async_checkpoint: bool = False


def validate(model: ModelSpec, layout: Layout, devices: int | None = None) -> None:
  """Raises ConfigError for a layout that cannot run `model` (on `devices` accelerators)."""
  for field in ("tp", "pp", "vpp", "dp", "micro_batch", "global_batch"):
    value = getattr(layout, field)
    if not isinstance(value, int) or value < 1:
      raise ConfigError(field, value, "a positive integer")
  if model.num_heads % layout.tp:
    raise ConfigError("tp", layout.tp, f"a divisor of num_heads={model.num_heads}")
  if model.num_layers % (layout.pp * layout.vpp):
    raise ConfigError("pp*vpp", layout.pp * layout.vpp,
                      f"a divisor of num_layers={model.num_layers}")
  if devices is not None and devices % (layout.tp * layout.pp):
    raise ConfigError("devices", devices, f"a multiple of tp*pp={layout.tp * layout.pp}")
  if devices is not None and devices != layout.devices:
    raise ConfigError("dp", layout.dp, f"devices/(tp*pp)={devices // (layout.tp * layout.pp)}")
  if layout.global_batch % (layout.dp * layout.micro_batch):
    raise ConfigError("global_batch", layout.global_batch,
                      f"a multiple of dp*micro_batch={layout.dp * layout.micro_batch}")
  if layout.vpp > 1 and layout.num_micro_batches < layout.pp:
    raise ConfigError("num_micro_batches", layout.num_micro_batches,
                      f"at least pp={layout.pp} for the interleaved schedule")


def layout_for(model: ModelSpec, devices: int, tp: int, pp: int, vpp: int, micro_batch: int,
               global_batch: int) -> Layout:
  """The layout that fills `devices` with data parallelism, validated."""
  if devices < 1:
    raise ConfigError("devices", devices, "a positive integer")
  validate(model, Layout(tp=tp, pp=pp, vpp=vpp, dp=1, micro_batch=micro_batch,
                         global_batch=micro_batch * pp))
  if devices % (tp * pp):
    raise ConfigError("devices", devices, f"a multiple of tp*pp={tp * pp}")
  layout = Layout(tp=tp, pp=pp, vpp=vpp, dp=devices // (tp * pp), micro_batch=micro_batch,
                  global_batch=global_batch)
  validate(model, layout, devices)
  return layout
