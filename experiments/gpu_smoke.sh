#!/usr/bin/env bash
# A few minutes' check of the code on a CUDA GPU: the README's toy tour run there
# (training, the fast path and the fused attention on CUDA), the fast path against
# the textbook model on CUDA, and configs/multi30k_gpu.yaml trained alone for
# SMOKE_MINUTES (default 1.5) to read its tokens/s. Runs go to runs/gpu_smoke*.
#
#   bash experiments/gpu_smoke.sh        # with .device beside the code on an offline GPU machine (pack_device.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .device ]; then  # offline: the machine's python3 and its packages, as scripts/gpu_check.sh does
    python3 -m pip install -q --no-index --no-deps --find-links .device/wheels datasets dill multiprocess sacremoses
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export MT_DATA_DIR=${MT_DATA_DIR:-$PWD/.device/multi30k/raw}
fi
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU here')"
mt() { python3 -m mt.cli.main "$@"; }
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

echo "== the toy tour on the GPU"
rm -rf runs/gpu_smoke_toy
mt prepare --config configs/toy.yaml
mt train --config configs/toy.yaml train.run_dir=runs/gpu_smoke_toy | tail -2
echo "the big dog sees a red bird" | mt translate --model runs/gpu_smoke_toy
mt evaluate --model runs/gpu_smoke_toy --split test | head -3
mt attention --model runs/gpu_smoke_toy --src "the big dog sees a red bird" --out runs/gpu_smoke_toy/attention.png

echo "== the fast path against the textbook model, on CUDA"
python3 - <<'PY'
import copy
import torch
from mt.config import ModelConfig
from mt.decode.fastpath import speed_up
from mt.model.transformer import Transformer
from mt.decode.search import SearchSettings, beam_search, greedy_search

torch.manual_seed(0)
cfg = ModelConfig(d_model=128, n_heads=4, enc_layers=4, dec_layers=4, d_ff=256, dropout=0.0,
                  src_vocab_size=8000, tgt_vocab_size=8000, pad_id=0)
plain = Transformer(cfg).cuda().eval()
fast = speed_up(copy.deepcopy(plain))
src = torch.randint(4, 8000, (64, 20), device="cuda")
s = SearchSettings(bos_id=2, eos_id=3, pad_id=0, max_len_a=0.0, max_len_b=20)
with torch.no_grad():
    a, b = plain.encode(src).memory, fast.encode(src).memory
    print("encoder max |fast - plain|:", float((a - b).abs().max()))
for name, search in (("greedy", lambda m: greedy_search(m, src, s)), ("beam 5", lambda m: beam_search(m, src, s, 5))):
    x, y = search(plain), search(fast)
    flat = lambda r: [h if not isinstance(h, list) else h[0] for h in r]
    same = sum(p.tokens == q.tokens for p, q in zip(flat(x), flat(y)))
    print(f"{name}: {same}/{len(src)} outputs identical")
PY

echo "== configs/multi30k_gpu.yaml alone, ${SMOKE_MINUTES:-1.5} min"
rm -rf runs/gpu_smoke
mt prepare --config configs/multi30k_gpu.yaml | tail -1
mt train --config configs/multi30k_gpu.yaml "train.max_minutes=${SMOKE_MINUTES:-1.5}" train.val_bleu=false \
    train.run_dir=runs/gpu_smoke | tail -2
python3 - <<'PY'
import csv, glob, statistics
rows = [r for p in glob.glob("runs/gpu_smoke/logs/version_*/metrics.csv") for r in csv.DictReader(open(p))]
tps = [float(r["tok_per_s"]) for r in rows if r.get("tok_per_s")]
steps = max(int(r["step"]) for r in rows) + 1
minutes = max(float(r["minutes"]) for r in rows if r.get("minutes"))
print(f"{steps} updates in {minutes:.2f} min ({steps / minutes / 60:.1f}/s), median {statistics.median(tps):,.0f} target tokens/s")
PY
