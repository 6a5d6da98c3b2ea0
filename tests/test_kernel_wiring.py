"""The Pallas kernels plugged into the model through config fields give the XLA numbers."""
import os
import subprocess
import sys

import jax
import pytest

from mscale_jax.config import Config, ModelConfig, validate
from mscale_jax.errors import ConfigError
from test_model import loss_and_grads, max_rel_err

MESH = dict(data=2, fsdp=1, stage=1, tensor=4)
BASE = dict(num_layers=1, hidden=32, num_heads=4, mlp_dim=64, seq_len=32, attention_window=12)


@pytest.mark.parametrize("kernels,norm", [
    pytest.param(dict(attention_impl="pallas"), "layernorm", marks=pytest.mark.slow),
    (dict(norm_impl="pallas"), "layernorm"),
    pytest.param(dict(norm_impl="pallas"), "rmsnorm", marks=pytest.mark.slow),
])
def test_pallas_kernels_in_the_model_match_xla(kernels, norm):
  tokens = jax.random.randint(jax.random.key(4), (4, BASE["seq_len"] + 1), 0, 256)
  ref_loss, ref_grads = loss_and_grads(ModelConfig(**BASE, norm=norm), MESH, tokens)
  loss, grads = loss_and_grads(ModelConfig(**BASE, norm=norm, **kernels), MESH, tokens)
  assert abs(loss - ref_loss) / ref_loss < 1e-5
  assert max_rel_err(ref_grads, grads) < 1e-5


def test_cudnn_attention_off_gpu_is_a_config_error():
  config = Config().replace(model=dict(attention_impl="cudnn"))
  with pytest.raises(ConfigError, match="model.attention_impl='cudnn'.*needs an NVIDIA GPU"):
    validate(config, 8, platform="cpu")


def test_kernels_import_nothing_from_the_library():
  """Layers only point down: every kernel module loads without importing mscale_jax."""
  code = ("import sys\n"
          "import pallas_kernels.collective_matmul, pallas_kernels.flash_attention\n"
          "import pallas_kernels.layer_norm, pallas_kernels.lamb\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mscale_jax'))")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"
