#!/usr/bin/env bash
# How the default vocabulary size was chosen: the CPU recipe with a joint
# sentencepiece BPE vocabulary of each size, trained for the same wall-clock
# budget; prints validation BLEU (greedy) and tokens/s at the end of each run.
#
#   bash experiments/vocab_sweep.sh [MINUTES] [SIZE ...]      (default: 10 minutes; 4000 8000 16000)
#
# VOCAB_SWEEP_OVERRIDES adds config overrides to every training, e.g.
# VOCAB_SWEEP_OVERRIDES="train.lr=0.002" for the sweep in docs/results/README.md, made before
# the recipe's peak learning rate went up.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
if [ -z "${MT_DATA_DIR:-}" ] && [ -d ../shared/data/multi30k/raw ]; then
    export MT_DATA_DIR=$(cd ../shared/data/multi30k/raw && pwd)
fi
minutes=${1:-10}; shift || true
sizes=${*:-4000 8000 16000}
for v in $sizes; do
    prepared=data/prepared/multi30k.en-de.v$v run=runs/vocab_sweep/v$v
    rm -rf "$run"
    mt prepare --config configs/multi30k_cpu.yaml data.vocab_size=$v data.prepared_dir=$prepared | tail -5
    mt train --config configs/multi30k_cpu.yaml data.vocab_size=$v data.prepared_dir=$prepared \
        train.run_dir=$run train.max_minutes=$minutes train.average_last=0 train.average_choose=false \
        ${VOCAB_SWEEP_OVERRIDES:-} 2>&1 | grep -E "valid|trained|error"
done
python - $sizes <<'PY'
import csv, glob, sys
print(f"{'vocab':>6}{'steps':>7}{'val BLEU':>10}{'best':>7}{'tok/s':>8}")
for v in sys.argv[1:]:
    rows = [r for p in glob.glob(f"runs/vocab_sweep/v{v}/logs/version_*/metrics.csv") for r in csv.DictReader(open(p))]
    val = [r for r in rows if r.get("val_bleu")]
    tps = [float(r["tok_per_s"]) for r in rows if r.get("tok_per_s")]
    print(f"{v:>6}{val[-1]['step']:>7}{float(val[-1]['val_bleu']):>10.2f}"
          f"{max(float(r['val_bleu']) for r in val):>7.2f}{sum(tps) / len(tps):>8.0f}")
PY
