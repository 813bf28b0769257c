#!/usr/bin/env bash
# Create .venv (if missing) and install mt with its dev extras.
# Where there is no NVIDIA GPU, torch 2.13.0 (a CPU wheel) is installed first,
# so that the project's torch range does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        python -m pip install -q torch
    else
        python -m pip install -q torch==2.13.0
    fi
fi
python -m pip install -q -e ".[dev]"
