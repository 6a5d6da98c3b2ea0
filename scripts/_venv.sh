# Sourced by scripts/*.sh with VENV_EXTRAS set ("" or "test"): create or refresh .venv from
# setup.cfg with those extras, then activate it.
# The install is re-run whenever setup.cfg or pyproject.toml is newer than the last install,
# so a dependency missing from setup.cfg fails loudly instead of hiding in a hand-made venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRAS="${VENV_EXTRAS:-}"   # set by the caller: "" or "test"
PY="${PYTHON:-python3}"
STAMP=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if [ ! -f "$STAMP" ] || [ setup.cfg -nt "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  echo "[setup] installing mscale-jax${EXTRAS:+[$EXTRAS]} into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
fi
# shellcheck disable=SC1091
source .venv/bin/activate
