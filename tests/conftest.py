"""Every test sees 8 simulated CPU devices: enough for any data x fsdp x stage x tensor layout.

Test shapes are tiny, so compilation dominates: XLA:CPU compiles without its expensive LLVM
optimisations, which halves the suite's time and changes no result beyond float rounding.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0"
                           " --xla_llvm_disable_expensive_passes=true").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture
def tiny_config():
  """A factory for small, fast run configs: `tiny_config(model={...}, mesh={...}, ...)`."""
  from mscale_jax.config import Config

  def make(**sections):
    base = Config(name="test").replace(
        model=dict(num_layers=2, hidden=32, num_heads=4, mlp_dim=64, seq_len=32,
                   attention_window=8),
        mesh=dict(data=2, tensor=4),
        optimizer=dict(warmup_steps=2),
        data=dict(kind="stdlib", prefetch=0),
        train=dict(steps=6, global_batch=4, log_every=2, eval_every=6, eval_batches=1,
                   checkpoint_every=4, async_checkpoint=True))
    return base.replace(**sections)

  return make
