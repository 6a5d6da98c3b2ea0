"""experiments/sample.py and generate.restore_params on a checkpoint saved on a (2, 4) mesh."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run folder whose checkpoint holds a freshly initialised state sharded over (data 2,
  tensor 4); returns (folder, its parameters)."""
  from mscale_jax.config import Config
  from mscale_jax.train import Trainer
  workdir = tmp_path_factory.mktemp("run")
  config = Config(name="test").replace(
      model=dict(num_layers=2, hidden=32, num_heads=4, mlp_dim=64, seq_len=32,
                 attention_window=8),
      mesh=dict(data=2, tensor=4), optimizer=dict(warmup_steps=2),
      data=dict(kind="stdlib", prefetch=0), train=dict(steps=6, global_batch=4))
  trainer = Trainer(config, str(workdir), show_progress=False)
  state = trainer.init_state()
  assert len(state["params"]["embed"].sharding.device_set) == 8
  trainer.checkpointer.save(3, state, trainer.train_iter.get_state(), config)
  trainer.checkpointer.close()
  trainer.train_iter.close()
  return str(workdir), jax.tree.map(np.asarray, state["params"])


def run_sample(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "experiments.sample", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_restores_parameters_of_any_mesh_onto_one_device(run_dir):
  from mscale_jax import generate
  workdir, params = run_dir
  config, restored, step, meta = generate.restore_params(os.path.join(workdir, "checkpoints"))
  assert step == 3 and meta["data"]["kind"] == "stdlib"
  assert config.attention_window == 8 and config.hidden == 32
  leaves = jax.tree.leaves(restored)
  assert all(len(x.sharding.device_set) == 1 for x in leaves)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), params)


@pytest.mark.slow
def test_cli_continues_the_prompt(run_dir):
  workdir, _ = run_dir
  result = run_sample(f"--workdir={workdir}", "--prompt=def f(x):", "--max_new_tokens=12",
                      "--temperature=0")
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("def f(x):")
  assert "step 3" in result.stderr and "window 8" in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--workdir=/no/such/run"], "--workdir='/no/such/run'"),
    (["--workdir={empty}"], "checkpoint"),
    pytest.param(["--workdir={run}", "--tokenizer=ids", "--prompt=3 256"], "prompt='token 256'",
                 marks=pytest.mark.slow),
    pytest.param(["--workdir={run}", "--max_new_tokens=40"], "max_new_tokens=40",
                 marks=pytest.mark.slow),
])
def test_bad_requests_print_one_line_and_exit_2(run_dir, tmp_path, args, message):
  workdir, _ = run_dir
  args = [a.format(run=workdir, empty=tmp_path) for a in args]
  result = run_sample(*args)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]
  assert "Traceback" not in result.stderr


def test_restores_a_pipelined_checkpoint_in_model_layer_order(tmp_path):
  """A stage=2, v=2 run stores its stacked layers in pipeline order; sampling needs them back in
  model order."""
  from mscale_jax import generate
  from mscale_jax.config import Config
  from mscale_jax.parallel import pipeline
  from mscale_jax.train import Trainer
  config = Config(name="test").replace(
      model=dict(num_layers=4, hidden=32, num_heads=4, mlp_dim=64, seq_len=32),
      mesh=dict(data=8), optimizer=dict(warmup_steps=2),
      data=dict(kind="stdlib", prefetch=0), train=dict(steps=6, global_batch=8))
  trainer = Trainer(config, str(tmp_path), show_progress=False)
  state = trainer.init_state()
  natural = jax.tree.map(np.asarray, state["params"])
  state = dict(state, params=pipeline.reorder_layers(state["params"], 4, (1, 1), (2, 2)))
  trainer.checkpointer.save(2, state, trainer.train_iter.get_state(), config, layer_layout=(2, 2))
  trainer.checkpointer.close()
  trainer.train_iter.close()
  _, restored, _, _ = generate.restore_params(os.path.join(tmp_path, "checkpoints"))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), natural)
  # The stored order really differs (layers 1 and 2 swap places), so the check above has teeth.
  stored = jax.tree.map(np.asarray, state["params"])
  assert not np.array_equal(stored["blocks"]["attn"]["w_qkv"], natural["blocks"]["attn"]["w_qkv"])
