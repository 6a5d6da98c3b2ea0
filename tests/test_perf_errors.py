"""Impossible layouts and unknown inputs raise a ConfigError naming the value."""
import json
import os
import subprocess
import sys

import pytest

from mscale_jax.errors import ConfigError
from mscale_jax.perf import calibrate, constants, hardware, search
from mscale_jax.perf.hardware import A100_MEGASCALE as A100
from mscale_jax.perf.iteration import predict
from mscale_jax.perf.workload import GPT_175B, Layout, Techniques, layout_for, validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kwargs,field,value", [
    (dict(tp=3, pp=8, vpp=6, micro_batch=1, global_batch=256), "tp", 3),        # 128 heads
    (dict(tp=8, pp=8, vpp=5, micro_batch=1, global_batch=256), "pp*vpp", 40),   # 96 layers
    (dict(tp=8, pp=8, vpp=6, micro_batch=3, global_batch=256), "global_batch", 256),
    (dict(tp=8, pp=8, vpp=6, micro_batch=8, global_batch=128), "num_micro_batches", 4),
])
def test_bad_layout(kwargs, field, value):
  with pytest.raises(ConfigError) as e:
    layout_for(GPT_175B, 256, **kwargs)
  assert e.value.field == field and str(value) in str(e.value)


def test_devices_not_divisible_by_tp_pp():
  with pytest.raises(ConfigError, match="devices=100 is invalid"):
    layout_for(GPT_175B, 100, 8, 8, 6, 1, 256)


def test_non_positive_value():
  with pytest.raises(ConfigError, match="micro_batch=0"):
    validate(GPT_175B, Layout(8, 8, 6, 4, 0, 256))


def test_unknown_hardware_and_dtype_and_recompute():
  with pytest.raises(ConfigError, match="hardware='a200'"):
    hardware.get_hardware("a200")
  with pytest.raises(ConfigError, match="dtype='int4'"):
    A100.peak("int4")
  with pytest.raises(ConfigError, match="recompute='some'"):
    predict(GPT_175B, Layout(8, 8, 6, 4, 1, 256), Techniques(), A100, recompute="some")


def test_search_with_no_layout():
  with pytest.raises(ConfigError, match="devices=0"):
    search.search(GPT_175B, 0, A100, 768, Techniques())


def test_calibration_record_errors(tmp_path):
  with pytest.raises(ConfigError, match="calibrate="):
    calibrate.calibrated(constants.DEFAULT, str(tmp_path / "missing.json"))
  path = tmp_path / "empty.json"
  path.write_text(json.dumps({"device": {"device_kind": "cpu"}, "figures": []}))
  with pytest.raises(ConfigError, match="at least two rows"):
    calibrate.calibrated(constants.DEFAULT, str(path))


def _gemm_record(path, device_kind):
  rows = [{"m": s, "k": s, "n": s, "dtype": "bfloat16", "tflops": t, "peak_tflops": 989.0}
          for s, t in ((1024, 400.0), (4096, 600.0), (8192, 650.0))]
  path.write_text(json.dumps({"device": {"device_kind": device_kind}, "figures": rows}))
  return str(path)


def test_calibration_refuses_a_record_from_another_device(tmp_path):
  path = _gemm_record(tmp_path / "h100.json", "NVIDIA H100 80GB HBM3")
  with pytest.raises(ConfigError) as info:
    calibrate.calibrated(constants.DEFAULT, path, A100)
  assert "NVIDIA H100 80GB HBM3" in str(info.value) and "a100_megascale" in str(info.value)
  forced, note = calibrate.calibrated(constants.DEFAULT, path, A100, allow_other_device=True)
  assert "although measured on another device" in note
  same, note = calibrate.calibrated(constants.DEFAULT, path, hardware.H100_DGX)
  assert same == forced and "another device" not in note


@pytest.mark.parametrize("hw,kind,ok", [
    (A100, "NVIDIA A100-SXM4-80GB", True),
    (hardware.H100_DGX, "NVIDIA H100 80GB HBM3", True),
    (hardware.H100_DGX, "NVIDIA H100 PCIe", False),      # the PCIe card has a lower peak
    (hardware.H100_DGX, "NVIDIA H800", False),
    (hardware.H800_DGX, "NVIDIA H800", True),
    (hardware.TPU_V5P, "TPU v5", True),
    (hardware.TPU_V5P, "TPU v5 lite", False),
    (A100, "cpu", False),
])
def test_hardware_presets_know_their_device_kind(hw, kind, ok):
  assert hardware.models_device(hw, kind) == ok


def test_cli_calibrate_any_device(tmp_path):
  path = _gemm_record(tmp_path / "h100.json", "NVIDIA H100 80GB HBM3")
  argv = ["-m", "experiments.scaling_curves", f"--calibrate={path}", f"--out_dir={tmp_path}",
          "--nointervals"]
  out = subprocess.run([sys.executable] + argv, cwd=REPO, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 2 and "'NVIDIA H100 80GB HBM3'" in out.stderr
  out = subprocess.run([sys.executable] + argv + ["--calibrate_any_device"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "--calibrate_any_device" in out.stdout and "another device" in out.stdout


@pytest.mark.parametrize("argv", [
    ["-m", "experiments.scaling_curves", "--hardware=a200", "--out_dir=OUT"],
    ["-m", "experiments.plan", "--gpus=100"],
])
def test_cli_reports_config_error_and_exits_2(argv, tmp_path):
  argv = [a.replace("OUT", str(tmp_path)) for a in argv]
  out = subprocess.run([sys.executable] + argv, cwd=REPO, capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "is invalid" in lines[0]
