#!/usr/bin/env bash
# The main job, end to end: prepare -> train -> evaluate test_2016_flickr
# (beam 5, sacreBLEU and paper-style BLEU) -> attention map of a test
# sentence -> BLEU table.
#
#   bash scripts/run_multi30k.sh [CONFIG] [section.key=value ...]
#
# CONFIG defaults to configs/multi30k_gpu.yaml when a CUDA GPU is present,
# configs/multi30k_cpu.yaml otherwise. The corpus is read from $MT_DATA_DIR,
# else from ../shared/data/multi30k/raw when that exists, else downloaded
# (checksums verified). Overrides apply to prepare and train alike, e.g.
# data.tgt_lang=fr for en->fr.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate

if [ $# -gt 0 ] && [[ "$1" == *.yaml ]]; then
    config=$1; shift
elif python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    config=configs/multi30k_gpu.yaml
else
    config=configs/multi30k_cpu.yaml
fi
if [ -z "${MT_DATA_DIR:-}" ] && [ -d ../shared/data/multi30k/raw ]; then
    export MT_DATA_DIR=$(cd ../shared/data/multi30k/raw && pwd)
fi
echo "== config $config; corpus ${MT_DATA_DIR:-(download)}"

read -r run_dir tgt_lang prepared < <(python - "$config" "$@" <<'PY'
import sys
from mt.config import load_config
cfg = load_config(sys.argv[1], sys.argv[2:])
print(cfg.train.run_dir, cfg.data.tgt_lang, cfg.data.prepared_path())
PY
)

echo "== prepare"
mt prepare --config "$config" "$@"
echo "== train (run directory $run_dir)"
mt train --config "$config" "$@"
echo "== evaluate test_2016_flickr, beam 5"
mt evaluate --model "$run_dir" --split test_2016_flickr --beam 5 --paper
echo "== attention map of the first test sentence"
sentence=$(python -c "from mt.data.batches import Split; print(Split(__import__('pathlib').Path('$prepared') / 'test_2016_flickr').src_text[0])")
mt attention --model "$run_dir" --src "$sentence" --kind cross --out "$run_dir/attention-cross.png" --stats --align \
    --html "$run_dir/attention.html"

echo "== BLEU table"
python - "$run_dir" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
s = json.loads((run / "eval" / "test_2016_flickr.beam5.json").read_text())
meta = json.loads((run / "model.json").read_text())
print(f"| run | model | test | beam | BLEU (paper-style) | sacreBLEU | chrF |")
print(f"|---|---|---|---|---|---|---|")
print(f"| {run} | {meta.get('source', '')} | {s['test_set']} | {s['beam']} | {s.get('paper_bleu', '-')} | {s['bleu']} | {s['chrf']} |")
print(f"sacreBLEU signature: {s['bleu_signature']}")
PY
