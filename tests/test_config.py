"""mscale_jax.config and experiments/configs: every ConfigError names field, value and the fix."""
import importlib
import pathlib

import pytest
from absl import flags
from ml_collections import config_flags

from mscale_jax.config import Config, MeshConfig, validate
from mscale_jax.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs"
CONFIG_NAMES = ("gpt_tiny", "gpt_125m", "gpt_1p3b", "gpt_175b", "gpt_530b")
SINGLE_DEVICE = {"gpt_tiny": 8, "gpt_125m": 1, "gpt_1p3b": 1}


def _raises(config: Config, num_devices: int, field: str, value, *valid_words: str):
  """Asserts validate() fails on `field`=`value`, and the message says what is valid."""
  with pytest.raises(ConfigError) as info:
    validate(config, num_devices)
  err = info.value
  assert (err.field, err.value) == (field, value), str(err)
  message = str(err)
  assert field in message and repr(value) in message, message
  for word in valid_words:
    assert word in err.valid, message
  return err


def _load(name: str) -> Config:
  module = importlib.import_module(f"experiments.configs.{name}")
  return Config.from_dict(module.get_config().to_dict())


def test_default_config_is_valid_on_8_devices():
  assert validate(Config(), 8) == {"data": 8, "fsdp": 1, "stage": 1, "tensor": 1}


def test_mesh_size_must_match_device_count():
  config = Config().replace(mesh={"data": 2, "tensor": 2})
  err = _raises(config, 8, "mesh", {"data": 2, "fsdp": 1, "stage": 1, "tensor": 2},
                "4 devices but 8 are present", "-1")
  assert "equal 8" in err.valid


def test_mesh_with_two_free_axes():
  config = Config().replace(mesh={"data": -1, "fsdp": -1})
  _raises(config, 8, "mesh.fsdp", -1, "at most one mesh axis may be -1")


def test_free_axis_must_divide_devices():
  config = Config().replace(mesh={"data": -1, "tensor": 3}, model={"num_heads": 3, "hidden": 48})
  _raises(config, 8, "mesh.data", -1, "other axes use 3 devices", "8 devices")


@pytest.mark.parametrize("size", [0, -2])
def test_mesh_axis_must_be_positive(size):
  config = Config().replace(mesh={"data": -1, "tensor": size})
  _raises(config, 8, "mesh.tensor", size, "positive size, or -1")


def test_heads_not_divisible_by_tensor():
  config = Config().replace(mesh={"data": 2, "tensor": 4}, model={"num_heads": 6, "hidden": 96})
  _raises(config, 8, "model.num_heads", 6, "attention heads", "mesh.tensor=4")


def test_hidden_not_divisible_by_heads():
  config = Config().replace(model={"hidden": 66})
  _raises(config, 8, "model.hidden", 66, "model.num_heads=4")


def test_mlp_not_divisible_by_tensor():
  config = Config().replace(mesh={"data": 2, "tensor": 4}, model={"mlp_dim": 250})
  _raises(config, 8, "model.mlp_dim", 250, "MLP size", "mesh.tensor=4")


def test_seq_len_not_divisible_by_tensor():
  config = Config().replace(mesh={"data": 2, "tensor": 4}, model={"seq_len": 66})
  _raises(config, 8, "model.seq_len", 66, "sequence length", "mesh.tensor=4")


def test_global_batch_not_divisible_by_data_times_fsdp():
  config = Config().replace(mesh={"data": 2, "fsdp": 2, "tensor": 2}, train={"global_batch": 6})
  _raises(config, 8, "train.global_batch", 6, "mesh.data*mesh.fsdp=4")


@pytest.mark.parametrize("window", [0, -3, True])
def test_attention_window_below_one(window):
  config = Config().replace(model={"attention_window": window})
  _raises(config, 8, "model.attention_window", window, "None", ">= 1")


@pytest.mark.parametrize("section,field,valid", [
    ("model", "block", "'parallel', 'sequential'"),
    ("model", "norm", "'layernorm', 'rmsnorm'"),
    ("model", "mlp_activation", "'gelu', 'swiglu'"),
    ("model", "attention_impl", "'xla', 'pallas', 'cudnn'"),
    ("model", "tp_comm", "'xla', 'ppermute', 'pallas'"),
    ("optimizer", "name", "'adamw', 'lamb', 'lamb_fused'"),
])
def test_unknown_names(section, field, valid):
  config = Config().replace(**{section: {field: "nope"}})
  _raises(config, 8, f"{section}.{field}", "nope", valid)


def test_from_dict_rejects_unknown_nested_field():
  with pytest.raises(ConfigError) as info:
    Config.from_dict({"model": {"hidden": 64, "hiden": 32}})
  err = info.value
  assert (err.field, err.value) == ("model.hiden", 32)
  assert "valid fields of model." in err.valid and "hidden" in err.valid
  assert "model.hiden=32" in str(err)


def test_from_dict_rejects_unknown_section():
  with pytest.raises(ConfigError) as info:
    Config.from_dict({"modle": {}})
  assert info.value.field == "modle" and "model" in info.value.valid


def test_shrink_to_fit_down_to_one_device():
  mesh = MeshConfig(data=2, tensor=4, shrink_to_fit=True)
  assert mesh.shape(1) == {"data": 1, "fsdp": 1, "stage": 1, "tensor": 1}
  assert mesh.shape(2) == {"data": 2, "fsdp": 1, "stage": 1, "tensor": 1}
  assert mesh.shape(8) == {"data": 2, "fsdp": 1, "stage": 1, "tensor": 4}
  config = Config().replace(mesh={"data": 2, "tensor": 4, "shrink_to_fit": True})
  assert validate(config, 1) == {"data": 1, "fsdp": 1, "stage": 1, "tensor": 1}


def test_without_shrink_to_fit_one_device_is_an_error():
  config = Config().replace(mesh={"data": 2, "tensor": 4})
  _raises(config, 1, "mesh", {"data": 2, "fsdp": 1, "stage": 1, "tensor": 4},
          "8 devices but 1 are present")


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_file_loads_and_documents_its_command(name):
  module = importlib.import_module(f"experiments.configs.{name}")
  assert "python -m experiments.train" in module.__doc__
  assert f"experiments/configs/{name}.py" in module.__doc__
  config = _load(name)
  assert config.name == name


@pytest.mark.parametrize("name,num_devices", sorted(SINGLE_DEVICE.items()))
def test_config_file_validates(name, num_devices):
  validate(_load(name), num_devices)


def test_gpt_tiny_mesh_and_shrink():
  config = _load("gpt_tiny")
  assert validate(config, 8) == {"data": 2, "fsdp": 1, "stage": 1, "tensor": 4}
  assert validate(config, 1) == {"data": 1, "fsdp": 1, "stage": 1, "tensor": 1}
  assert config.model.block == "parallel" and config.optimizer.name == "lamb"
  assert 1 <= config.model.attention_window < config.model.seq_len


@pytest.mark.parametrize("name,layers,hidden,heads,stage,gpus", [
    ("gpt_175b", 96, 12288, 128, 8, 256),
    ("gpt_530b", 105, 20480, 160, 35, 2240),
])
def test_paper_table1_shapes(name, layers, hidden, heads, stage, gpus):
  config = _load(name)
  m = config.model
  assert (m.num_layers, m.hidden, m.num_heads, m.mlp_dim) == (layers, hidden, heads, 4 * hidden)
  assert (m.seq_len, m.vocab_size, m.block, m.remat) == (2048, 64000, "parallel", "full")
  assert config.mesh.shape(gpus) == {"data": gpus // (8 * stage), "fsdp": 1, "stage": stage,
                                     "tensor": 8}
  assert validate(config, gpus)["stage"] == stage


def _parse(*overrides: str, config: str = "gpt_tiny"):
  """Parses argv as absl would; the override flags are defined from `sys_argv`."""
  argv = ["prog", f"--config={CONFIG_DIR / config}.py", *overrides]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  return flag_values.config


def test_command_line_overrides():
  cd = _parse("--config.model.attention_window=8", "--config.mesh.tensor=2",
              "--config.model.block=sequential", "--config.train.steps=100",
              "--config.optimizer.learning_rate=1e-3")
  config = Config.from_dict(cd.to_dict())
  assert config.model.attention_window == 8
  assert config.mesh.tensor == 2 and config.mesh.data == 2
  assert config.model.block == "sequential"
  assert config.train.steps == 100 and config.optimizer.learning_rate == 1e-3
  assert validate(config, 4) == {"data": 2, "fsdp": 1, "stage": 1, "tensor": 2}


def test_command_line_sets_none_placeholders():
  cd = _parse("--config.model.attention_window=256", "--config.data.kind=tokens",
              "--config.data.path=/tmp/tokens.bin", config="gpt_125m")
  config = Config.from_dict(cd.to_dict())
  assert config.model.attention_window == 256
  assert (config.data.kind, config.data.path) == ("tokens", "/tmp/tokens.bin")
  assert _load("gpt_125m").model.attention_window is None


def test_command_line_cannot_say_none_but_has_equivalents():
  # absl parses "None" as a literal for typed fields; full attention and no clipping have
  # spellings that parse: a window of seq_len, and an infinite clip norm.
  with pytest.raises(flags.IllegalFlagValueError):
    _parse("--config.optimizer.grad_clip=None")
  cd = _parse("--config.optimizer.grad_clip=inf", "--config.model.attention_window=128")
  config = Config.from_dict(cd.to_dict())
  assert config.optimizer.grad_clip == float("inf")
  assert config.model.attention_window == config.model.seq_len
  validate(config, 8)


def test_command_line_rejects_unknown_field():
  with pytest.raises(AttributeError, match='Did you mean "hidden"'):
    _parse("--config.model.hiden=3")


def test_vocab_not_divisible_by_tensor():
  config = Config().replace(mesh={"data": 2, "tensor": 4}, model={"vocab_size": 250})
  _raises(config, 8, "model.vocab_size", 250, "vocabulary", "mesh.tensor=4")


def test_hidden_not_divisible_by_fsdp():
  config = Config().replace(mesh={"data": 1, "fsdp": 8},
                            model={"hidden": 68, "num_heads": 4})
  _raises(config, 8, "model.hidden", 68, "mesh.fsdp=8")


def test_steps_must_exceed_warmup():
  config = Config().replace(train={"steps": 5}, optimizer={"warmup_steps": 5})
  _raises(config, 8, "train.steps", 5, "optimizer.warmup_steps=5")


def test_from_dict_rejects_a_section_that_is_not_a_dict():
  with pytest.raises(ConfigError, match="model=3"):
    Config.from_dict({"model": 3})


@pytest.mark.parametrize("value", [0, -2])
def test_max_refused_saves_is_at_least_one(value):
  _raises(Config().replace(train={"max_refused_saves": value}), 8, "train.max_refused_saves",
          value, "positive integer")


def test_eval_and_checkpoint_fall_on_logged_steps():
  _raises(Config().replace(train={"log_every": 10, "eval_every": 25}), 8,
          "train.eval_every", 25, "train.log_every=10")
  _raises(Config().replace(train={"log_every": 10, "eval_every": 50, "checkpoint_every": 15}),
          8, "train.checkpoint_every", 15, "train.log_every=10")


@pytest.mark.parametrize("field,value", [("b1", 1.0), ("b2", -0.1), ("eps", 0.0),
                                         ("weight_decay", -1e-3), ("min_lr_ratio", 1.5)])
def test_optimizer_hyperparameters_out_of_range(field, value):
  _raises(Config().replace(optimizer={field: value}), 8, f"optimizer.{field}", value)


def test_gpu_only_and_tpu_style_kernels_are_checked_per_platform():
  validate(Config().replace(model={"tp_comm": "pallas"}, train={"global_batch": 8}), 1,
           platform="cpu")
  with pytest.raises(ConfigError, match="model.tp_comm='pallas'.*TPU-style"):
    validate(Config().replace(model={"tp_comm": "pallas"}), 1, platform="gpu")
  with pytest.raises(ConfigError, match="model.dtype='float32'.*bfloat16"):
    validate(Config().replace(model={"attention_impl": "cudnn"}), 1, platform="gpu")
  validate(Config().replace(model={"attention_impl": "cudnn", "dtype": "bfloat16"}), 1,
           platform="gpu")


def test_pallas_ring_needs_whole_row_tiles():
  config = Config().replace(model={"tp_comm": "pallas", "seq_len": 12, "num_heads": 4},
                            mesh={"data": 2, "tensor": 4}, train={"global_batch": 2})
  _raises(config, 8, "model.tp_comm", "pallas", "multiple of 8")


def test_layers_must_divide_into_stages():
  config = Config().replace(model={"num_layers": 5}, mesh={"data": 1, "stage": 2})
  with pytest.raises(ConfigError, match="model.num_layers=5"):
    validate(config, 2)


# ----------------------------------------------------------------------------- pipeline


def _pipelined(**pipeline):
  return Config().replace(model=dict(num_layers=4), mesh=dict(data=2, stage=2, tensor=2),
                          train=dict(global_batch=8), pipeline=pipeline)


def test_pipeline_config_is_valid_on_8_devices():
  assert validate(_pipelined(schedule="interleaved_1f1b", virtual_stages=2, microbatches=4),
                  8) == {"data": 2, "fsdp": 1, "stage": 2, "tensor": 2}


def test_layers_not_divisible_by_stages_times_virtual():
  _raises(_pipelined(schedule="interleaved_1f1b", virtual_stages=4, microbatches=2), 8,
          "model.num_layers", 4, "mesh.stage * pipeline.virtual_stages", "8")


def test_interleaved_needs_microbatches_a_multiple_of_stages():
  _raises(_pipelined(schedule="interleaved_1f1b", virtual_stages=2, microbatches=1), 8,
          "pipeline.microbatches", 1, "multiple of mesh.stage=2")


def test_microbatches_must_divide_the_per_shard_batch():
  _raises(_pipelined(schedule="1f1b", microbatches=3), 8, "pipeline.microbatches", 3,
          "data shard's batch", "4")


@pytest.mark.parametrize("pipeline,field,value,words", [
    (dict(schedule="zero_bubble"), "pipeline.schedule", "zero_bubble", ("interleaved_1f1b",)),
    (dict(schedule="1f1b", virtual_stages=2, microbatches=2), "pipeline.virtual_stages", 2,
     ("interleaved_1f1b",)),
    (dict(schedule="zb_h1", virtual_stages=2, microbatches=2), "pipeline.virtual_stages", 2,
     ("1 with schedule 'zb_h1'",)),
    (dict(microbatches=0), "pipeline.microbatches", 0, ("positive",)),
])
def test_schedule_that_cannot_run_the_stages(pipeline, field, value, words):
  _raises(_pipelined(**pipeline), 8, field, value, *words)


def test_config_schedules_are_the_tables():
  """config.py lists the schedules without importing parallel/ (it sits below it)."""
  from mscale_jax.config import PIPELINE_SCHEDULES
  from mscale_jax.parallel.schedule import SCHEDULES
  assert PIPELINE_SCHEDULES == SCHEDULES


def test_pipeline_needs_stacked_layers():
  config = _pipelined(schedule="1f1b", microbatches=2).replace(model=dict(scan_layers=False))
  _raises(config, 8, "model.scan_layers", False, "stacked layers")


def test_pipeline_fields_are_ignored_without_stages():
  config = Config().replace(pipeline=dict(schedule="zero_bubble", microbatches=3))
  assert validate(config, 8)["stage"] == 1
