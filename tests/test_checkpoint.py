"""Checkpointer.save holds the loop only for the agreement and a device copy of the state
(mscale_jax/checkpoint.py): orbax's synchronous part runs on a launch thread while the loop goes
on and donates the state it passed."""
import threading

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mscale_jax.checkpoint import STALL_PARTS, Checkpointer, abstract_like
from mscale_jax.config import Config


def test_a_save_keeps_the_values_it_was_given_while_the_loop_donates_them(tmp_path):
  mesh = Mesh(np.array(jax.devices()), ("d",))
  shardings = {"w": NamedSharding(mesh, P("d")), "step": NamedSharding(mesh, P())}
  rng = np.random.default_rng(0)
  values = {"w": rng.normal(size=(64, 16)).astype(np.float32), "step": np.int32(3)}
  state = jax.device_put(values, shardings)
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
  steps_done, orbax_save = threading.Event(), checkpointer._orbax_save

  def after_the_steps(*args):   # orbax starts only once the loop has donated the state
    steps_done.wait()
    orbax_save(*args)
  checkpointer._orbax_save = after_the_steps
  checkpointer.save(3, state, {"position": 3}, Config())
  step = jax.jit(lambda s: {"w": s["w"] * 2 + 1, "step": s["step"] + 1}, donate_argnums=0)
  for _ in range(3):
    state = step(state)
  jax.block_until_ready(state)
  steps_done.set()
  checkpointer.close()
  assert sorted(checkpointer.saves[-1]["parts"]) == sorted(STALL_PARTS)
  assert checkpointer.saves[-1]["write_s"] is not None
  reader = Checkpointer(str(tmp_path / "checkpoints"))
  assert reader.all_steps() == [3]
  restored = reader.restore(3, abstract_like(values, shardings))
  np.testing.assert_array_equal(np.asarray(restored["w"]), values["w"])
  assert int(restored["step"]) == 3
  np.testing.assert_array_equal(np.asarray(state["w"]), ((values["w"] * 2 + 1) * 2 + 1) * 2 + 1)
  reader.close()
