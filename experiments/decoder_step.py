"""The decoder layer's lean step (``mt.fastpath.FastDecoderLayer``) against
the layer's own forward on the same loaded model: ``mt translate``'s
throughput with each, alternating in one process, and their translations
compared line for line.

    python experiments/decoder_step.py RUN [--sentences 1000] [--beams 1 5] [--rounds 3] [--threads 2]

Prints a row per beam size: sentences/s of each round, the layer's own
forward first and the lean step second, then whether the outputs matched.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_serve import DEFAULT_SOURCE, read_lines  # noqa: E402

from mt import fastpath  # noqa: E402
from mt.allocator import keep_freed_memory  # noqa: E402
from mt.inference import Translator, load  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads; one decoding worker")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    model, tok, _ = load(args.run)
    lines = read_lines(args.source, args.sentences)
    print(f"{len(lines)} sentences, {args.threads} threads")
    print("| beam | layer's forward, sentences/s | lean step, sentences/s | ratio of means | same translations |")
    print("|---|---|---|---|---|")
    for beam in args.beams:
        translator = Translator(model, tok, beam=beam, workers=1)
        translator.translate(lines[:64])  # warm up both
        rates: dict[bool, list[float]] = {False: [], True: []}
        outputs: dict[bool, list[str]] = {}
        for _ in range(args.rounds):
            for lean in (False, True):
                fastpath.lean_decoder_step = lean
                start = time.perf_counter()
                outputs[lean] = translator.translate(lines)
                rates[lean].append(len(lines) / (time.perf_counter() - start))
        fastpath.lean_decoder_step = True
        plain, lean = (" / ".join(f"{r:.1f}" for r in rates[k]) for k in (False, True))
        ratio = sum(rates[True]) / sum(rates[False])
        same = outputs[False] == outputs[True]
        print(f"| {beam} | {plain} | {lean} | {ratio:.3f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
