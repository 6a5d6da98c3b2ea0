"""experiments/mfu_sweep.py: the ladder's overrides, one measured row, and the CLI's errors."""
import os
import subprocess
import sys

import pytest

from experiments import mfu_sweep, results
from mscale_jax.config import Config
from mscale_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _base(**train):
  config = Config().replace(model={"seq_len": 64, "dtype": "float32"},
                            data={"kind": "synthetic"},
                            train={"global_batch": 8, "steps": 20, **train})
  return config


def test_the_ladder_is_cumulative_and_fills_window_and_batch_from_the_config():
  config = _base()
  swa = config.replace(**mfu_sweep.overrides("swa", config))
  assert (swa.model.block, swa.model.attention_impl, swa.model.attention_window,
          swa.model.norm_impl, swa.optimizer.name) == ("parallel", "pallas", 16, "xla", "adamw")
  top = config.replace(**mfu_sweep.overrides("lamb_x3", config))
  assert (top.model.norm_impl, top.optimizer.name, top.train.global_batch) == (
      "pallas", "lamb_fused", 24)
  assert mfu_sweep.overrides("megascale", config) == mfu_sweep.overrides("lamb_x3", config)
  cudnn = config.replace(**mfu_sweep.overrides("cudnn", config))
  assert (cudnn.model.block, cudnn.model.attention_impl) == ("parallel", "cudnn")
  baseline = config.replace(**mfu_sweep.overrides("baseline", config.replace(
      model={"block": "parallel", "attention_window": 8})))
  assert (baseline.model.block, baseline.model.attention_window) == ("sequential", None)
  with pytest.raises(ConfigError, match="variants.*one of baseline"):
    mfu_sweep.overrides("flashy", config)


def test_a_measured_row_is_consistent_with_its_own_time_and_the_megatron_count():
  from mscale_jax import flops
  config = _base()
  row = mfu_sweep.measure(config, steps=2, rounds=2, warmup=1)
  assert len(row["step_s_rounds"]) == 2 and row["step_s"] > 0
  assert row["tokens_per_s"] == pytest.approx(8 * 64 / row["step_s"])
  assert row["flops_per_token"] == pytest.approx(flops.model_flops_per_token(config.model))
  assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"]
                                     / row["peak_flops"])
  assert row["devices"] == 8 and row["tflops_per_device"] == pytest.approx(
      row["tokens_per_s"] * row["flops_per_token"] / 8 / 1e12)
  assert 0 < row["last_loss"] < 10


def test_no_warmup_still_times_every_round():
  row = mfu_sweep.measure(_base(), steps=1, rounds=2, warmup=0)
  assert len(row["step_s_rounds"]) == 2 and all(t > 0 for t in row["step_s_rounds"])


def test_the_cli_refuses_an_unknown_variant_on_one_line_with_status_2():
  done = subprocess.run([sys.executable, "-m", "experiments.mfu_sweep", "--variants=ptb,nope",
                         "--config=experiments/configs/gpt_tiny.py"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith("error: variants='nope'")


def test_the_cli_refuses_a_variant_the_platform_cannot_run_before_compiling_any():
  done = subprocess.run([sys.executable, "-m", "experiments.mfu_sweep", "--variants=ptb,cudnn",
                         "--config=experiments/configs/gpt_tiny.py"], cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"},
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 2, done.stderr[-500:]
  assert done.stderr.strip().splitlines()[-1].startswith("error: model.attention_impl='cudnn'")
  assert "compiling" not in done.stdout


def test_a_record_names_the_commit_its_launcher_gives(monkeypatch):
  monkeypatch.setenv("MSCALE_COMMIT", "0123abc")
  assert results.git_commit() == "0123abc"
  monkeypatch.delenv("MSCALE_COMMIT")
  assert results.git_commit() != "0123abc"
