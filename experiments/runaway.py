"""The loop guard (``--loop-margin``, mt/decode/search.py) with and without, on a run:

* on ``tests/data/adversarial/en.txt`` (50 inputs made to make a model loop or run
  long: repeated words, lists, numbers, URLs, all-caps, emoji, mixed scripts), the
  longest output/source ratio in subword pieces and the most copies of a word in a
  row in any output;
* on the run's validation and test sets, how many outputs the guard changes, and
  BLEU with and without it.

    python experiments/runaway.py runs/multi30k_main [--splits val test] [--beams 1 5] [--time 6]

Prints a Markdown table (docs/decoding.md#runaway-output) and, with -v, each
adversarial input with its outputs and every output the guard changed. With
``--time K``: the last split decoded K times with and without the guard,
alternating, and the best times' ratio (what the guard costs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADVERSARIAL = ROOT / "tests" / "data" / "adversarial" / "en.txt"


def most_copies(words: list) -> int:
    """The most times one word (or piece) comes in a row."""
    best = run = 1 if words else 0
    for a, b in zip(words, words[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--splits", nargs="*", default=["val", "test"])
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--time", type=int, default=0, metavar="K")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)

    from mt.config import DECODING
    from mt.decode.inference import DecodingOptions, open_translator
    from mt.evaluate.metrics import bleu
    from mt.evaluate.scoring import split_texts

    sources = ADVERSARIAL.read_text(encoding="utf-8").splitlines()
    sets = {"adversarial": (sources, None)}
    for split in args.splits:
        src, ref, _ = split_texts(args.run, split)
        sets[split] = (src, ref)
    print("| beam | set | guard | longest output/source (pieces) | outputs at the length limit | "
          "most copies of a word in a row | BLEU | outputs changed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    off, on = None, DECODING.loop_margin
    for beam in args.beams:
        out = {}  # (margin, set) -> output ids per line
        for margin in (off, on):
            t, _ = open_translator([args.run], DecodingOptions(beam=beam, loop_margin=margin), warn=lambda m: None)
            for name, (src, _) in sets.items():
                out[margin, name] = [n_best[0][0] for n_best in t.translate_ids(t.encode(src))]
        tok, s = t.tok, t.settings
        for name, (src, ref) in sets.items():
            src_len = [len(x) - 1 for x in tok.encode_src(src)]  # without the EOS
            for margin in (off, on):
                ids = out[margin, name]
                hyps = tok.decode_tgt(ids)
                ratio = max(len(o) / max(n, 1) for o, n in zip(ids, src_len))
                at_limit = sum(len(o) + 1 >= int(s.max_len_a * (n + 1) + s.max_len_b) for o, n in zip(ids, src_len))
                copies = max(most_copies(h.split()) for h in hyps)
                score = f"{bleu(hyps, ref, tok.lowercase).score:.2f}" if ref else ""
                changed = sum(a != b for a, b in zip(out[off, name], ids))
                guard = "off" if margin is None else str(margin)
                print(f"| {beam} | {name} | {guard} | {ratio:.2f} | {at_limit} | {copies} | {score} | "
                      f"{changed} of {len(ids)} |")  # fmt: skip
        if args.verbose:
            for name, (src, _) in sets.items():
                texts = {m: tok.decode_tgt(out[m, name]) for m in (off, on)}
                for i, x in enumerate(src):
                    if name == "adversarial" or texts[off][i] != texts[on][i]:
                        changed = f"\n  on:  {texts[on][i]}" if texts[on][i] != texts[off][i] else ""
                        print(f"\n[beam {beam}] {name} line {i + 1}: {x}\n  off: {texts[off][i]}{changed}")
        if args.time:
            src = sets[args.splits[-1]][0]
            times = {off: [], on: []}
            translators = {m: open_translator([args.run], DecodingOptions(beam=beam, loop_margin=m))[0] for m in times}
            for k in range(args.time):
                for margin in (off, on) if k % 2 == 0 else (on, off):
                    start = time.perf_counter()
                    translators[margin].translate(src)
                    times[margin].append(time.perf_counter() - start)
            best_off, best_on = min(times[off]), min(times[on])
            print(f"\nbeam {beam}, {args.splits[-1]}: {best_off:.2f} s without the guard, {best_on:.2f} s with it "
                  f"(best of {args.time}): {best_on / best_off:.3f}x")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
