#!/usr/bin/env bash
# Sets up .venv and runs the main job: `python -m experiments.train` with your arguments.
# With no arguments it trains gpt_tiny on the default corpus (8 CPU devices, or the GPU if any).
VENV_EXTRAS= source "$(dirname "$0")/_venv.sh"
exec python -m experiments.train "$@"
