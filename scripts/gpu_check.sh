#!/usr/bin/env bash
# The GPU recipe check (issue: Multi30k models that beat the published numbers):
# en->de and en->fr with configs/multi30k_gpu.yaml on one GPU, bf16; prints
# paper-style BLEU, sacreBLEU, training minutes and tokens/s for each.
#
#   MT_DATA_DIR=/path/to/multi30k/raw bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU here')"
export MT_DATA_DIR=${MT_DATA_DIR:-$(cd ../shared/data/multi30k/raw 2>/dev/null && pwd)}
for tgt in de fr; do
    run=runs/multi30k_gpu_en-$tgt
    mt prepare --config configs/multi30k_gpu.yaml data.tgt_lang=$tgt
    start=$(date +%s)
    mt train --config configs/multi30k_gpu.yaml data.tgt_lang=$tgt train.run_dir=$run 2>&1 | tee "$run.train.log"
    echo "training minutes: $(( ($(date +%s) - start) / 60 ))" | tee -a "$run.train.log"
    mt evaluate --model $run --split test_2016_flickr --beam 5 --paper
    python - "$run" <<'PY'
import csv, statistics, sys
rows = [r for p in __import__("glob").glob(f"{sys.argv[1]}/logs/version_*/metrics.csv") for r in csv.DictReader(open(p))]
tps = [float(r["tok_per_s"]) for r in rows if r.get("tok_per_s")]
print(f"{sys.argv[1]}: median training tokens/s {statistics.median(tps):.0f}")
PY
done
