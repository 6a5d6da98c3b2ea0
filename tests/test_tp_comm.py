"""The model gives the same numbers with every collective-matmul strategy (config.model.tp_comm).

All `slow` (whole-model compiles, three strategies each): the fast tier tests the strategies
themselves in test_collective_matmul.py, down to the tensor-parallel layer."""

import jax
import numpy as np
import pytest

from mscale_jax.config import ModelConfig
from mscale_jax.train import Trainer
from test_model import loss_and_grads, max_rel_err

MESH = dict(data=2, fsdp=1, stage=1, tensor=4)


@pytest.mark.slow
@pytest.mark.parametrize("block", ["parallel", "sequential"])
def test_loss_and_grads_match_xla(block):
  def config(tp_comm):
    return ModelConfig(num_layers=1, hidden=32, num_heads=4, mlp_dim=64, seq_len=16,
                       block=block, attention_window=6, tp_comm=tp_comm)
  tokens = jax.random.randint(jax.random.key(3), (4, 17), 0, 256)
  ref_loss, ref_grads = loss_and_grads(config("xla"), MESH, tokens)
  for tp_comm in ("ppermute", "pallas"):
    loss, grads = loss_and_grads(config(tp_comm), MESH, tokens)
    assert abs(loss - ref_loss) / ref_loss < 1e-5, tp_comm
    assert max_rel_err(ref_grads, grads) < 1e-5, tp_comm


@pytest.mark.slow
def test_ten_training_steps_follow_the_same_curve(tiny_config, tmp_path):
  # The trainer's own step on its own batches, without the loop's evaluation and saves.
  curves = {}
  for tp_comm in ("xla", "ppermute", "pallas"):
    config = tiny_config(model=dict(num_layers=1, tp_comm=tp_comm),
                         train=dict(steps=10, log_every=1, eval_every=10, checkpoint_every=10))
    trainer = Trainer(config, tmp_path / tp_comm, show_progress=False)
    state, losses = trainer.init_state(), []
    for _ in range(10):
      state, metrics = trainer.train_step(state, next(trainer.train_iter))
      losses.append(float(metrics["loss"]))
    trainer.train_iter.close()
    curves[tp_comm] = np.array(losses)
  assert len(curves["xla"]) == 10 and curves["xla"][-1] < curves["xla"][0]
  for tp_comm in ("ppermute", "pallas"):
    np.testing.assert_allclose(curves[tp_comm], curves["xla"], rtol=2e-5)
