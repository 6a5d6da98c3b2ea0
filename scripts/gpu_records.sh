#!/usr/bin/env bash
# The records a GPU machine makes: the single-device MFU sweep and every kernel benchmark.
#
#   scripts/gpu_records.sh [OUT_DIR]      # on a machine with one NVIDIA GPU and JAX installed
#   MSCALE_COMMIT=<sha> scripts/gpu_records.sh   # in a copy of the tree: its .git may be stale
#
# Uses the machine's own Python and JAX (no .venv: a lent GPU machine has no network); wheels
# of packages it lacks may be put in .whl/ (see README, "Records on a GPU"). Each step runs
# under its own time limit (MFU_LIMIT, KERNEL_LIMIT, ... seconds), so one that hangs or fails
# leaves the others' records; ONLY="step names" runs a subset. Records go to results/ as usual;
# OUT_DIR (default results/) also gets a tarball of them.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
# The carried wheels of packages that are missing, or whose version setup.cfg does not allow.
wheels=$("$py" - <<'PY'
import configparser, glob, importlib.metadata as md
from packaging.requirements import Requirement
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
norm = lambda name: name.lower().replace("_", "-")
allowed = {norm(r.name): r.specifier for r in map(Requirement, filter(
    None, map(str.strip, cfg["options"]["install_requires"].splitlines())))}
for wheel in sorted(glob.glob(".whl/*.whl")):
  name = norm(wheel.split("/")[-1].split("-")[0])
  try:
    have = md.version(name)
  except md.PackageNotFoundError:
    print(wheel)
    continue
  if name in allowed and not allowed[name].contains(have, prereleases=True):
    print(wheel)
PY
)
if [ -n "$wheels" ]; then
  echo "installing carried wheels:" $wheels
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/mscale-site $wheels || exit 1
  export PYTHONPATH="/tmp/mscale-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
"$py" -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" || exit 1
start=$(date +%s)
step() {   # step SECONDS NAME COMMAND...; ONLY="name ..." runs just those steps
  local limit=$1 name=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  echo "=== $name (limit ${limit}s, at $(( $(date +%s) - start ))s)"
  timeout -k 5 "$limit" "$@"
  echo "=== $name: exit $?"
  pack
}
pack() {   # the records made so far, in one tarball (a step killed later loses none of them)
  local new
  new=$(find results -maxdepth 1 -newermt "@$start" -name '*-gpu-*' | sort)
  [ -n "$new" ] && tar czf "$out/gpu_records.tgz" $new
  return 0
}
step "${MFU_LIMIT:-200}" mfu_sweep-gpt_125m "$py" -m experiments.mfu_sweep \
    --variants=baseline,ptb,flash,swa,fused_ln,lamb_x3,cudnn
# Batch 16 x 3 does not fit gpt_125m's fp32 logits on an 80 GB card: the last rows at batch 8.
step "${MFU_LIMIT:-200}" mfu_sweep-gpt_125m-batch8 "$py" -m experiments.mfu_sweep \
    --config.train.global_batch=8 --variants=fused_ln,lamb_x3
for kernel in flash_attention layer_norm lamb gemm quantize collective_matmul; do
  step "${KERNEL_LIMIT:-40}" "kernel_bench-$kernel" "$py" -m experiments.kernel_bench \
      --kernel="$kernel"
done
step "${TRAIN_LIMIT:-60}" train-gpt_tiny "$py" -m experiments.train --record \
    --workdir=/tmp/mscale-train-gpt_tiny
step "${MFU_1P3B_LIMIT:-130}" mfu_sweep-gpt_1p3b "$py" -m experiments.mfu_sweep \
    --config=experiments/configs/gpt_1p3b.py --variants=baseline,megascale --steps=5
echo "new records:"; find results -maxdepth 1 -newermt "@$start" -name '*-gpu-*' | sort
