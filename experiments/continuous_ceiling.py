"""What continuous batching can give a service, without HTTP: ``C`` clients
that each send their next sentence as soon as the last is answered, fed
straight into ``ContinuousBeamSearch`` (on ``workers`` threads, each with its
own search and an equal share of the clients), beside ``mt translate``'s rate
on the same sentences as a file, measured in turn in the same run.

    python experiments/continuous_ceiling.py RUN [--source FILE] [--beam 5] [--clients 8 32 64]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_serve import DEFAULT_SOURCE, read_lines  # noqa: E402

from mt.decode.allocator import keep_freed_memory  # noqa: E402
from mt.decode.continuous import ContinuousBeamSearch, Sentence  # noqa: E402
from mt.decode.inference import load  # noqa: E402
from mt.decode.translator import Translator


def continuous_rate(translator: Translator, ids: list[list[int]], clients: int, workers: int) -> tuple[float, list]:
    """Sentences/s with ``clients`` sentences always in flight, and the translations (ids) in input order."""
    out: list = [None] * len(ids)
    threads = max(1, torch.get_num_threads() // workers)

    def work(worker: int) -> None:
        torch.set_num_threads(threads)
        mine = list(range(worker, len(ids), workers))  # this worker's sentences, in order
        search = ContinuousBeamSearch(translator.model, translator.settings, translator.beam)
        fed = 0

        def feed(n: int) -> int:
            search.add([Sentence(ids[i], tag=i) for i in mine[fed : fed + n]])
            return min(n, len(mine) - fed)

        fed += feed(clients // workers)
        while len(search):
            finished = search.step()
            for x, hyps in finished:
                out[x.tag] = hyps[0].tokens
            fed += feed(len(finished))  # each answered client sends its next sentence

    start = time.perf_counter()
    pool = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return len(ids) / (time.perf_counter() - start), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--clients", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    keep_freed_memory()
    model, tok, _ = load(args.run)
    translator = Translator(model, tok, beam=args.beam)
    lines = read_lines(args.source, args.sentences)
    ids = translator.encode(lines)
    want = [n[0][0] for n in translator.translate_ids(ids)]
    translator.translate(lines[:32])  # warm up
    print("| round | engine | workers | clients | sentences/s | × file | differ from the file |")
    print("|---|---|---|---|---|---|---|")
    for r in range(1, args.rounds + 1):
        start = time.perf_counter()
        translator.translate_ids(ids)
        file_rate = len(ids) / (time.perf_counter() - start)
        print(f"| {r} | file (mt translate) | {translator.workers} | | {file_rate:.1f} | 1.00 | |", flush=True)
        for workers in (1, 2):
            for clients in args.clients:
                rate, got = continuous_rate(translator, ids, clients, workers)
                differ = sum(a != b for a, b in zip(got, want))
                print(f"| {r} | continuous | {workers} | {clients} | {rate:.1f} | {rate / file_rate:.2f} | {differ} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
