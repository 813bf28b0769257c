"""``Translator``: lines of text in, their translations out, in batches, in order.

Used by ``mt translate`` and ``mt evaluate`` (through ``open_translator`` in
``mt.decode.inference``), by training's validation and by the service's
decoding processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import zip_longest
from typing import TypeVar

import torch

from mt.config import DECODING
from mt.data.tokenizer import Tokenizer, pad_batch
from mt.decode.ensemble import Ensemble
from mt.decode.search import SearchSettings, beam_search, greedy_search
from mt.decode.sentences import SplitLine, cut_long, per_line, split_lines
from mt.model.transformer import Transformer

T, R = TypeVar("T"), TypeVar("R")


def decoding_workers(workers: int | None, device: torch.device) -> int:
    """How many batches to decode at once: ``workers``, or when None, 2 on
    a CPU with two or more threads and 1 elsewhere. On a CPU one batch's
    Python and small operations then run while the other's matrix products
    do, where a 64-row product gains little from a second thread
    (docs/performance.md); on a GPU the batches would only queue on one stream."""
    if workers is not None:
        return workers
    return 2 if device.type == "cpu" and torch.get_num_threads() >= 2 else 1


def map_in_threads(fn: Callable[[T], R], items: list[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]``, up to ``workers`` at a time, each worker
    thread with an equal share of PyTorch's intra-op threads. The count is
    process-wide while it runs (one caller at a time) and restored after."""
    workers = min(workers, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    threads = torch.get_num_threads()
    # each worker sets its own count: a thread's OpenMP setting is its own
    pool = ThreadPoolExecutor(workers, thread_name_prefix="mt-decode", initializer=torch.set_num_threads,
                              initargs=(max(1, threads // workers),))  # fmt: skip
    try:
        return list(pool.map(fn, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # an error or Ctrl-C: no new item starts
        torch.set_num_threads(threads)


class LineTranslator:
    """What every translator offers on top of its ``translate_nbest``: a stream of
    lines of any length translated in chunks, in order."""

    def translate_nbest(
        self, lines: list[str], first_line: int = 1, n_best: int = 1, prefixes: list[str] | None = None,
        labels: list[str] | None = None,
    ) -> list[list[tuple[str, float]]]:  # fmt: skip
        """Per line its n-best (translation, score). Warnings name line ``first_line + i``,
        or ``labels[i]`` where given (a sentence of a split line: "line 3, sentence 2")."""
        raise NotImplementedError

    def stream(
        self, lines: Iterable[str], chunk: int = 1000, n_best: int = 1, prefixes: Iterable[str] | None = None,
        split_lang: str | None = None,
    ) -> Iterator[list[tuple[str, float]]]:  # fmt: skip
        """Per input line, in order, its n-best (translation, score); reads
        ``chunk`` lines at a time so memory stays flat on any input size.
        ``prefixes``: one per line ('' for none), the start of its translation.
        ``split_lang``: cut each line into sentences by that language's rules
        (``mt.decode.sentences``), translate them, and join them back with the
        line's own spacing. With one translation per line and no prefixes, a line
        (or sentence) longer than the model's positions is translated in parts,
        with a warning; a line's score is then the sum of its parts'. With
        ``n_best`` or prefixes it is truncated, with a warning."""
        if split_lang is not None and (n_best > 1 or prefixes is not None):
            raise ValueError("sentence splitting gives one translation per line, without prefixes")
        pairs = zip_longest(lines, prefixes, fillvalue=None) if prefixes is not None else ((x, "") for x in lines)
        buffer: list[tuple[str, str]] = []
        first = 1
        for n, pair in enumerate(pairs, 1):
            if pair[0] is None:
                raise ValueError(f"more prefixes than input lines ({n - 1})")
            if pair[1] is None:
                raise ValueError(f"fewer prefixes than input lines: none for line {n}")
            buffer.append(pair)
            if len(buffer) == chunk:
                yield from self._run(buffer, first, n_best, split_lang)
                first += len(buffer)
                buffer = []
        if buffer:
            yield from self._run(buffer, first, n_best, split_lang)

    def _run(
        self, pairs: list[tuple[str, str]], first: int, n_best: int, split_lang: str | None = None
    ) -> list[list[tuple[str, float]]]:
        """One chunk of ``stream``: each line (or each of its sentences, with ``split_lang``)
        translated whole, or in parts where it is longer than the model's positions."""
        lines, prefixes = zip(*pairs)
        if n_best > 1 or any(prefixes):  # several translations, or a fixed start: the line as one input
            return self.translate_nbest(list(lines), first, n_best, list(prefixes) if any(prefixes) else None)
        splits, labels = self.cut_long(split_lines(list(lines), split_lang), first, split_lang is not None)
        units = [s for split in splits for s in split.sentences]
        best = [nbest[0] for nbest in self.translate_nbest(units, first, 1, None, labels)]
        return [[(split.join([text for text, _ in line]), sum(score for _, score in line))]
                for split, line in zip(splits, per_line(best, splits))]  # fmt: skip

    def cut_long(self, splits: list[SplitLine], first: int, split: bool) -> tuple[list[SplitLine], list[str]]:
        """Every sentence longer than the model's positions cut into parts that fit
        (``mt.decode.sentences.cut_long``), with a warning naming line ``first + i`` (and
        its sentence, if ``split``); and each unit's label for warnings."""
        most = self.max_source_pieces
        sentences = [s for sp in splits for s in sp.sentences]
        counts = iter([len(ids) - 1 for ids in self.tok.encode_src(sentences)])

        def pieces(text: str) -> int:
            return len(self.tok.encode_src([text])[0]) - 1

        cut, labels = [], []
        for n, sp in enumerate(splits):
            units, gaps = [], []
            for k, (sentence, gap) in enumerate(zip(sp.sentences, sp.gaps), 1):
                where = f"line {first + n}" + (f", sentence {k}" if split else "")
                count = next(counts)
                if count <= most:
                    units.append(sentence)
                    gaps.append(gap)
                    labels.append(where)
                    continue
                parts, part_gaps, how = cut_long(sentence, pieces, most)
                self.warn(f"{where}: {count} subword pieces, more than the model's {most}: translated in "
                          f"{len(parts)} parts, cut at {how}")  # fmt: skip
                units += parts
                gaps += [*part_gaps[:-1], gap]
                labels += [f"{where}, part {j}" for j in range(1, len(parts) + 1)]
            cut.append(SplitLine(sp.lead, units, gaps))
        return cut, labels


class Translator(LineTranslator):
    """Translates lines in batches, keeping their order. Long inputs are
    truncated to the model's maximum positions, with a warning. ``workers``
    batches are decoded at once (``decoding_workers``; None = auto; see
    ``map_in_threads``). Not for use from several threads at once: it sets
    the intra-op thread count (process-wide) while it decodes."""

    def __init__(
        self,
        model: Transformer | Ensemble,
        tok: Tokenizer,
        beam: int = DECODING.beam,
        alpha: float = DECODING.alpha,
        batch_size: int = DECODING.batch_size,
        max_len_a: float = DECODING.max_len_a,
        max_len_b: int = DECODING.max_len_b,
        warn=None,
        workers: int | None = None,
        loop_margin: int | None = DECODING.loop_margin,
    ):
        self.model, self.tok = model, tok
        self.beam, self.alpha, self.batch_size = beam, alpha, batch_size
        self.settings = SearchSettings(
            tok.bos_id, tok.eos_id, tok.pad_id, max_len_a, max_len_b, loop_margin=loop_margin
        )
        self.device = next(model.parameters()).device
        self.warn = warn or (lambda msg: None)
        self.workers = decoding_workers(workers, self.device)
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")

    @property
    def max_source_pieces(self) -> int:
        """The most source pieces the model reads (its positions, less the EOS)."""
        return self.model.cfg.max_positions - 1

    @property
    def dtype_name(self) -> str:
        """The type decoding computes in, for reports: float32, bfloat16, int8 (``mt.decode.int8``)."""
        if getattr(self.model, "int8", False):
            return "int8"
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def encode(self, lines: list[str], first_line: int = 1, labels: list[str] | None = None) -> list[list[int]]:
        ids = self.tok.encode_src(lines)
        limit = self.model.cfg.max_positions
        for n, x in enumerate(ids):
            if len(x) > limit:
                where = labels[n] if labels else f"line {first_line + n}"
                self.warn(f"{where}: {len(x) - 1} subword tokens, truncated to {limit - 1}")
                ids[n] = x[: limit - 1] + [self.tok.eos_id]
        return ids

    def translate_ids(
        self, ids: list[list[int]], n_best: int = 1, prefixes: list[list[int]] | None = None
    ) -> list[list[tuple[list[int], float]]]:
        """Token ids in, per input its n-best (ids, score) out, in input order.
        ``prefixes[i]``: target ids that input i's translations start with (see ``encode_prefixes``)."""
        results: list = [[([], 0.0)] * n_best if not x else None for x in ids]
        order = sorted((i for i, x in enumerate(ids) if x), key=lambda i: len(ids[i]))  # empty lines: empty output
        batches = [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]

        def decode(batch: list[int]) -> list[list[tuple[list[int], float]]]:
            src = pad_batch([ids[i] for i in batch], self.tok.pad_id).to(self.device)
            fixed = [prefixes[i] for i in batch] if prefixes else None
            if self.beam == 1 and n_best == 1:
                hyps = greedy_search(self.model, src, self.settings, self.alpha, fixed)
                return [[(h.tokens, h.score)] for h in hyps]
            hyps = beam_search(self.model, src, self.settings, self.beam, self.alpha, n_best, fixed)
            return [[(h.tokens, h.score) for h in nbest] for nbest in hyps]

        for batch, out in zip(batches, map_in_threads(decode, batches, self.workers)):
            for i, nbest in zip(batch, out):
                results[i] = nbest
        return results

    def encode_prefixes(self, prefixes: list[str], first_line: int = 1) -> list[list[int]]:
        """Target-side prefixes (the start of each translation, '' for none) as ids.
        A prefix is whole pieces: one that ends inside a word continues from
        that word's pieces as the tokenizer cuts the prefix alone."""
        ids = self.tok.encode_tgt(prefixes)
        room = self.model.cfg.max_positions - 2  # bos, and one token after the prefix
        for n, x in enumerate(ids):
            if len(x) > room:
                raise ValueError(f"prefix {first_line + n}: {len(x)} subword tokens, more than the model's {room}")
        return ids

    def translate(self, lines: list[str], first_line: int = 1, prefixes: list[str] | None = None) -> list[str]:
        return [nbest[0][0] for nbest in self.translate_nbest(lines, first_line, 1, prefixes)]

    def translate_nbest(
        self, lines: list[str], first_line: int = 1, n_best: int = 1, prefixes: list[str] | None = None,
        labels: list[str] | None = None,
    ) -> list[list[tuple[str, float]]]:  # fmt: skip
        """Per line its n-best (translation, score); a translation with a prefix starts with it as given."""
        fixed = self.encode_prefixes(prefixes, first_line) if prefixes else None
        hyps = self.translate_ids(self.encode(lines, first_line, labels), n_best, fixed)
        texts = iter(self.tok.decode_tgt([ids for nbest in hyps for ids, _ in nbest]))
        out = [[(next(texts), score) for _, score in nbest] for nbest in hyps]
        if prefixes:
            for n, given in enumerate(prefixes):
                if fixed[n]:
                    out[n] = self.texts(hyps[n], given, fixed[n])
        return out

    def texts(
        self, nbest: list[tuple[list[int], float]], prefix: str = "", prefix_ids: list[int] | None = None
    ) -> list[tuple[str, float]]:
        """One input's n-best (ids, score) as (text, score); with a prefix, each text starts with it as given."""
        if prefix_ids:
            return [(keep_prefix(prefix, ids, prefix_ids, self.tok), score) for ids, score in nbest]
        return list(zip(self.tok.decode_tgt([ids for ids, _ in nbest]), (score for _, score in nbest)))


def keep_prefix(given: str, ids: list[int], prefix_ids: list[int], tok: Tokenizer) -> str:
    """The translation ``ids`` (which start with ``prefix_ids``) as text that starts with
    the prefix as the person typed it, trailing spaces aside: the tokenizer's round trip
    of the prefix (its normalisation; lowercasing for paper-style text) gives way to it."""
    given = given.rstrip()
    text, decoded = tok.decode_tgt([ids, prefix_ids])
    if text.startswith(decoded):
        return given + text[len(decoded) :]
    # the detokenizer joined across the prefix's end: put the continuation after it by its pieces
    rest = ids[len(prefix_ids) :]
    if not rest:
        return given
    space = " " if tok.tgt_pieces(rest[:1])[0].startswith("▁") else ""
    return given + space + tok.decode_tgt([rest])[0]
