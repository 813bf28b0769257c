"""Are two prepared directories the same data? Same vocabulary (pieces and
scores), same token ids and texts in every split, and the same training
batches for a seed and epochs. Either may come from an earlier mt (its
splits written by datasets.save_to_disk).

    git worktree add /tmp/mt-old 8dbe1ac
    DATA=$PWD/../shared/data/multi30k/raw
    (cd /tmp/mt-old && PYTHONPATH=. python -m mt prepare --config configs/multi30k_cpu.yaml \\
        --data-dir $DATA data.prepared_dir=/tmp/prepared-old)
    mt prepare --config configs/multi30k_cpu.yaml --data-dir $DATA data.prepared_dir=/tmp/prepared-new
    python experiments/same_prepared.py /tmp/prepared-old /tmp/prepared-new
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mt.data.batches import Split, TokenBatchSampler
from mt.data.tokenizer import Tokenizer


def pieces(directory: Path) -> list:
    tok = Tokenizer.load(directory)
    return [[(p.id_to_piece(i), p.get_score(i)) for i in range(p.get_piece_size())] for p in (tok.src, tok.tgt)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--epochs", type=int, nargs="+", default=[0, 1, 7])
    args = p.parse_args()
    same = {"vocabulary": pieces(args.a) == pieces(args.b)}
    splits = json.loads((args.a / "prepare.json").read_text())["summary"]["splits"]
    for name in splits:
        a, b = Split(args.a / name), Split(args.b / name)
        same[name] = (a.src, a.tgt, a.src_text, a.tgt_text) == (b.src, b.tgt, b.src_text, b.tgt_text)
    a, b = Split(args.a / "train"), Split(args.b / "train")
    for epoch in args.epochs:
        batches = []
        for split in (a, b):
            sampler = TokenBatchSampler(split.src_lens, split.tgt_lens, args.max_tokens, seed=args.seed)
            sampler.set_epoch(epoch)
            batches.append([batch.tolist() for batch in sampler.all_batches()])
        same[f"batches, epoch {epoch}"] = batches[0] == batches[1]
    for what, equal in same.items():
        print(f"{what:<24}{'same' if equal else 'DIFFERENT'}")
    sys.exit(0 if all(same.values()) else 1)


if __name__ == "__main__":
    main()
