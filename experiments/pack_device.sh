#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine that has its own
# PyTorch but no network: the Multi30k corpus (raw and tokenized references)
# and the wheels of the packages such an image lacks, into .device/
# (git-ignored). Run it where there is a network; carry .device to the GPU
# machine beside the code, where gpu_check.sh installs them offline.
#
#   bash experiments/pack_device.sh       # MT_DATA_DIR: the raw corpus (default ../shared/data/multi30k/raw)
set -euo pipefail
cd "$(dirname "$0")/.."
src=${MT_DATA_DIR:-../shared/data/multi30k/raw}
rm -rf .device && mkdir -p .device/multi30k .device/wheels
cp -rL "$src" .device/multi30k/raw
cp -rL "$src/../tok" .device/multi30k/tok
# The GPU image this was made for (Python 3.12) has PyTorch, Lightning, sentencepiece, sacreBLEU
# and the libraries under datasets, but not datasets (with dill, multiprocess) nor sacremoses.
here=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
for version in 3.12 "$here"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" -d .device/wheels \
        "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "sacremoses==0.2.0"
done
du -sh .device
