#!/usr/bin/env bash
# The GPU recipe on a GPU (docs/gpu.md):
# en->de and en->fr with configs/multi30k_gpu.yaml on one GPU, bf16. The
# trainings run side by side on the same GPU (this 2.3M-parameter model keeps
# a large GPU mostly idle, and each process needs a CPU core or a few of its own).
# Prints paper-style BLEU, sacreBLEU, training minutes and tokens/s for each,
# and writes them with the logs to $OUT (default runs/gpu_check).
#
# A GPU machine that can install packages:
#   MT_DATA_DIR=/path/to/multi30k/raw bash scripts/gpu_check.sh
# An offline GPU machine that has its own PyTorch:
#   bash experiments/pack_device.sh      # first, where there is a network: .device/ holds the corpus and wheels
#   bash scripts/gpu_check.sh            # there, with .device beside the code
#
# To bound the run, GPU_CHECK_OVERRIDES=train.max_minutes=6 stops every training after
# 6 minutes (validation included), then averages and scores what they reached; the
# summary's updates column says how far that was.
#
# GPU_CHECK_OVERRIDES="key=value ..." is passed to every training (e.g. train.lr=0.005);
# GPU_CHECK_LANGS="de fr" picks the target languages; GPU_CHECK_SEEDS="1 2 3" trains each
# pair once per seed, side by side, and scores the seeds' ensemble too (a recipe's
# figure is one draw: two seeds of the CPU runs differed by up to 0.8 BLEU); GPU_CHECK_REQUIRE_GPU=0
# lets the script's plumbing be tried on a CPU with a few updates.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -d .device ]; then  # offline: use the machine's python3 and its packages
    python3 -m pip install -q --no-index --no-deps --find-links .device/wheels datasets dill multiprocess sacremoses
    # mt itself runs from this tree: installing it would need the image's setuptools to be >= 77
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export MT_DATA_DIR=${MT_DATA_DIR:-$PWD/.device/multi30k/raw}
else
    bash scripts/setup.sh
    . .venv/bin/activate
    export MT_DATA_DIR=${MT_DATA_DIR:-$(cd ../shared/data/multi30k/raw 2>/dev/null && pwd)}
fi
if [ "${GPU_CHECK_REQUIRE_GPU:-1}" = 1 ]; then
    python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU here')"
fi
python3 -m pip list 2>/dev/null | grep -iE "^(torch|lightning|datasets|pyarrow|fsspec|huggingface.hub|sentencepiece|sacrebleu|sacremoses) " || true
mt() { python3 -m mt.cli.main "$@"; }  # whether or not pip put the console script on PATH
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"

out=${OUT:-runs/gpu_check}
mkdir -p "$out"
read -r -a overrides <<< "${GPU_CHECK_OVERRIDES:-}"
langs=${GPU_CHECK_LANGS:-de fr}
seeds=${GPU_CHECK_SEEDS:-1}
# This 2.3M-parameter model keeps a large GPU mostly idle: every training runs
# side by side, each with an equal share of the CPU cores (OMP_NUM_THREADS, unless
# set): more threads than cores made this script's CPU check about 3.6x slower.
trainings=$(( $(wc -w <<< "$langs") * $(wc -w <<< "$seeds") ))
share=$(( $(nproc) / trainings ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( share > 1 ? share : 1 ))}
check() {  # target language, seed -> trains, evaluates, writes $out/<lang>-s<seed>.*
    local tgt=$1 seed=$2 name=$1-s$2 run=runs/gpu_check_en-$1-s$2 start
    start=$(date +%s)
    rm -rf "$run"  # a fresh run, not a resumed one
    mt train --config configs/multi30k_gpu.yaml "data.tgt_lang=$tgt" "train.seed=$seed" "train.run_dir=$run" \
        "${overrides[@]}"
    echo "training seconds: $(($(date +%s) - start))"
    mt evaluate --model "$run" --split test_2016_flickr --beam 5 --paper
    cp "$run/eval/test_2016_flickr.beam5.json" "$out/$name.scores.json"
    cat "$run"/logs/version_*/metrics.csv > "$out/$name.metrics.csv"
}
status=0
pids=() names=() ready=()
for tgt in $langs; do  # each pair's data once, before its trainings
    mt prepare --config configs/multi30k_gpu.yaml "data.tgt_lang=$tgt" "${overrides[@]}" > "$out/$tgt.prepare.log" 2>&1 &
    pids+=($!)
done
i=0
for tgt in $langs; do  # a pair whose data failed is reported as such, not trained
    if wait "${pids[i]}"; then ready+=("$tgt"); else status=1 names+=("$tgt.prepare"); fi
    i=$((i + 1))
done
pids=()
for tgt in "${ready[@]}"; do
    for seed in $seeds; do
        check "$tgt" "$seed" > "$out/$tgt-s$seed.log" 2>&1 &
        pids+=($!) names+=("$tgt-s$seed")
    done
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for tgt in "${ready[@]}"; do  # with several seeds, their ensemble too
    runs=()
    for seed in $seeds; do [ -f "$out/$tgt-s$seed.scores.json" ] && runs+=("runs/gpu_check_en-$tgt-s$seed"); done
    if [ ${#runs[@]} -gt 1 ]; then
        mt evaluate --model "${runs[@]}" --split test_2016_flickr --beam 5 --paper --json \
            > "$out/$tgt-ensemble.scores.json" 2> "$out/$tgt-ensemble.log" || status=1
        names+=("$tgt-ensemble")
    fi
done

python3 - "$out" "${names[@]}" <<'PY' | tee "$out/summary.txt"
import csv, json, re, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
print("en->xx           paper-BLEU  sacreBLEU  chrF  train-min  median-tok/s  updates")
for name in sys.argv[2:]:
    log = (out / f"{name}.log").read_text() if (out / f"{name}.log").exists() else ""
    seconds = re.findall(r"training seconds: (\d+)", log)
    if not (out / f"{name}.scores.json").exists() or not (out / f"{name}.scores.json").stat().st_size:
        print(f"en->{name:<11} failed: see {out}/{name}.log")
        continue
    s = json.loads((out / f"{name}.scores.json").read_text())
    if name.endswith("-ensemble"):
        print(f"en->{name:<11} {s['paper_bleu']:10.2f}  {s['bleu']:9.2f}  {s['chrf']:4.1f}  (the seeds' runs as one ensemble)")
        continue
    rows = list(csv.DictReader(open(out / f"{name}.metrics.csv")))
    tps = [float(r["tok_per_s"]) for r in rows if r.get("tok_per_s") not in (None, "", "tok_per_s")]
    steps = max((int(r["step"]) for r in rows if r.get("step", "").isdigit()), default=0) + 1
    minutes = int(seconds[-1]) / 60 if seconds else float("nan")
    median = statistics.median(tps) if tps else float("nan")
    print(f"en->{name:<11} {s['paper_bleu']:10.2f}  {s['bleu']:9.2f}  {s['chrf']:4.1f}  {minutes:9.1f}  {median:12.0f}  {steps}")
PY
exit $status
