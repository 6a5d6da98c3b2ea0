#!/usr/bin/env bash
# Sets up .venv (with the [test] extra) and runs the whole test suite on 8 simulated CPU devices.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k model -x`. Tests run in two pytest-xdist
# workers (one per core of the 2-core CI machine), each test file whole in one worker so its
# module fixtures are built once, slowest files first (tests/conftest.py); PYTEST_WORKERS=0
# runs them in this process.
VENV_EXTRAS=test source "$(dirname "$0")/_venv.sh"
export JAX_PLATFORMS=cpu
exec python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
