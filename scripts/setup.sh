#!/usr/bin/env bash
# Sets loom up from nothing: a virtual environment in .venv, torch (pinned to 2.13.0 when no torch
# is importable, so pip takes a CPU build instead of downloading several GB of CUDA wheels), and
# loom itself in editable mode with its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "torch==${LOOM_TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
touch .venv/.loom-installed
echo "loom is installed in .venv (activate with: source .venv/bin/activate)"
