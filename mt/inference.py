"""The inference model of a run directory: save it, load it, translate with it.

A run directory holds ``model.safetensors`` (weights; loading never unpickles
code), ``model.json`` (the model config and the tokenizer's special ids) and
the sentencepiece model(s). ``translate``, ``evaluate`` and ``attention``
need nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import zip_longest
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_model, save_model

from mt.config import DECODING, ConfigError, ModelConfig
from mt.ensemble import Ensemble
from mt.errors import ModelDirError
from mt.fastpath import speed_up
from mt.model import Transformer
from mt.search import SearchSettings, beam_search, greedy_search
from mt.textio import publish
from mt.tokenizer import Tokenizer, pad_batch

WEIGHTS, MODEL_JSON = "model.safetensors", "model.json"
T, R = TypeVar("T"), TypeVar("R")


def export_model(model: Transformer, tokenizer_dir: Path, run_dir: Path, extra: dict | None = None) -> None:
    """Write the inference model into ``run_dir`` (each file via a temporary name)."""
    run_dir = Path(run_dir)
    tmp = run_dir / (WEIGHTS + ".tmp")
    save_model(model, str(tmp))  # safetensors creates it 0o600
    publish(tmp, run_dir / WEIGHTS)
    for f in Tokenizer.files(tokenizer_dir):
        if f.parent.resolve() != run_dir.resolve():
            shutil.copyfile(f, run_dir / f.name)
    meta = {"model": dataclasses.asdict(model.cfg), **(extra or {})}
    tmp = run_dir / (MODEL_JSON + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    publish(tmp, run_dir / MODEL_JSON)


def load(
    run_dir: str | Path, device: str | torch.device = "cpu", fast: bool = True
) -> tuple[Transformer, Tokenizer, dict]:
    """(model in eval mode, tokenizer, metadata) from a run directory, checked for
    consistency. The model is on decoding's fast path unless ``fast=False``
    (the textbook modules, as training ran them)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ModelDirError(f"{run_dir}: model directory does not exist")
    if (run_dir / "mt_export.json").exists():
        raise ModelDirError(f"{run_dir}: a CTranslate2 export (mt export); this needs the mt run it was exported from")
    for name in (MODEL_JSON, WEIGHTS):
        if not (run_dir / name).exists():
            raise ModelDirError(f"{run_dir}: incomplete model directory, {name} missing (has training finished?)")
    try:
        meta = json.loads((run_dir / MODEL_JSON).read_text())
        cfg = ModelConfig(**meta["model"])
    except (json.JSONDecodeError, KeyError, TypeError, ConfigError) as e:
        raise ModelDirError(f"{run_dir / MODEL_JSON}: unreadable model config ({e})") from None
    tok = Tokenizer.load(run_dir)
    if (len(tok.src), len(tok.tgt)) != (cfg.src_vocab_size, cfg.tgt_vocab_size) or tok.pad_id != cfg.pad_id:
        raise ModelDirError(
            f"{run_dir}: tokenizer does not match the model (vocab {len(tok.src)}/{len(tok.tgt)}, pad {tok.pad_id}; "
            f"model expects {cfg.src_vocab_size}/{cfg.tgt_vocab_size}, pad {cfg.pad_id})"
        )
    model = Transformer(cfg)
    try:
        load_model(model, str(run_dir / WEIGHTS), device="cpu")
    except Exception as e:  # safetensors raises several types for truncated or mismatched files
        raise ModelDirError(f"{run_dir / WEIGHTS}: cannot load weights ({e})") from None
    if fast:
        speed_up(model)
    return model.to(device).eval(), tok, meta


def _tokenizer_bytes(run_dir: Path) -> list[bytes] | None:
    """The contents of a run directory's tokenizer files; None if one is missing."""
    files = Tokenizer.files(run_dir)
    return [f.read_bytes() for f in files] if all(f.is_file() for f in files) else None


def load_ensemble(run_dirs: list[str | Path], device: str | torch.device = "cpu") -> tuple[Ensemble, Tokenizer, dict]:
    """(ensemble in eval mode, tokenizer, the first run's metadata) from run
    directories whose tokenizers are the same files, byte for byte. Each
    member's tokenizer is compared before its weights are read."""
    first = Path(run_dirs[0])
    loaded = [load(first, device)]
    want = _tokenizer_bytes(first)
    for d in run_dirs[1:]:
        got = _tokenizer_bytes(Path(d))
        if got is not None and got != want:  # missing files: load() names them
            raise ModelDirError(f"{d}: its tokenizer differs from {first}'s; ensemble members must share one")
        loaded.append(load(d, device))
    return Ensemble([m for m, _, _ in loaded]).eval(), loaded[0][1], loaded[0][2]


def decoding_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype to decode in: ``float32``, ``bfloat16`` or ``auto`` =
    bfloat16 on CUDA GPUs that support it, float32 elsewhere (on CPUs with
    native bfloat16, ``bfloat16`` pays for wide models only: docs/performance.md).
    Search scores stay float32 either way."""
    if name == "int8":  # the weights stay float32; mt.int8 makes int8 copies of those it uses
        return torch.float32
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


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


class Translator:
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
    ):
        self.model, self.tok = model, tok
        self.beam, self.alpha, self.batch_size = beam, alpha, batch_size
        self.settings = SearchSettings(tok.bos_id, tok.eos_id, tok.pad_id, max_len_a, max_len_b)
        self.device = next(model.parameters()).device
        self.warn = warn or (lambda msg: None)
        self.workers = decoding_workers(workers, self.device)
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")

    @property
    def dtype_name(self) -> str:
        """The type decoding computes in, for reports: float32, bfloat16, int8 (``mt.int8``)."""
        if getattr(self.model, "int8", False):
            return "int8"
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def encode(self, lines: list[str], first_line: int = 1) -> list[list[int]]:
        ids = self.tok.encode_src(lines)
        limit = self.model.cfg.max_positions
        for n, x in enumerate(ids):
            if len(x) > limit:
                self.warn(f"line {first_line + n}: {len(x) - 1} subword tokens, truncated to {limit - 1}")
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
        self, lines: list[str], first_line: int = 1, n_best: int = 1, prefixes: list[str] | None = None
    ) -> list[list[tuple[str, float]]]:
        """Per line its n-best (translation, score); a translation with a prefix starts with it as given."""
        fixed = self.encode_prefixes(prefixes, first_line) if prefixes else None
        hyps = self.translate_ids(self.encode(lines, first_line), n_best, fixed)
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

    def stream(
        self, lines: Iterable[str], chunk: int = 1000, n_best: int = 1, prefixes: Iterable[str] | None = None
    ) -> Iterator[list[tuple[str, float]]]:
        """Per input line, in order, its n-best (translation, score); reads
        ``chunk`` lines at a time so memory stays flat on any input size.
        ``prefixes``: one per line ('' for none), the start of its translation."""
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
                yield from self._run(buffer, first, n_best)
                first += len(buffer)
                buffer = []
        if buffer:
            yield from self._run(buffer, first, n_best)

    def _run(self, pairs: list[tuple[str, str]], first: int, n_best: int) -> list[list[tuple[str, float]]]:
        lines, prefixes = zip(*pairs)
        return self.translate_nbest(list(lines), first, n_best, list(prefixes) if any(prefixes) else None)


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
