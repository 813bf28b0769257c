#!/usr/bin/env bash
# Create .venv (if missing) and install mt with its dev extras.
#
# torch comes first, by itself: PyPI's Linux wheel of torch is the CUDA build
# (gigabytes). Where there is no NVIDIA GPU, torch 2.13.0 is installed with
# PyTorch's CPU wheel index beside pip's own (a CPU wheel, ~200 MB); with a
# GPU, pip's default (the CUDA build). MT_TORCH_INDEX=URL takes that index
# instead (e.g. https://download.pytorch.org/whl/cu126 for a CUDA version);
# MT_TORCH_INDEX= (empty) leaves the choice to pip's configuration alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        index=${MT_TORCH_INDEX-}
        torch=torch
    else
        index=${MT_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
        torch=torch==2.13.0
    fi
    # an index that cannot be reached is skipped with a warning (at once: no retries), and pip's own serves
    python -m pip install -q "$torch" ${index:+--retries 0 --extra-index-url "$index"}
fi
python -m pip install -q -e ".[dev]"
