#!/usr/bin/env bash
# Sequence-level knowledge distillation (Kim & Rush 2016) from trained runs:
# the teachers (one run, or several as an ensemble) translate the training
# sources with beam 5; a new model of the GPU recipe trains on the original
# pairs plus the teachers' translations (KD_MIX=0: the translations alone).
#
#   bash scripts/distill.sh RUN [RUN ...] [+ RUN [RUN ...] ...] [-- section.key=value ...]
#
# Groups separated by + translate separately, each group as one ensemble, and
# every group's translation is added: several translations of each source
# (as in data diversification, Nguyen et al. 2020).
# The overrides after -- go to prepare and train, e.g.
#   bash scripts/distill.sh runs/a runs/b -- train.max_steps=5000 train.cooldown_steps=2000
# Environment: KD_DIR (default data/kd: the teachers' output, the corpus built
# from it and its prepared copy; an existing teacher output is reused when
# the same runs made it, and is an error otherwise),
# KD_RUN (default runs/kd), KD_MIX (default 1), KD_TEST (the split scored at
# the end, default test_2016_flickr; paper-style too where the corpus has a
# tok/ directory beside it), MT_DATA_DIR (the corpus, <split>.<lang>[.gz]
# files; default ../shared/data/multi30k/raw), CONFIG (default
# configs/multi30k_gpu.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate

usage="usage: bash scripts/distill.sh RUN [RUN ...] [+ RUN [RUN ...] ...] [-- overrides]"
runs=() starts=(0)  # every group's runs in one list; group g is runs[starts[g]] up to runs[starts[g+1]-1]
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    if [ "$1" = "+" ]; then
        [ ${#runs[@]} -gt "${starts[-1]}" ] || { echo "$usage" >&2; exit 2; }
        starts+=(${#runs[@]})
    else
        runs+=("$1")
    fi
    shift
done
[ $# -gt 0 ] && shift
[ ${#runs[@]} -gt "${starts[-1]}" ] || { echo "$usage" >&2; exit 2; }
starts+=(${#runs[@]})
config=${CONFIG:-configs/multi30k_gpu.yaml}
kd=${KD_DIR:-data/kd} run=${KD_RUN:-runs/kd} mix=${KD_MIX:-1}
raw=$(cd "${MT_DATA_DIR:-../shared/data/multi30k/raw}" && pwd)
read -r src tgt < <(python - "$config" "$@" <<'PY'
import sys
from mt.config import load_config
cfg = load_config(sys.argv[1], sys.argv[2:])
print(cfg.data.src_lang, cfg.data.tgt_lang)
PY
)

cat_split() {  # the plain text of <split>.<lang>[.gz] in the corpus
    if [ -f "$raw/$1.$2.gz" ]; then zcat "$raw/$1.$2.gz"; else cat "$raw/$1.$2"; fi
}

mkdir -p "$kd/raw"
outputs=()  # one translation of train.$src per group: train.$tgt.teacher, then .teacher2, ...
for ((g = 0; g < ${#starts[@]} - 1; g++)); do
    teachers=("${runs[@]:${starts[g]}:$((starts[g + 1] - starts[g]))}")
    out=$kd/train.$tgt.teacher$([ "$g" = 0 ] || echo $((g + 1)))
    if [ ! -s "$out" ]; then
        echo "== teachers ${teachers[*]} translate train.$src"
        cat_split train "$src" > "$kd/train.$src"
        mt translate --model "${teachers[@]}" --beam 5 -i "$kd/train.$src" -o "$out"
        echo "${teachers[*]}" > "$out.runs"
    elif [ "$(cat "$out.runs" 2>/dev/null)" != "${teachers[*]}" ]; then
        echo "distill.sh: $out was decoded by '$(cat "$out.runs" 2>/dev/null)', not '${teachers[*]}':" \
            "delete it to decode again, or set KD_DIR" >&2
        exit 1
    else
        echo "== reusing $out (decoded by ${teachers[*]})"
    fi
    outputs+=("$out")
done

# The corpus: train = (original +) distilled pairs; every other split as it is.
for f in "$raw"/*; do
    name=$(basename "$f")
    case $name in train.*) ;; *) ln -sfn "$f" "$kd/raw/$name" ;; esac
done
[ -d "$raw/../tok" ] && ln -sfn "$(cd "$raw/../tok" && pwd)" "$kd/tok"  # the paper-style references
copies=${#outputs[@]}
if [ "$mix" = 1 ]; then
    copies=$((copies + 1))
    { cat_split train "$tgt"; cat "${outputs[@]}"; } > "$kd/raw/train.$tgt"
else
    cat "${outputs[@]}" > "$kd/raw/train.$tgt"
fi
for _ in $(seq "$copies"); do cat_split train "$src"; done > "$kd/raw/train.$src"
wc -l "$kd/raw/train.$src" "$kd/raw/train.$tgt"

data=(data.source=local "data.local_dir=$kd/raw" "data.prepared_dir=$kd/prepared.$src-$tgt")
mt prepare --config "$config" "${data[@]}" "$@"
mt train --config "$config" "${data[@]}" "train.run_dir=$run" "$@"
paper=(); [ -e "$kd/tok" ] && paper=(--paper)
mt evaluate --model "$run" --split "${KD_TEST:-test_2016_flickr}" --beam 5 "${paper[@]}"
