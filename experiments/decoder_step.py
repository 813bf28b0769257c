"""The decoder layer's lean step (``mt.decode.fastpath.FastDecoderLayer``) against
the layer's own forward on the same loaded model, alternating in one process:

* one decoding step (``Transformer.decode`` of one position against a cache of
  ``--past`` positions and a source of 14 pieces), one thread, per row count:
  the fastest and the median of ``--repeats`` timings of each;
* ``mt translate``'s throughput on the test sentences, per beam size, with
  the translations compared line for line.

    python experiments/decoder_step.py RUN [--rows 5 15 75 170 320] [--sentences 1000] [--beams 1 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_serve import DEFAULT_SOURCE, read_lines  # noqa: E402

from mt.decode import fastpath as fastpath  # noqa: E402
from mt.decode.allocator import keep_freed_memory  # noqa: E402
from mt.decode.inference import load  # noqa: E402
from mt.decode.translator import Translator


def step_times(model, rows: list[int], past: int, repeats: int) -> None:
    print("| rows | layer's forward, ms per step: fastest / median | lean step | ratio of the fastest / medians |")
    print("|---|---|---|---|")
    torch.manual_seed(0)
    for n in rows:
        enc = model.encode(torch.randint(4, model.cfg.src_vocab_size, (n, 14)))
        cache = model.source_cache(enc)
        for _ in range(past - 1):
            cache = model.decode(torch.randint(4, model.cfg.tgt_vocab_size, (n, 1)), enc, cache).cache
        last, tgt = torch.randint(4, model.cfg.tgt_vocab_size, (2, n, 1))
        times: dict[bool, list[float]] = {False: [], True: []}
        calls = max(3, 600 // n)
        for _ in range(repeats):
            for lean in (False, True):
                fastpath.lean_decoder_step = lean
                spent = 0.0
                for _ in range(calls):
                    # untimed: the cache of `past` positions made again, with room for the timed step's
                    # position (a cache appended to once is copied by the next append to it)
                    ready = model.decode(last, enc, cache).cache
                    start = time.perf_counter()
                    model.decode(tgt, enc, ready)
                    spent += time.perf_counter() - start
                times[lean].append(spent / calls)
        fastpath.lean_decoder_step = True
        best = {k: 1000 * min(v) for k, v in times.items()}
        median = {k: 1000 * statistics.median(v) for k, v in times.items()}
        print(f"| {n} | {best[False]:.2f} / {median[False]:.2f} | {best[True]:.2f} / {median[True]:.2f} | "
              f"{best[False] / best[True]:.3f} / {median[False] / median[True]:.3f} |", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    p.add_argument("--rows", type=int, nargs="*", default=[5, 15, 75, 170, 320], help="rows of the step timings")
    p.add_argument("--past", type=int, default=9, help="target positions already in the cache")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the translate runs; one decoding worker")
    args = p.parse_args()

    keep_freed_memory()
    model, tok, _ = load(args.run)
    torch.set_num_threads(1)
    with torch.inference_mode():
        step_times(model, args.rows, args.past, args.repeats)

    torch.set_num_threads(args.threads)
    lines = read_lines(args.source, args.sentences)
    print(f"\n{len(lines)} sentences, {args.threads} threads")
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
