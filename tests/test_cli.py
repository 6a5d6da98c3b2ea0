"""The main job's command line, run as a user would: as a subprocess."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_trains_a_few_steps_end_to_end(tmp_path):
  result = run_train("--config.train.steps=4", "--config.train.log_every=2",
                     "--config.train.eval_every=4", "--config.train.checkpoint_every=4",
                     "--config.optimizer.warmup_steps=1", f"--workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "mesh {'data': 2, 'fsdp': 1, 'stage': 1, 'tensor': 4}" in result.stdout
  assert "summary" in result.stdout and "mfu" in result.stdout
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2, 4]   # the first step, then every 2
  for r in records:
    assert {"step", "loss", "tokens_per_s", "mfu"} <= set(r)
    assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
  assert "eval_loss" in records[-1]
  assert os.listdir(tmp_path / "tensorboard")
  assert (tmp_path / "checkpoints" / "4").is_dir()
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert "matmul rate of this host" in summary["peak_source"]


@pytest.mark.parametrize("args,field", [
    (["--config.model.block=diagonal"], "model.block='diagonal'"),
    # Each case is a fresh Python process (~2 s): the fast tier runs the first.
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [
        (["--config.mesh.data=3", "--config.mesh.shrink_to_fit=False"], "mesh="),
        (["--config.model.num_heads=6", "--config.model.hidden=96"], "model.num_heads=6"),
        (["--config.data.kind=tokens", "--config.data.path=/no/such/file"], "data.path="),
        (["--config.model.attention_window=0"], "model.attention_window=0"),
        (["--config.mesh.stage=2", "--config.mesh.tensor=2", "--config.model.num_layers=4",
          "--config.pipeline.schedule=interleaved_1f1b", "--config.pipeline.virtual_stages=2",
          "--config.pipeline.microbatches=3"], "pipeline.microbatches=3")]],
])
def test_bad_config_is_one_line_and_exit_2(args, field, tmp_path):
  result = run_train(*args, f"--workdir={tmp_path}", timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and field in lines[0], result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")


def test_dry_run_of_the_paper_model_allocates_nothing():
  result = run_train("--config=experiments/configs/gpt_175b.py", "--dry_run", timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout[result.stdout.index("{"):])
  assert 174e9 < report["num_params"] < 177e9
  assert report["flops_per_token"] == pytest.approx(1.0762e12, rel=1e-3)
  assert report["mesh"] == {"data": 4, "fsdp": 1, "stage": 8, "tensor": 8}
  assert report["per_device_gib"]["total"] < 80
