#!/usr/bin/env bash
# The records a GPU machine makes: every kernel benchmark, the single-device MFU sweeps and the
# main job, most valuable first.
#
#   scripts/gpu_records.sh [OUT_DIR]      # on a machine with one NVIDIA GPU and JAX installed
#   MSCALE_COMMIT=<sha> scripts/gpu_records.sh   # in a copy of the tree: its .git may be stale
#
# Uses the machine's own Python and JAX (no .venv: a lent GPU machine has no network); wheels
# of packages it lacks may be put in .whl/ (see README, "Records on a GPU"). The whole script
# ends within DEADLINE seconds (default 530, startup included) even if a step hangs: each step
# runs under the smaller of its own limit and the time left (LIMIT_<step name with - and . as
# _>=SECONDS overrides its own, e.g. LIMIT_kernel_bench_flash_attention=150), and a step with
# under 15 s left is skipped, so one that hangs or fails leaves the others' records.
# ONLY="step names" runs a subset; KERNEL_SIZE=tiny|small|full (default auto: full on a GPU)
# sizes the kernel benchmarks (tiny: a CPU dry run). Records go to results/ as usual; OUT_DIR
# (default results/) also gets a tarball of them after every step.
set -uo pipefail
start=$(date +%s)
deadline=$(( start + ${DEADLINE:-530} ))
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
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv
timeout 60 "$py" -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" || exit 1
step() {   # step SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  local own="LIMIT_${name//[-.]/_}" now left rc
  limit=${!own:-$limit}
  now=$(date +%s)
  left=$(( deadline - now - 5 ))        # 5: the grace `timeout -k` gives before SIGKILL
  if (( left < 15 )); then
    echo "=== $name: SKIPPED, ${left}s left of DEADLINE=${DEADLINE:-530}s"
    return 0
  fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit}s, at $(( now - start ))s)"
  timeout -k 5 "$limit" "$@"
  rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - now ))s$( (( rc == 124 || rc == 137 )) \
      && echo ' (TIMED OUT)')"
  pack
}
pack() {   # the records made so far, in one tarball (a step killed later loses none of them)
  local new
  new=$(find results -maxdepth 1 -newermt "@$start" -name '*-gpu-*' | sort)
  [ -n "$new" ] && tar czf "$out/gpu_records.tgz" $new
  return 0
}
kernel() {   # kernel SECONDS NAME: one kernel benchmark as one step
  step "$1" "kernel_bench-$2" "$py" -m experiments.kernel_bench --kernel="$2" \
      --size="${KERNEL_SIZE:-auto}"
}
# Measured on an H100 (JAX 0.11, 12fb2cc): layer_norm 22 s, quantize 10 s, lamb 36 s, the
# gpt_125m sweep 85 s, gpt_1p3b 69 s, the batch-8 rows 34 s, the main job 25 s; at 46ba228:
# gemm 32 s, flash attention 238 s (48 rows), the gpt_125m sweep 103 s, the main job 23 s;
# collective_matmul did not finish within 35 s (its last printed row ended at 21 s). Flash
# attention runs last, with what is left; all steps need more than one call's 530 s (ONLY=).
kernel 40 layer_norm
kernel 50 quantize
kernel 45 lamb
kernel 45 gemm
# lamb_x3 at batch 16 x 3 does not fit gpt_125m's fp32 logits on an 80 GB card (it OOMed);
# its row is in the batch-8 step.
step 120 mfu_sweep-gpt_125m "$py" -m experiments.mfu_sweep \
    --variants=baseline,ptb,flash,swa,fused_ln,cudnn
step 100 mfu_sweep-gpt_1p3b "$py" -m experiments.mfu_sweep \
    --config=experiments/configs/gpt_1p3b.py --variants=baseline,megascale --steps=5
step 60 mfu_sweep-gpt_125m-batch8 "$py" -m experiments.mfu_sweep \
    --config.train.global_batch=8 --variants=fused_ln,lamb_x3
step 40 train-gpt_tiny "$py" -m experiments.train --record \
    --workdir=/tmp/mscale-train-gpt_tiny
kernel 60 collective_matmul      # one GPU: every impl is a local dot (a multi-GPU figure later)
kernel 300 flash_attention
echo "new records ($(( $(date +%s) - start ))s):"
find results -maxdepth 1 -newermt "@$start" -name '*-gpu-*' | sort
