"""Sentence splitters compared on ``tests/data/sentences`` (English, German, French
paragraphs with abbreviations, numbers, ordinals, quotes, ellipses, URLs): how many
paragraphs each splits exactly into their sentences, and how fast.

    pip install pysbd spacy     # the candidates mt does not use; sentencex is mt's own
    python experiments/sentence_splitters.py [-v]

A candidate that is not installed is left out of the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_sentences import gold  # noqa: E402 - the paragraphs the tests use


def candidates(lang: str) -> dict:
    found = {}
    try:
        import sentencex

        found["sentencex"] = lambda text: list(sentencex.segment(lang, text))
    except ImportError:
        pass
    try:
        import pysbd

        segmenter = pysbd.Segmenter(language=lang, clean=False)
        found["pySBD"] = segmenter.segment
    except ImportError:
        pass
    try:
        import spacy

        nlp = spacy.blank(lang)
        nlp.add_pipe("sentencizer")
        found["spaCy sentencizer"] = lambda text: [s.text for s in nlp(text).sents]
    except ImportError:
        pass
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", action="store_true", help="print each wrong split")
    args = p.parse_args()
    print("| language | splitter | paragraphs split right | µs per paragraph |")
    print("|---|---|---|---|")
    for lang in ("en", "de", "fr"):
        paragraphs = gold(lang)
        for name, split in candidates(lang).items():
            right = 0
            start = time.perf_counter()
            for _ in range(20):
                got = [[s.strip() for s in split(" ".join(p)) if s.strip()] for p in paragraphs]
            per = (time.perf_counter() - start) / (20 * len(paragraphs)) * 1e6
            for want, have in zip(paragraphs, got):
                right += have == want
                if have != want and args.v:
                    print(f"  {lang} {name}: {have}", file=sys.stderr)
            print(f"| {lang} | {name} | {right} of {len(paragraphs)} | {per:.0f} |")


if __name__ == "__main__":
    main()
