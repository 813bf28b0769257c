"""Every head of a trained run, step by step against its own forward pass
(``mt attention --explain``'s checks), over the first N test sentences of
Multi30k and several temperatures: the largest difference of each step, and
its share of the tolerance.

    python experiments/lesson_sweep.py RUN [--sentences 20] [--source FILE] [--temperature T ...]
"""

from __future__ import annotations

import argparse
import gzip

from mt.decode.inference import load
from mt.inspect.capture import translate_with_attention
from mt.inspect.lesson import CHECKED, capture, head_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run")
    parser.add_argument("--sentences", type=int, default=20)
    parser.add_argument("--source", default="../shared/data/multi30k/raw/test_2016_flickr.en.gz")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    args = parser.parse_args()
    model, tok, _ = load(args.run, fast=False)
    opener = gzip.open if args.source.endswith(".gz") else open
    with opener(args.source, "rt", encoding="utf-8") as f:
        lines = [line.strip() for _, line in zip(range(args.sentences), f)]
    worst = {k: 0.0 for k in CHECKED}
    share = {k: 0.0 for k in CHECKED}
    heads = failed = 0
    for text in lines:
        src = tok.encode_src([text])[0]
        tgt, _ = translate_with_attention(model, tok, src, 2 * len(src) + 10)
        for t in args.temperature:
            captured = capture(model, tok, src, tgt, t)
            for kind, layer in captured:
                for head in range(model.cfg.n_heads):
                    steps = head_steps(model, captured, kind, layer, head, [], [], t)
                    heads += 1
                    failed += bool(steps.failures())
                    for k in CHECKED:
                        worst[k] = max(worst[k], steps.diffs[k])
                        share[k] = max(share[k], steps.diffs[k] / steps.allowed(k))
    print(f"{heads} heads checked ({len(lines)} sentences x {len(args.temperature)} temperatures), {failed} failed")
    print(f"{'step':<10} {'max |diff|':>11} {'max diff / allowed':>19}")
    for k in CHECKED:
        print(f"{k:<10} {worst[k]:>11.2e} {share[k]:>19.3f}")


if __name__ == "__main__":
    main()
