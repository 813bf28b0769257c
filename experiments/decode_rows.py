"""Where a continuous search's extra cost per sentence goes: rows per decoding
call and time per row, mt translate's sorted batches against a
``ContinuousBeamSearch`` with ``C`` sentences always in flight, one thread.

    python experiments/decode_rows.py RUN [--clients 16 32] [--sentences 500]

The search lets waiting sentences in as ``mt serve``'s workers do (once they
are a quarter of those under way); each finished sentence is replaced by the
next at once. For each engine: sentences/s, decoder rows per sentence and per
``Transformer.decode`` call, the decoder's µs per row, and the milliseconds
per sentence spent elsewhere (encoding, joins, the search's bookkeeping).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_serve import DEFAULT_SOURCE, read_lines  # noqa: E402

from mt.decode.allocator import keep_freed_memory  # noqa: E402
from mt.decode.continuous import ContinuousBeamSearch, Sentence  # noqa: E402
from mt.decode.inference import load  # noqa: E402
from mt.decode.translator import Translator


class CountedDecode:
    """Wraps ``model.decode``: rows decoded, calls and seconds spent."""

    def __init__(self, model) -> None:
        self.inner, self.rows, self.calls, self.seconds = model.decode, 0, 0, 0.0

    def __call__(self, tgt, *args, **kwargs):
        start = time.perf_counter()
        out = self.inner(tgt, *args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.rows += tgt.size(0)
        self.calls += 1
        return out


def continuous(translator: Translator, ids: list[list[int]], clients: int) -> None:
    """Decode ``ids`` with ``clients`` sentences in flight, joining as mt serve's workers do."""
    search = ContinuousBeamSearch(translator.model, translator.settings, translator.beam)
    queue = [Sentence(x) for x in ids]
    waiting, queue = queue[:clients], queue[clients:]
    under_way = 0
    while under_way or waiting:
        if waiting and (not under_way or len(waiting) >= under_way // 4):
            search.add(waiting)
            under_way, waiting = under_way + len(waiting), []
        done = search.step()
        under_way -= len(done)
        waiting, queue = waiting + queue[: len(done)], queue[len(done) :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    p.add_argument("--sentences", type=int, default=500)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--clients", type=int, nargs="+", default=[16, 32])
    args = p.parse_args()

    torch.set_num_threads(1)
    keep_freed_memory()
    model, tok, _ = load(args.run)
    translator = Translator(model, tok, beam=args.beam, workers=1)
    ids = translator.encode(read_lines(args.source, args.sentences))
    translator.translate_ids(ids[:64])  # warm up
    engines = {"mt translate (sorted batches of 64)": lambda: translator.translate_ids(ids)}
    for c in args.clients:
        engines[f"continuous, {c} in flight"] = lambda c=c: continuous(translator, ids, c)
    print("| engine | sentences/s | rows per sentence | rows per call | decoder µs per row | other ms per sentence |")
    print("|---|---|---|---|---|---|")
    for name, run in engines.items():
        model.decode = counted = CountedDecode(model)
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
        del model.decode  # the class's own again
        n = len(ids)
        print(f"| {name} | {n / wall:.1f} | {counted.rows / n:.1f} | {counted.rows / counted.calls:.1f} | "
              f"{1e6 * counted.seconds / counted.rows:.1f} | {1000 * (wall - counted.seconds) / n:.2f} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
