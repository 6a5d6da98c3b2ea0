"""Typed run configuration and its single `validate()`.

Configs are written as ml_collections files in `experiments/configs/` (so absl can override any
field on the command line) and turned into these frozen dataclasses by `Config.from_dict`.
`validate()` checks everything that can be checked before compilation and raises `ConfigError`
naming the field, the value and what would be valid.
"""
import dataclasses
from typing import Any

from mscale_jax.errors import ConfigError

BLOCKS = ("parallel", "sequential")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITIONS = ("learned", "rotary")
ATTENTION_IMPLS = ("xla", "pallas", "cudnn")
NORM_IMPLS = ("xla", "pallas")
TP_COMMS = ("xla", "ppermute", "pallas")
REMATS = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16")
OPTIMIZERS = ("adamw", "lamb", "lamb_fused")
DATA_KINDS = ("stdlib", "tokens", "synthetic", "prepared")
DOCUMENT_KINDS = ("stdlib", "prepared")   # corpora with an end-of-document token
TOKEN_DTYPES = ("uint16", "uint32")
MESH_AXES = ("data", "fsdp", "stage", "tensor")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")   # parallel/schedule.py
PIPELINE_RECOMPUTE = ("none", "selective", "full")   # parallel/pipeline.py
NONFINITE_POLICIES = ("stop", "skip_step", "rollback")
DP_COMMS = ("none", "sdp4bit")            # data-parallel collectives (mscale_jax/sdp4bit/)
SDP4BIT_BITS = (2, 3, 4, 5, 6, 7, 8, 16, 32)   # integer codes; 16: bfloat16; 32: unquantized
SDP4BIT_WEIGHTS = ("differences", "weights", "none")
SDP4BIT_KERNELS = ("xla", "pallas")        # pallas: pallas_kernels/quantize.py


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """GPT decoder shape and the implementation choices read by `model.py`."""
  vocab_size: int = 256
  num_layers: int = 2
  hidden: int = 64
  num_heads: int = 4
  mlp_dim: int = 256
  seq_len: int = 64
  block: str = "parallel"            # parallel (PTB): x + attn(ln x) + mlp(ln x); or sequential
  norm: str = "layernorm"
  norm_impl: str = "xla"
  mlp_activation: str = "gelu"
  positions: str = "learned"
  attention_window: int | None = None   # query i sees keys j with i - w < j <= i
  attention_impl: str = "xla"
  tp_comm: str = "xla"               # collective-matmul strategy in parallel/tensor.py
  use_bias: bool = True
  tie_embeddings: bool = False
  scan_layers: bool = True
  remat: str = "none"
  dtype: str = "float32"             # compute dtype; parameters are always float32

  @property
  def head_dim(self) -> int:
    """Size of one attention head: hidden / num_heads."""
    return self.hidden // self.num_heads


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axes. One axis may be -1: it takes the devices the others leave.

  `shrink_to_fit` lets a small default job run on a machine with fewer devices (one GPU, say):
  tensor, then data, then fsdp are halved until the mesh fits (the trainer prints the mesh).
  """
  data: int = -1
  fsdp: int = 1
  stage: int = 1
  tensor: int = 1
  shrink_to_fit: bool = False

  def shape(self, num_devices: int) -> dict[str, int]:
    """The concrete {axis: size} for `num_devices` devices (raises ConfigError if impossible)."""
    sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
    if self.shrink_to_fit:
      for axis in ("tensor", "data", "fsdp"):
        while sizes[axis] > 1 and _fixed_product(sizes) > num_devices:
          sizes[axis] //= 2
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
      raise ConfigError(f"mesh.{free[1]}", -1, "at most one mesh axis may be -1")
    for axis, size in sizes.items():
      if size != -1 and size < 1:
        raise ConfigError(f"mesh.{axis}", size, "a positive size, or -1 for 'the rest'")
    fixed = _fixed_product(sizes)
    if free:
      if num_devices % fixed:
        raise ConfigError(f"mesh.{free[0]}", -1,
                          f"the other axes use {fixed} devices, which does not divide the "
                          f"{num_devices} devices present")
      sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
      raise ConfigError("mesh", {a: sizes[a] for a in MESH_AXES},
                        f"the mesh has {fixed} devices but {num_devices} are present; make the "
                        f"product of data*fsdp*stage*tensor equal {num_devices} or set one axis "
                        f"to -1")
    return sizes


def _fixed_product(sizes: dict[str, int]) -> int:
  product = 1
  for size in sizes.values():
    product *= max(size, 1)
  return product


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """Pipeline parallelism over mesh.stage (read by `parallel/pipeline.py` when stage > 1).

  Each data shard's batch is cut into `microbatches`; each stage holds `virtual_stages` model
  chunks (Megatron's interleaving: chunk c of stage s is the (c * stage + s)-th slice of the
  layers). `overlap` sends a tick's outputs while the next tick computes (MegaScale's PP
  overlap: a tick of latency per hop, which the schedule module's tables absorb).
  `recompute`: 'none' (default) stashes each chunk's backward residuals (per layer its input
  and its matmul outputs, never its weights) from its forward to its backward, so no matmul
  runs twice (~15% fewer FLOPs per step than 'full', more memory); 'full' stashes only chunk
  inputs and runs each chunk's forward again in its backward (the least memory: the choice
  where 'none' does not fit); 'selective' stashes the residuals but attention's and redoes
  attention's core (Megatron's selective recomputation). 'none' is the default as the faster
  where memory allows: on CPU 1F1B 'none' ran 1.02x and 1.07x of 'full''s tokens/s in the
  same rounds (results/pipeline_throughput-cpu-20261126T233652.json, ...233849.json), and it
  does less work on any device. 'zb_h1' splits the backward into the input gradient (B) and
  the weight gradient (W), which fills the bubbles.
  """
  schedule: str = "1f1b"
  microbatches: int = 4
  virtual_stages: int = 1
  overlap: bool = True
  recompute: str = "none"


@dataclasses.dataclass(frozen=True)
class SDP4BitConfig:
  """SDP4Bit's quantized data-parallel collectives (read by `mscale_jax/sdp4bit/`).

  The one set of SDP4Bit defaults (`perf.compressed.DPCompression` and
  `sdp4bit.quant.Quantizer` take theirs from here): the paper's, as its official repository
  (jindajia/SDP4Bit, ReadME.md: the defaults of the Megatron-LM flags) and the authors' later
  performance-test config (jindajia/Megatron-LM, sample_scripts/icml-performance-bytedance/
  training-config/SDP4Bit.sh) give them; each field names its flag. `weights` picks what the parameter all-gather quantizes:
  'differences' (qWD), 'weights' (the ablation: the weights themselves) or 'none' (exact);
  `gradients=False` reduces gradients exactly. Bits 16 send bfloat16, 32 float32.
  """
  weights: str = "differences"
  weight_bits: int = 4               # --weight-quantization-bits (default 4)
  weight_group: int = 2048           # --wq-group-size (default 2048)
  gradients: bool = True
  grad_bits_intra: int = 8           # --gradient-quantization-bits-intra (default 8)
  grad_bits_inter: int = 4           # --gradient-quantization-bits-inter (default 4)
  # One group for both levels: --gq-group-size-inter (default 128); the README's example and
  # SDP4Bit.sh set --gq-group-size-intra 128 as well (the flag's own default is 512).
  grad_group: int = 128
  # --hadamard-transform: the 'HS' of the paper's TLq-HS, part of SDP4Bit as the paper defines
  # it (the flag is off by default, and SDP4Bit.sh leaves it off).
  hadamard: bool = True
  kernel: str = "xla"                # quantize/dequantize (+Hadamard) in XLA or fused Pallas


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimizer, warmup + cosine schedule, clipping and weight decay (read by `optim.py`)."""
  name: str = "lamb"
  learning_rate: float = 3e-3
  warmup_steps: int = 10
  min_lr_ratio: float = 0.1          # cosine decays to learning_rate * min_lr_ratio
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-6
  weight_decay: float = 0.01         # not applied to norms and biases
  grad_clip: float | None = 1.0      # global-norm clipping; None disables
  # How gradients and parameters cross the data-parallel axes: 'none' leaves the collectives
  # to XLA (exact); 'sdp4bit' uses the quantized ones of the `sdp4bit` section.
  dp_comm: str = "none"
  sdp4bit: SDP4BitConfig = SDP4BitConfig()


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where tokens come from (read by `data.py`).

  kind='prepared' reads a folder written by `experiments/prepare_data.py`: its manifest gives
  the tokenizer, the token files and the held-out documents (heldout_fraction and token_dtype
  are then the manifest's, not these fields').
  """
  kind: str = "stdlib"               # stdlib: this machine's Python standard library source
  path: str | None = None            # token file ('tokens'), source folder ('stdlib') or
                                     # prepared folder ('prepared')
  token_dtype: str = "uint16"
  heldout_fraction: float = 0.02
  seed: int = 0
  prefetch: int = 2                  # batches prepared ahead of the step (background thread)
  # True: a token attends only to earlier tokens of its own document (segment ids from the
  # end-of-document tokens, as MaxText packs); False: windows attend across documents.
  document_mask: bool = False


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop length, batch, logging, evaluation and checkpoint cadence (read by `train.py`)."""
  steps: int = 100
  global_batch: int = 8              # sequences per step, over all devices
  seed: int = 0
  log_every: int = 10
  eval_every: int = 50
  eval_batches: int = 2
  checkpoint_every: int = 50
  keep_checkpoints: int = 2
  async_checkpoint: bool = True
  # A save the file system refuses (read-only, full) is dropped and training goes on; this many
  # refused in a row stop the run (CheckpointWriteError), as every refusal did before.
  max_refused_saves: int = 3
  # Before each save, check that replicated arrays hold the same bits on every replica
  # (mscale_jax/replicas.py); if not, the save is refused and the run stops.
  check_replicas: bool = True
  # A step with a non-finite loss or gradient norm never updates the state; then: stop (exit
  # with status 3), skip_step (go on with the next batch) or rollback (restore the latest
  # checkpoint and skip the batches from there through the offending one).
  on_nonfinite: str = "stop"
  timeline: bool = True              # per-rank span timeline in WORKDIR/timeline (resilience/)
  profile_steps: str = ""            # 'START:END': a jax.profiler trace of steps START..END


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole run."""
  name: str = "run"
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  pipeline: PipelineConfig = PipelineConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()

  @classmethod
  def from_dict(cls, tree: dict[str, Any]) -> "Config":
    """Builds a Config from nested dicts (e.g. `ConfigDict.to_dict()`); unknown keys raise."""
    return _from_dict(cls, tree, prefix="")

  def to_dict(self) -> dict[str, Any]:
    """Nested plain dicts (for JSON records and checkpoints)."""
    return dataclasses.asdict(self)

  def replace(self, **sections) -> "Config":
    """A copy with some sections replaced by dicts of field overrides, e.g. model={'block': ...}."""
    out = self
    for section, overrides in sections.items():
      out = dataclasses.replace(out, **{section: dataclasses.replace(getattr(out, section),
                                                                      **overrides)})
    return out


def _from_dict(cls, tree, prefix):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  kwargs = {}
  for key, value in tree.items():
    if key not in fields:
      raise ConfigError(f"{prefix}{key}", value,
                        f"unknown field; valid fields of {prefix or 'config'}: "
                        f"{', '.join(fields)}")
    default = fields[key].default
    if dataclasses.is_dataclass(default):
      if not isinstance(value, dict):
        raise ConfigError(f"{prefix}{key}", value, "a section of fields (a dict)")
      value = _from_dict(type(default), value, prefix=f"{prefix}{key}.")
    kwargs[key] = value
  return cls(**kwargs)


def _choice(field: str, value, valid: tuple) -> None:
  if value not in valid:
    raise ConfigError(field, value, f"one of {', '.join(map(repr, valid))}")


def _positive(field: str, value) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ConfigError(field, value, "a positive integer")


def _divides(field: str, value: int, axis: str, size: int, what: str) -> None:
  if value % size:
    raise ConfigError(field, value, f"{what} must be divisible by mesh.{axis}={size}")


def validate(config: Config, num_devices: int, *,
             platform: str | None = None) -> dict[str, int]:
  """Checks `config` for `num_devices` devices; returns the concrete mesh shape.

  `platform` ('cpu', 'gpu', 'tpu') enables checks of platform-specific choices. Long on
  purpose: one flat check per field, in the order of the config, so that the first bad field
  is the one reported.

  Raises:
    ConfigError: naming the first field whose value cannot work, and what would be valid.
  """
  m, o, d, t = config.model, config.optimizer, config.data, config.train
  for field in ("num_layers", "hidden", "num_heads", "mlp_dim", "seq_len", "vocab_size"):
    _positive(f"model.{field}", getattr(m, field))
  _choice("model.block", m.block, BLOCKS)
  _choice("model.norm", m.norm, NORMS)
  _choice("model.norm_impl", m.norm_impl, NORM_IMPLS)
  _choice("model.mlp_activation", m.mlp_activation, ACTIVATIONS)
  _choice("model.positions", m.positions, POSITIONS)
  _choice("model.attention_impl", m.attention_impl, ATTENTION_IMPLS)
  _choice("model.tp_comm", m.tp_comm, TP_COMMS)
  _choice("model.remat", m.remat, REMATS)
  _choice("model.dtype", m.dtype, DTYPES)
  _check_platform_kernels(m, platform)
  if m.hidden % m.num_heads:
    raise ConfigError("model.hidden", m.hidden,
                      f"must be divisible by model.num_heads={m.num_heads}")
  if m.positions == "rotary" and m.head_dim % 2:
    raise ConfigError("model.hidden", m.hidden, "rotary positions need an even head_dim")
  if m.attention_window is not None:
    if isinstance(m.attention_window, bool) or not isinstance(m.attention_window, int) \
        or m.attention_window < 1:
      raise ConfigError("model.attention_window", m.attention_window,
                        "None (full causal attention) or an integer >= 1")
  _choice("optimizer.name", o.name, OPTIMIZERS)
  if not o.learning_rate > 0:
    raise ConfigError("optimizer.learning_rate", o.learning_rate, "a positive number")
  if o.warmup_steps < 0:
    raise ConfigError("optimizer.warmup_steps", o.warmup_steps, "an integer >= 0")
  if o.grad_clip is not None and not o.grad_clip > 0:
    raise ConfigError("optimizer.grad_clip", o.grad_clip, "None or a positive number")
  for field in ("b1", "b2"):
    if not 0.0 <= getattr(o, field) < 1.0:
      raise ConfigError(f"optimizer.{field}", getattr(o, field), "a number in [0, 1)")
  if not o.eps > 0:
    raise ConfigError("optimizer.eps", o.eps, "a positive number")
  if not o.weight_decay >= 0:
    raise ConfigError("optimizer.weight_decay", o.weight_decay, "a number >= 0")
  if not 0.0 <= o.min_lr_ratio <= 1.0:
    raise ConfigError("optimizer.min_lr_ratio", o.min_lr_ratio, "a fraction in [0, 1]")
  _check_dp_comm(o)
  _choice("data.kind", d.kind, DATA_KINDS)
  _choice("data.token_dtype", d.token_dtype, TOKEN_DTYPES)
  if d.kind == "tokens" and not d.path:
    raise ConfigError("data.path", d.path, "a token file is required when data.kind='tokens'")
  if d.kind == "prepared" and not d.path:
    raise ConfigError("data.path", d.path, "a folder written by experiments/prepare_data.py "
                      "is required when data.kind='prepared'")
  if not 0.0 < d.heldout_fraction < 1.0:
    raise ConfigError("data.heldout_fraction", d.heldout_fraction, "a fraction in (0, 1)")
  _choice("train.on_nonfinite", t.on_nonfinite, NONFINITE_POLICIES)
  for field in ("steps", "global_batch", "log_every", "eval_every", "eval_batches",
                "checkpoint_every", "keep_checkpoints", "max_refused_saves"):
    _positive(f"train.{field}", getattr(t, field))
  if t.steps <= o.warmup_steps:
    raise ConfigError("train.steps", t.steps,
                      f"must exceed optimizer.warmup_steps={o.warmup_steps}")
  for field in ("eval_every", "checkpoint_every"):
    # Both happen on logged steps, so that step timings leave them out.
    if getattr(t, field) % t.log_every:
      raise ConfigError(f"train.{field}", getattr(t, field),
                        f"a multiple of train.log_every={t.log_every}")

  profile_window(t.profile_steps, t.steps)

  mesh = config.mesh.shape(num_devices)
  tp = mesh["tensor"]
  _divides("model.num_heads", m.num_heads, "tensor", tp, "attention heads")
  _divides("model.vocab_size", m.vocab_size, "tensor", tp, "the vocabulary (embedding rows)")
  _divides("model.hidden", m.hidden, "fsdp", mesh["fsdp"],
           "the hidden size (parameters are sharded on it over fsdp)")
  _divides("model.mlp_dim", m.mlp_dim, "tensor", tp, "the MLP size")
  _divides("model.seq_len", m.seq_len, "tensor", tp,
           "the sequence length (sequence parallelism shards it)")
  batch_shards = mesh["data"] * mesh["fsdp"]
  if t.global_batch % batch_shards:
    raise ConfigError("train.global_batch", t.global_batch,
                      f"must be divisible by mesh.data*mesh.fsdp={batch_shards}")
  if o.dp_comm == "sdp4bit":
    for axis in ("stage", "tensor"):
      if mesh[axis] > 1:
        raise ConfigError(f"mesh.{axis}", mesh[axis],
                          "1 with optimizer.dp_comm='sdp4bit': its collectives run over the "
                          "data-parallel axes (data, fsdp) only")
  microbatches = _check_pipeline(config, mesh)
  _check_document_mask(config, mesh)
  if m.tp_comm == "pallas":
    # The ring kernel moves whole row tiles: 8 rows of float32, 16 of bfloat16 per device.
    rows = t.global_batch // batch_shards // microbatches * m.seq_len // tp
    tile = 8 if m.dtype == "float32" else 16
    if rows % tile:
      raise ConfigError("model.tp_comm", m.tp_comm,
                        f"the Pallas ring needs each device's rows (batch/(data*fsdp)"
                      f"{'/pipeline.microbatches' if microbatches > 1 else ''} * "
                        f"seq_len/tensor = {rows}) to be a multiple of {tile} in {m.dtype}; "
                        f"change the batch or seq_len, or use 'ppermute'")
  return mesh


def _check_dp_comm(o: OptimizerConfig) -> None:
  """optimizer.dp_comm and, when it is 'sdp4bit', its bit widths and group sizes."""
  _choice("optimizer.dp_comm", o.dp_comm, DP_COMMS)
  if o.dp_comm != "sdp4bit":
    return
  q = o.sdp4bit
  _choice("optimizer.sdp4bit.weights", q.weights, SDP4BIT_WEIGHTS)
  _choice("optimizer.sdp4bit.kernel", q.kernel, SDP4BIT_KERNELS)
  for field in ("weight_bits", "grad_bits_intra", "grad_bits_inter"):
    if getattr(q, field) not in SDP4BIT_BITS or isinstance(getattr(q, field), bool):
      raise ConfigError(f"optimizer.sdp4bit.{field}", getattr(q, field),
                        f"one of {', '.join(map(str, SDP4BIT_BITS))} (2-8: integer codes, "
                        f"16: bfloat16, 32: unquantized)")
  for field in ("weight_group", "grad_group"):
    size = getattr(q, field)
    if not isinstance(size, int) or isinstance(size, bool) or size < 2 or size & (size - 1):
      raise ConfigError(f"optimizer.sdp4bit.{field}", size,
                        "a power of two >= 2 (values per quantization group and Hadamard "
                        "block)")
  for field in ("gradients", "hadamard"):
    if not isinstance(getattr(q, field), bool):
      raise ConfigError(f"optimizer.sdp4bit.{field}", getattr(q, field), "True or False")


def _check_pipeline(config: Config, mesh: dict[str, int]) -> int:
  """Pipeline fields when mesh.stage > 1; returns the microbatches per step (1 without)."""
  p, m, t = config.pipeline, config.model, config.train
  stages = mesh["stage"]
  if stages == 1:
    return 1
  _choice("pipeline.schedule", p.schedule, PIPELINE_SCHEDULES)
  _choice("pipeline.recompute", p.recompute, PIPELINE_RECOMPUTE)
  _positive("pipeline.microbatches", p.microbatches)
  _positive("pipeline.virtual_stages", p.virtual_stages)
  if not m.scan_layers:
    raise ConfigError("model.scan_layers", m.scan_layers,
                      f"True with mesh.stage={stages}: the pipeline cuts the stacked layers")
  if p.schedule in ("1f1b", "zb_h1") and p.virtual_stages != 1:
    raise ConfigError("pipeline.virtual_stages", p.virtual_stages,
                      f"1 with schedule '{p.schedule}' (use 'interleaved_1f1b' or 'gpipe' for "
                      f"more model chunks per stage)")
  chunks = stages * p.virtual_stages
  if m.num_layers % chunks:
    raise ConfigError("model.num_layers", m.num_layers,
                      f"must be divisible by mesh.stage * pipeline.virtual_stages = {stages} * "
                      f"{p.virtual_stages} = {chunks} (layers per model chunk)")
  if p.schedule == "interleaved_1f1b" and p.microbatches % stages:
    raise ConfigError("pipeline.microbatches", p.microbatches,
                      f"a multiple of mesh.stage={stages}: 'interleaved_1f1b' runs "
                      f"microbatches in groups of one per stage")
  per_shard = t.global_batch // (mesh["data"] * mesh["fsdp"])
  if per_shard % p.microbatches:
    raise ConfigError("pipeline.microbatches", p.microbatches,
                      f"must divide each data shard's batch, train.global_batch / "
                      f"(mesh.data * mesh.fsdp) = {per_shard}")
  return p.microbatches


def _check_document_mask(config: Config, mesh: dict[str, int]) -> None:
  """data.document_mask needs document boundaries and an attention path that takes segments."""
  d, m = config.data, config.model
  if not isinstance(d.document_mask, bool):
    raise ConfigError("data.document_mask", d.document_mask, "True or False")
  if not d.document_mask:
    return
  if d.kind not in DOCUMENT_KINDS:
    raise ConfigError("data.document_mask", True, f"False with data.kind={d.kind!r}, which has "
                      f"no document boundaries; True needs one of {', '.join(DOCUMENT_KINDS)}")
  if m.attention_impl != "xla":
    raise ConfigError("model.attention_impl", m.attention_impl,
                      "'xla' with data.document_mask=True: the flash-attention kernels take "
                      "no segment ids")
  if mesh["stage"] > 1:
    raise ConfigError("mesh.stage", mesh["stage"],
                      "1 with data.document_mask=True: the pipeline executor does not carry "
                      "segment ids between stages")


def profile_window(spec: str, steps: int) -> tuple[int, int] | None:
  """(first, last) step of train.profile_steps='START:END' (inclusive), or None when empty."""
  if not spec:
    return None
  first, sep, last = str(spec).partition(":")
  try:
    window = (int(first), int(last)) if sep else None
  except ValueError:
    window = None
  if window is None or not 1 <= window[0] <= window[1] <= steps:
    raise ConfigError("train.profile_steps", spec, f"'START:END' with 1 <= START <= END <= "
                      f"train.steps={steps}, e.g. '5:7' (or '' for no profile)")
  return window


def _check_platform_kernels(m: ModelConfig, platform: str | None) -> None:
  """Kernel choices that only some platforms support (checked when the platform is known)."""
  if platform is None:
    return
  if m.attention_impl == "cudnn":
    if platform != "gpu":
      raise ConfigError("model.attention_impl", m.attention_impl,
                        f"'cudnn' needs an NVIDIA GPU but the devices are {platform}; use "
                        f"'xla' or 'pallas'")
    if m.dtype != "bfloat16":
      raise ConfigError("model.dtype", m.dtype, "'bfloat16' with attention_impl='cudnn' "
                        "(cuDNN flash attention has no float32 kernel)")
    if m.head_dim % 8 or m.head_dim > 128:
      raise ConfigError("model.hidden", m.hidden,
                        f"cuDNN attention needs head_dim = hidden/num_heads a multiple of 8 "
                        f"and at most 128 (here {m.head_dim})")
  if m.tp_comm == "pallas" and platform == "gpu":
    raise ConfigError("model.tp_comm", m.tp_comm,
                      "the Pallas collective matmul is a TPU-style kernel (remote DMAs); on "
                      "GPU use 'ppermute' (XLA overlaps its async collective-permutes)")
