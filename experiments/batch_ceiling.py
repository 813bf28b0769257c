"""What whole-batch decoding can give a service: ``mt translate``'s rate on a
file (sentences sorted by length, cut into batches of a size) against the same
``Translator`` fed shuffled chunks of that size, one at a time, as a server
sees its requests. No HTTP: the ceiling for ``mt serve`` at that many clients.

    python experiments/batch_ceiling.py RUN [--source FILE] [--beam 5] [--sizes 128 64 32 16]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_serve import DEFAULT_SOURCE, read_lines  # noqa: E402

from mt.decode.allocator import keep_freed_memory  # noqa: E402
from mt.decode.inference import load  # noqa: E402
from mt.decode.translator import Translator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 64, 32, 16])
    p.add_argument("--chunked", type=int, default=480, help="sentences translated chunk by chunk (default 480)")
    args = p.parse_args()

    keep_freed_memory()
    model, tok, _ = load(args.run)
    lines = read_lines(args.source, 1000)
    shuffled = lines[:]
    random.Random(0).shuffle(shuffled)
    print("| workers | batch | file sent/s | chunks sent/s |\n|---|---|---|---|")
    for workers in (2, 1):
        for size in args.sizes:
            t = Translator(model, tok, beam=args.beam, batch_size=size, workers=workers)
            t.translate(lines[:32])  # warm up
            start = time.perf_counter()
            t.translate(lines)
            file_rate = len(lines) / (time.perf_counter() - start)
            start = time.perf_counter()
            for i in range(0, args.chunked, size):
                t.translate(shuffled[i : i + size])
            chunk_rate = args.chunked / (time.perf_counter() - start)
            print(f"| {workers} | {size} | {file_rate:.1f} | {chunk_rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
