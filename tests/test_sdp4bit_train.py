"""SDP4Bit in the Trainer: 'none' leaves the step alone, full precision equals 'none', the
reference weights resume bitwise, and checkpoints restore across dp_comm settings."""
import functools

import jax
import numpy as np
import pytest

from mscale_jax import step as step_lib
from mscale_jax.config import SDP4BitConfig
from mscale_jax.train import Trainer

MESH = dict(data=2, fsdp=4, tensor=1)


def _config(tiny_config, steps=4, **optimizer):
  if isinstance(optimizer.get("sdp4bit"), dict):
    optimizer["sdp4bit"] = SDP4BitConfig(**optimizer["sdp4bit"])
  return tiny_config(mesh=MESH, optimizer=dict(warmup_steps=2, **optimizer),
                     train=dict(steps=steps, global_batch=8, log_every=2, eval_every=2 * steps,
                                checkpoint_every=2, async_checkpoint=False, timeline=False))


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _lowered(trainer, train_step):
  state = trainer.init_state()
  batch = trainer.device_batch(next(trainer.train_iter))
  with jax.set_mesh(trainer.mesh):
    return train_step.lower(state, batch).as_text()


def test_dp_comm_none_lowers_the_step_built_without_it(tiny_config, tmp_path):
  """With the default 'none', the Trainer's step is the step as built before SDP4Bit existed
  (no gather argument, no reference weights): the same program text, with no all-to-all."""
  trainer = Trainer(_config(tiny_config), tmp_path, show_progress=False)
  assert trainer.data_parallel is None and "reference" not in trainer.state_shardings
  gradients = step_lib.make_gradients(trainer.graphdef, trainer.config.pipeline,
                                      trainer.layer_layout)
  before = jax.jit(functools.partial(step_lib.train_step, gradients=gradients, tx=trainer.tx,
                                     schedule=trainer.schedule),
                   donate_argnums=0, out_shardings=(trainer.state_shardings, None))
  text = _lowered(trainer, trainer._train_step)
  assert text == _lowered(trainer, before)
  assert "all_to_all" not in text
  trainer.train_iter.close()


@pytest.mark.slow
def test_full_precision_sdp4bit_trains_like_none(tiny_config, tmp_path):
  """32-bit collectives (weights='none', gradients=False): the same run as 'none' up to the
  order of float32 sums; the default 4/8-bit run stays close and learns."""
  runs = {}
  for name, optimizer in [("none", {}),
                          ("exact", dict(dp_comm="sdp4bit",
                                         sdp4bit=dict(weights="none", gradients=False))),
                          ("sdp4bit", dict(dp_comm="sdp4bit"))]:
    trainer = Trainer(_config(tiny_config, **optimizer), tmp_path / name, show_progress=False)
    trainer.train()
    runs[name] = trainer.final_state
  for a, b in zip(_leaves(runs["none"]["params"]), _leaves(runs["exact"]["params"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for a, b in zip(_leaves(runs["exact"]["params"]), _leaves(runs["exact"]["reference"])):
    np.testing.assert_array_equal(a, b)
  drift = max(float(np.max(np.abs(a - b))) for a, b in
              zip(_leaves(runs["none"]["params"]), _leaves(runs["sdp4bit"]["params"])))
  assert 0 < drift < 0.05
  # qWD: the reference weights stay within a 4-bit step of the difference from the weights.
  gap = max(float(np.max(np.abs(a - b))) for a, b in
            zip(_leaves(runs["sdp4bit"]["params"]), _leaves(runs["sdp4bit"]["reference"])))
  assert 0 < gap < 1e-3


@pytest.mark.slow
def test_sdp4bit_resume_is_bitwise_and_restores_across_dp_comm(tiny_config, tmp_path):
  config = _config(tiny_config, dp_comm="sdp4bit")
  straight = Trainer(config, tmp_path / "straight", show_progress=False)
  straight.train()
  Trainer(config, tmp_path / "resumed", show_progress=False).train(stop_at=2)
  resumed = Trainer(config, tmp_path / "resumed", show_progress=False)
  assert resumed.train()["start_step"] == 2
  for key in ("params", "reference", "opt_state"):
    for a, b in zip(_leaves(straight.final_state[key]), _leaves(resumed.final_state[key])):
      np.testing.assert_array_equal(a, b)
  # Sampling reads an SDP4Bit checkpoint's parameters (the reference weights are left behind).
  from mscale_jax.generate import restore_params
  _, params, step, _ = restore_params(str(tmp_path / "straight" / "checkpoints"))
  assert step == 4
  for a, b in zip(_leaves(straight.final_state["params"]), _leaves(params)):
    np.testing.assert_array_equal(a, b)

  # sdp4bit -> none: the reference weights are left behind, the parameters kept.
  plain = Trainer(_config(tiny_config), tmp_path / "straight", show_progress=False)
  state, step = plain.restore_or_init()
  assert step == 4 and set(state) == {"step", "params", "opt_state"}
  for a, b in zip(_leaves(straight.final_state["params"]), _leaves(state["params"])):
    np.testing.assert_array_equal(a, b)
  plain.train_iter.close()
  # none -> sdp4bit: the reference weights start as the parameters.
  Trainer(_config(tiny_config, steps=3), tmp_path / "plain", show_progress=False).train()
  quantized = Trainer(_config(tiny_config, steps=3, dp_comm="sdp4bit"), tmp_path / "plain",
                      show_progress=False)
  state, step = quantized.restore_or_init()
  assert step == 3
  for a, b in zip(_leaves(state["params"]), _leaves(state["reference"])):
    np.testing.assert_array_equal(a, b)
  quantized.train_iter.close()
