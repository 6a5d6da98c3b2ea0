"""experiments/convergence.py: variants at equal tokens, and a tiny --quick run end to end."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from mscale_jax.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _settings():
  from experiments.configs import convergence
  return convergence.get_config()


def test_variants_see_equal_tokens_with_sqrt_scaled_rates():
  from experiments.convergence import BASELINE, FIGURES, variant_config
  settings = _settings()
  base = variant_config(settings, BASELINE, seed=0)
  tokens = base.train.steps * base.train.global_batch * base.model.seq_len
  for variant in FIGURES["fig10a"] + FIGURES["fig10b"]:
    config = variant_config(settings, variant, seed=2)
    t, o = config.train, config.optimizer
    assert t.steps * t.global_batch * config.model.seq_len == tokens
    assert t.eval_batches * t.global_batch == base.train.eval_batches * base.train.global_batch
    assert t.seed == config.data.seed == 2
    assert config.model.block == variant.block
    assert (config.model.attention_window == settings.window) == variant.sliding_window
    assert o.name == variant.optimizer
    scale = t.global_batch // base.train.global_batch
    assert scale == (settings.batch_scale if variant.large_batch else 1)
    base_lr = (settings.lamb_learning_rate if variant.optimizer == "lamb"
               else base.optimizer.learning_rate)
    assert o.learning_rate == pytest.approx(base_lr * math.sqrt(scale))
    assert o.warmup_steps * scale == base.optimizer.warmup_steps


def test_cadence_that_cannot_be_split_four_ways_is_a_config_error():
  from experiments.convergence import FIGURES, variant_config
  settings = _settings()
  settings.run.train.eval_every = 30
  with pytest.raises(ConfigError, match="run.train.eval_every=30"):
    variant_config(settings, FIGURES["fig10b"][1], seed=0)


@pytest.mark.slow
def test_quick_run_writes_record_plots_and_table(tmp_path):
  tiny = ["--config.quick.seeds=2", "--config.quick.window=8",
          "--config.quick.run.model.hidden=32", "--config.quick.run.model.mlp_dim=64",
          "--config.quick.run.model.seq_len=32", "--config.run.model.num_layers=1",
          "--config.quick.run.train.steps=8", "--config.quick.run.train.log_every=4",
          "--config.quick.run.train.eval_every=4", "--config.quick.run.train.checkpoint_every=8",
          "--config.quick.run.optimizer.warmup_steps=4",
          # A small corpus (this package's own source) loads faster than the stdlib.
          f"--config.run.data.path={REPO}/mscale_jax", "--config.run.data.heldout_fraction=0.2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  result = subprocess.run([sys.executable, "-m", "experiments.convergence", "--quick", *tiny,
                           f"--workdir={tmp_path / 'runs'}", f"--out_dir={tmp_path / 'out'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  out = tmp_path / "out"
  (record_path,) = out.glob("convergence-quick-*.json")
  record = json.loads(record_path.read_text())
  figures = record["figures"]
  assert set(figures["final_eval_loss"]) == {"baseline", "ptb", "swa", "ptb_swa", "lamb_4b",
                                             "adamw_4b"}
  for stats in figures["final_eval_loss"].values():
    assert len(stats["per_seed"]) == 2 and all(0 < x < 6 for x in stats["per_seed"])
  assert set(figures["difference_to_baseline"]["fig10a"]) == {"ptb", "swa", "ptb_swa"}
  for name, diff in figures["difference_to_baseline"]["fig10b"].items():
    own = figures["final_eval_loss"][name]["per_seed"]
    base = figures["final_eval_loss"]["baseline"]["per_seed"]
    assert diff["per_seed"] == pytest.approx([a - b for a, b in zip(own, base)])
  # Equal tokens: every variant's held-out curve ends at the same token count.
  ends = {name: curve["eval"]["tokens"][-1] for name, curve in figures["curves"].items()}
  assert len(set(ends.values())) == 1, ends
  assert record["variants"]["lamb_4b"]["global_batch"] == 4 * record["variants"]["baseline"][
      "global_batch"]
  assert len(record["heldout"]["fingerprint"]) == 16
  for name in ("fig10a.png", "fig10b.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  table = (out / "convergence.md").read_text()
  assert "PTB + sliding window" in table and "LAMB @ 4B" in table
  assert (tmp_path / "runs" / "ptb_swa" / "seed1" / "checkpoints" / "8").is_dir()


def test_sdp4bit_variants_switch_only_the_data_parallel_collectives():
  from experiments.convergence import FIGURES, SDP4BIT_MESH, variant_config
  from mscale_jax.config import validate
  settings = _settings()
  base, *variants = [variant_config(settings, v, seed=1) for v in FIGURES["sdp4bit"]]
  assert base.optimizer.dp_comm == "none"
  assert {a: getattr(base.mesh, a) for a in SDP4BIT_MESH} == SDP4BIT_MESH
  q = {v.name: c.optimizer for v, c in zip(FIGURES["sdp4bit"][1:], variants)}
  assert (q["qwd"].sdp4bit.weights, q["qwd"].sdp4bit.gradients) == ("differences", False)
  assert (q["tlq_hs"].sdp4bit.weights, q["tlq_hs"].sdp4bit.gradients) == ("none", True)
  assert (q["weights_4bit"].sdp4bit.weights, q["weights_4bit"].sdp4bit.weight_bits) == \
      ("weights", 4)
  for config in variants:
    assert config.optimizer.dp_comm == "sdp4bit"
    plain = config.replace(optimizer={"dp_comm": "none", "sdp4bit": base.optimizer.sdp4bit})
    assert plain == dataclasses.replace(base, name=config.name)
    validate(config, 8)
