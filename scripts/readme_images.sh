#!/usr/bin/env bash
# Remake the README's pictures from a trained Multi30k en-de run (default:
# the main job's, runs/multi30k_cpu): the cross-attention map, the flow of
# one attention head step by step, validation BLEU against minutes, and the
# page of mt serve.
#
#     bash scripts/readme_images.sh [RUN]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/multi30k_cpu}
OUT=docs/images
mt attention --model "$RUN" --src "A man in an orange hat starring at something." \
    --layer 2 --head mean --out "$OUT/attention.png"
# Decoder self-attention shows every step, the causal mask included; head 3 of
# layer 0 is one that mostly reads the current and the previous pieces.
mt attention --model "$RUN" --src "A man rides a bike." --explain --kind decoder \
    --layer 0 --head 3 --query 4 --out "$OUT/attention_flow.png" > /dev/null
python scripts/plot_val_bleu.py "$RUN" --point "mt, test sacreBLEU (beam 5)=60.1:39.5" \
    --point "JoeyNMT 2.3, test sacreBLEU=25:18.7" --out "$OUT/val_bleu.png"
# The page mt serve serves, in headless Chromium (needs the serve extra and chromium).
python scripts/serve_screenshot.py --model "$RUN" --out "$OUT/serve.png"
