#!/usr/bin/env bash
# Sets up .venv (with the [test] extra) and runs the whole test suite on 8 simulated CPU devices.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k model -x`.
VENV_EXTRAS=test source "$(dirname "$0")/_venv.sh"
export JAX_PLATFORMS=cpu
exec python -m pytest "$@"
