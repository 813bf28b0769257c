"""How often an export translates a test set as ``mt`` does, line for line, and the BLEU
of each: ``mt export --to hf`` (transformers' ``generate()``) and ``--to ct2``
(CTranslate2), greedy and beam 5, on the same sentences; ``mt`` without its loop
guard, which neither engine has.

    python experiments/export_agreement.py runs/multi30k_cpu [--source S.en.gz --reference S.de.gz] [--beams 1 5]

Exports into a temporary directory; prints one Markdown row per engine and beam.
"""

from __future__ import annotations

import argparse
import gzip
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared/data/multi30k/raw"


def read(path: Path) -> list[str]:
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--source", type=Path, default=SHARED / "test_2016_flickr.en.gz")
    p.add_argument("--reference", type=Path, default=SHARED / "test_2016_flickr.de.gz")
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    args = p.parse_args()
    from mt.decode.ct2 import CT2Translator
    from mt.decode.inference import load
    from mt.decode.translator import Translator
    from mt.evaluate.metrics import bleu
    from mt.export.ct2 import export_ct2
    from mt.export.hf import export_hf, translate_hf

    lines, refs = read(args.source), read(args.reference)
    model, tok, _ = load(args.run)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, ct2_dir = Path(tmp) / "hf", Path(tmp) / "ct2"
        export_hf(args.run, hf_dir)
        export_ct2(args.run, ct2_dir)
        print(f"{args.run} on {args.source.name}, {len(lines)} lines", file=sys.stderr)
        print("| engine | beam | lines identical to mt's | sacreBLEU | seconds |")
        print("|---|---|---|---|---|")
        for beam in args.beams:
            t0 = time.perf_counter()
            # without mt's loop guard, which neither engine has (docs/decoding.md#runaway-output)
            ours = Translator(model, tok, beam=beam, loop_margin=None).translate(lines)
            print(f"| mt | {beam} | | {bleu(ours, refs).score:.2f} | {time.perf_counter() - t0:.0f} |", flush=True)
            engines = {
                "transformers": lambda b: translate_hf(hf_dir, lines, beam=b),
                "CTranslate2": lambda b: CT2Translator(ct2_dir, beam=b).translate(lines),
            }
            for name, translate in engines.items():
                t0 = time.perf_counter()
                theirs = translate(beam)
                same = sum(a == b for a, b in zip(ours, theirs))
                print(f"| {name} | {beam} | {same} of {len(lines)} | {bleu(theirs, refs).score:.2f} | "
                      f"{time.perf_counter() - t0:.0f} |", flush=True)  # fmt: skip
                for s, a, b in [(s, a, b) for s, a, b in zip(lines, ours, theirs) if a != b][:3]:
                    print(f"  differs: {s!r}\n    mt: {a}\n    {name}: {b}", file=sys.stderr)


if __name__ == "__main__":
    main()
