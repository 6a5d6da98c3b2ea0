"""The trainer: exact resume, restore into another mesh, and refusing a mismatched checkpoint."""
import json
import os

import jax
import numpy as np
import pytest

from mscale_jax.errors import ConfigError
from mscale_jax.train import Trainer


def params_of(state):
  return jax.tree.map(np.asarray, state["params"])


def metrics_of(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f)}


@pytest.mark.slow   # a whole trainer run or two: the full suite, not the fast tier
def test_exact_resume_is_bitwise(tiny_config, tmp_path):
  """20 steps straight == 10 steps, a fresh process-like restart, 10 more: same bits, same data."""
  config = tiny_config(train=dict(steps=20, global_batch=4, log_every=5, eval_every=20,
                                  checkpoint_every=10),
                       data=dict(kind="stdlib", prefetch=2))   # the default prefetching
  straight = Trainer(config, tmp_path / "straight", show_progress=False)
  straight.train()

  first = Trainer(config, tmp_path / "resumed", show_progress=False)
  first.train(stop_at=10)
  assert first.checkpointer.latest_step() == 10
  second = Trainer(config, tmp_path / "resumed", show_progress=False)
  summary = second.train()
  assert summary["start_step"] == 10

  a, b = params_of(straight.final_state), params_of(second.final_state)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  # Same data order: identical losses after the restart, and the same iterator position.
  want, got = metrics_of(tmp_path / "straight"), metrics_of(tmp_path / "resumed")
  for step in (15, 20):
    assert want[step]["loss"] == got[step]["loss"]
  assert straight.train_iter.get_state() == second.train_iter.get_state()
  # And the run did learn something: not a trivially constant state.
  assert want[20]["loss"] < want[5]["loss"]


@pytest.mark.slow
def test_restore_into_a_different_mesh(tiny_config, tmp_path):
  """Saved on (data=2, tensor=4), restored on (data=4, tensor=2) with the same values."""
  saved = Trainer(tiny_config(mesh=dict(data=2, tensor=4), train=dict(steps=3)), tmp_path,
                  show_progress=False)
  saved.train()
  restored = Trainer(tiny_config(mesh=dict(data=4, tensor=2), train=dict(steps=3)), tmp_path,
                     show_progress=False)
  state, step = restored.restore_or_init()
  assert step == 3
  assert dict(restored.mesh.shape)["tensor"] == 2
  w = state["params"]["blocks"]["attn"]["w_qkv"]
  assert w.sharding.mesh.shape["tensor"] == 2
  for x, y in zip(jax.tree.leaves(params_of(saved.final_state)), jax.tree.leaves(params_of(state))):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow   # a whole trainer run or two: the full suite, not the fast tier
def test_resuming_with_another_optimizer_is_a_config_error(tiny_config, tmp_path):
  Trainer(tiny_config(train=dict(steps=3)), tmp_path, show_progress=False).train()
  with pytest.raises(ConfigError, match="optimizer.name='adamw'.*holds 'lamb' state"):
    Trainer(tiny_config(optimizer=dict(name="adamw", warmup_steps=1), train=dict(steps=3)),
            tmp_path, show_progress=False)


@pytest.mark.slow   # one of the fast tier's heaviest (a trainer run or a fleet replay)
def test_resuming_another_model_shape_is_a_config_error(tiny_config, tmp_path):
  Trainer(tiny_config(train=dict(steps=3)), tmp_path, show_progress=False).train()
  with pytest.raises(ConfigError, match="model.hidden=64.*hidden=32"):
    Trainer(tiny_config(model=dict(hidden=64), train=dict(steps=3)), tmp_path,
            show_progress=False)


_STEP_PROGRAMS = """
import json, sys
from mscale_jax.config import Config
from mscale_jax.train import Trainer
config, workdir = Config.from_dict(json.loads(sys.argv[1])), sys.argv[2]

def lowered_step(name, callbacks=()):
  trainer = Trainer(config, f"{workdir}/{name}", show_progress=False, callbacks=callbacks)
  text = trainer.lower_step(trainer.init_state(),
                            trainer.device_batch(next(trainer.train_iter))).as_text()
  trainer.train_iter.close()
  return text

plain = lowered_step("plain")
loaded = sorted(m for m in sys.modules if m.startswith("mscale_jax") and "worker" in m)
from mscale_jax import compile_cache
from mscale_jax.callbacks.worker import FaultInjection
from mscale_jax.resilience.faults import parse_faults
unarmed = lowered_step("unarmed", [FaultInjection([])])
compiled, compile_or_load = [], compile_cache.compile_or_load
def spy(lowered, name, mesh, **kwargs):
  if name == "train_step":
    compiled.append(lowered.as_text())
  return compile_or_load(lowered, name, mesh, **kwargs)
compile_cache.compile_or_load = spy
armed = Trainer(config, f"{workdir}/armed", show_progress=False,
                callbacks=[FaultInjection(parse_faults(["nan:step=2"]))])
summary = armed.train()
print(json.dumps({"loaded_before": loaded, "unarmed_same": unarmed == plain,
                  "armed_run_compiled_plain": compiled == [plain],
                  "nonfinite_steps": summary["nonfinite_steps"]}))
"""


@pytest.mark.slow   # a whole trainer run or two: the full suite, not the fast tier
def test_the_fault_machinery_leaves_the_compiled_step_alone(tiny_config, tmp_path):
  """The train step lowers to the same program text without the fault machinery imported,
  with it loaded but unarmed, and in a run where a `nan` fault poisons step 2 (a fresh process,
  so that nothing else has imported the machinery)."""
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = tiny_config(train=dict(steps=3, log_every=1, eval_every=3, checkpoint_every=3,
                                  on_nonfinite="skip_step"))
  result = subprocess.run([sys.executable, "-c", _STEP_PROGRAMS, json.dumps(config.to_dict()),
                           str(tmp_path)], cwd=repo, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=repo))
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out == {"loaded_before": [], "unarmed_same": True, "armed_run_compiled_plain": True,
                 "nonfinite_steps": [2]}
