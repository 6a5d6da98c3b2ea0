#!/usr/bin/env bash
# Sets up .venv (with the [test] extra) and runs the tests on 8 simulated CPU devices.
#
#   scripts/test.sh            the whole suite (what CI runs), then its 15 slowest tests
#   scripts/test.sh --fast     the tier to run after each change: every module's unit tests, no
#                              multi-process jobs, notebooks, convergence runs or drills (tests
#                              marked `slow`); under 2 minutes on a 2-core machine
#
# Extra arguments go to pytest, e.g. `scripts/test.sh --fast -k model -x`. Tests run in two
# pytest-xdist workers (one per core of the 2-core CI machine), each test file whole in one
# worker so its module fixtures are built once, slowest files first (tests/conftest.py);
# PYTEST_WORKERS=0 runs them in this process.
VENV_EXTRAS=test source "$(dirname "$0")/_venv.sh"
export JAX_PLATFORMS=cpu
tier=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  tier=(-m "not slow")
fi
exec python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --durations=15 ${tier[@]+"${tier[@]}"} "$@"
