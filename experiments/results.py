"""JSON records of measured runs, written to `results/`.

Every performance figure the README cites comes from one of these records. A record names the
device, the software versions, the commit, the date and the exact command, next to the figures.
"""
import datetime
import os
import platform
import subprocess
import sys

from mscale_jax.files import write_json

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
  """The current commit hash, with '+dirty' when the tree differs from it.

  Untracked files count (new code that is not committed yet), except under results/, where
  records are written. MSCALE_COMMIT, when set, wins: a copy of the tree on a lent GPU machine
  may carry a stale .git (seen: HEAD at an older commit, the tree newer), or none.
  """
  if os.environ.get("MSCALE_COMMIT"):     # the launcher knows better than a copied .git
    return os.environ["MSCALE_COMMIT"]
  try:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain", "--", ".", ":(exclude)results"],
                            cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    return sha + ("+dirty" if status else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def device_description() -> dict:
  """Platform, device kind and count of the JAX backend (imports JAX)."""
  import jax
  devices = jax.devices()
  return {
      "platform": devices[0].platform,
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "process_count": jax.process_count(),
      "host_cpu_count": os.cpu_count(),
      "jax_version": jax.__version__,
      "python_version": platform.python_version(),
  }


def write_record(name: str, figures, *, out_dir: str | None = None, extra: dict | None = None,
                 device: dict | None = None) -> str:
  """Writes `results/<name>-<platform>-<date>.json` and returns its path.

  Args:
    name: what was measured, e.g. 'kernel_bench-flash_attention' or 'train-gpt_tiny'.
    figures: the measured numbers (any JSON-serialisable value).
    out_dir: folder for the record; defaults to `results/` at the repository root.
    extra: further top-level fields (configuration, notes).
    device: overrides `device_description()` (for records that need no JAX).
  """
  device = device if device is not None else device_description()
  now = datetime.datetime.now(datetime.timezone.utc)
  record = {
      "name": name,
      "device": device,
      "commit": git_commit(),
      "date": now.isoformat(timespec="seconds"),
      "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
      "figures": figures,
  }
  record.update(extra or {})
  out_dir = out_dir or os.path.join(REPO_ROOT, "results")
  os.makedirs(out_dir, exist_ok=True)
  stamp = now.strftime("%Y%m%dT%H%M%S")
  path = os.path.join(out_dir, f"{name}-{device.get('platform', 'na')}-{stamp}.json")
  write_json(path, record, indent=2, sort_keys=False, default=str)
  return path
