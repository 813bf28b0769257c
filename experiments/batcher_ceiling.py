"""What ``mt serve``'s decoding processes give without HTTP: ``C`` asyncio
clients in one process that each hand ``mt.serve.batcher.Batcher`` their next
sentence as soon as the last is answered, beside ``mt translate``'s rate on
the same sentences as a file, measured in turn in the same run.

    python experiments/batcher_ceiling.py RUN [--clients 32] [--workers 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_serve import DEFAULT_SOURCE, read_lines  # noqa: E402

from mt.decode.allocator import keep_freed_memory  # noqa: E402
from mt.decode.inference import load  # noqa: E402
from mt.decode.translator import Translator
from mt.serve.batcher import Batcher, Options  # noqa: E402


async def served_rate(translator: Translator, lines: list[str], clients: int, workers: int, beam: int) -> float:
    batcher = Batcher(translator, max_batch=64, max_wait_ms=10.0, workers=workers)
    batcher.start()
    options = Options(beam, 1.0, 1)
    try:
        await batcher.translate(lines[:8], [""] * 8, options)  # the processes have started and warmed up

        async def client(i: int) -> None:
            for line in lines[i::clients]:
                await batcher.translate([line], [""], options)

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return len(lines) / (time.perf_counter() - start)
    finally:
        await batcher.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=2, help="send the sentences this many times (default 2)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()

    keep_freed_memory()
    model, tok, _ = load(args.run)
    lines = read_lines(args.source, args.sentences)
    offline = Translator(model, tok, beam=args.beam)
    offline.translate(lines[:32])  # warm up
    start = time.perf_counter()
    offline.translate(lines)
    file_rate = len(lines) / (time.perf_counter() - start)
    rate = asyncio.run(
        served_rate(Translator(model, tok, beam=args.beam, workers=1), lines * args.repeat, args.clients,
                    args.workers, args.beam)
    )  # fmt: skip
    print(f"file: {file_rate:.1f} sentences/s; batcher, {args.clients} clients, {args.workers} processes: "
          f"{rate:.1f} sentences/s ({rate / file_rate:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
