"""``mt prepare``: from raw parallel text to tokenized splits on disk.

It streams: memory stays flat in the corpus size. Each split is read a batch
of lines at a time (its defects found on the way, named by file and line)
and copied into Arrow chunk files of ``CHUNK`` pairs; sentencepiece trains on
a bounded random sample of the training split; ``datasets.map`` encodes one
chunk at a time (in several processes for large splits); the filter and the
summary are computed as the encoded chunks are read back, batch by batch,
into the split's file. Large files are read as streams here, never mapped
into memory whole. It writes::

    <data.prepared_dir>/
        spm.model | spm.src.model + spm.tgt.model   the tokenizer
        <split>/pairs.arrow                         src_text, tgt_text, src_ids, tgt_ids (Arrow IPC stream)
        prepare.json                                fingerprint of inputs and config, and the summary

Training reads a split's rows from that file as it needs them
(``mt.data.batches.Split``). A second run with the same inputs and config reuses what
is there.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import random
import shutil
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from mt.config import DataConfig
from mt.data.batches import PAIRS_FILE, TokenBatchSampler, padding_waste, split_lengths
from mt.data.corpus import SplitSource, load_corpus
from mt.data.tokenizer import JOINT, SRC, TGT, TextNormalizer, Tokenizer, train_sentencepiece, write_text_config
from mt.errors import DataError
from mt.textio import abandon_directory, begin_directory, finish_directory

PREPARE_FORMAT = 4  # 2: source ids end with EOS; 3: the summary reports padding; 4: streamed, pairs.arrow
FINGERPRINT_FIELDS = (
    "src_lang", "tgt_lang", "train_split", "text", "vocab_size", "joint_vocab", "spm_model_type", "spm_sample",
    "max_len", "max_ratio",
)  # fmt: skip
READ_BATCH = 10_000  # lines read, and written to Arrow, at a time
CHUNK = 500_000  # pairs per Arrow chunk: what one datasets.map call encodes
WRITE_BYTES = 16 << 20  # size of a record batch of a prepared split: few batches, so opening it touches few pages
ENCODE_BATCH = 1_000  # lines per call of the encoder
PARALLEL_FROM = 100_000  # pairs in a split from which encoding runs in one process per CPU
SAMPLE_SEED = 1  # the draw of sentencepiece's training lines
DROP_REASONS = ("empty", "too long", "length ratio")  # the "drop" column: 0 = kept, k = DROP_REASONS[k - 1]


def _fingerprint(cfg: DataConfig, corpus_fp: str) -> str:
    fields = {name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}
    blob = json.dumps({"format": PREPARE_FORMAT, "corpus": corpus_fp, "config": fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _read_stream(path: Path) -> Iterator:
    """The record batches of an Arrow IPC stream file, read (not memory-mapped):
    the pages pass through the page cache without staying in this process."""
    import pyarrow as pa

    with pa.OSFile(str(path)) as f, pa.ipc.open_stream(f) as reader:
        yield from reader


def _write_text(source: SplitSource, work: Path) -> tuple[list[Path], int]:
    """Copy a split into Arrow chunk files (src_text, tgt_text) of ``CHUNK``
    pairs, a batch at a time; returns their paths (at least one) and the
    number of pairs."""
    import pyarrow as pa

    schema = pa.schema([("src_text", pa.string()), ("tgt_text", pa.string())])
    paths: list[Path] = []
    sink = writer = None
    rows = total = 0
    try:
        for src, tgt in source.batches(READ_BATCH):
            if writer is None or rows >= CHUNK:
                if writer is not None:
                    writer.close()
                    sink.close()
                paths.append(work / f"{source.name}.text-{len(paths):05d}.arrow")
                sink = pa.OSFile(str(paths[-1]), "wb")
                writer, rows = pa.ipc.new_stream(sink, schema), 0
            writer.write_batch(pa.record_batch([pa.array(src, pa.string()), pa.array(tgt, pa.string())], schema))
            rows += len(src)
            total += len(src)
        if writer is None:  # an empty split: one file with no rows
            paths.append(work / f"{source.name}.text-00000.arrow")
            sink = pa.OSFile(str(paths[-1]), "wb")
            writer = pa.ipc.new_stream(sink, schema)
    finally:
        if writer is not None:
            writer.close()
            sink.close()
    return paths, total


def _text_lines(paths: list[Path], column: str) -> Iterator[str]:
    """The non-blank lines of a text column, a batch at a time."""
    for path in paths:
        for batch in _read_stream(path):
            yield from (line for line in batch.column(column).to_pylist() if line.strip())


def sample_lines(lines: Iterable[str], k: int, seed: int = SAMPLE_SEED) -> list[str]:
    """A uniform random sample of at most ``k`` of ``lines``, read once
    (reservoir sampling, Algorithm R), the same for the same lines and seed;
    all of them, in their order, when there are no more than ``k``."""
    rng = random.Random(seed)
    sample: list[str] = []
    for n, line in enumerate(lines):
        if n < k:
            sample.append(line)
        elif (j := rng.randrange(n + 1)) < k:
            sample[j] = line
    return sample


def _any_text(paths: list[Path], column: str) -> bool:
    import pyarrow.compute as pc

    for path in paths:
        for batch in _read_stream(path):
            if pc.any(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(batch.column(column))), 0)).as_py():
                return True
    return False


def _train_tokenizer(cfg: DataConfig, text: list[Path], out: Path) -> Tokenizer:
    """sentencepiece on at most ``cfg.spm_sample`` lines of the training split
    (``text``: its Arrow chunks), drawn at random. It trains in a child
    process, which hands its memory back to the system when it ends: the
    encoding processes, forked later, start small."""
    for side, lang in (("src", cfg.src_lang), ("tgt", cfg.tgt_lang)):
        if not _any_text(text, f"{side}_text"):
            raise DataError(
                f"training split {cfg.train_split!r}: every {lang} line is empty ({cfg.train_split}.{lang}); "
                "no usable training pair is left"
            )
    _in_child(_train_spm, cfg, text, out)
    write_text_config(out, cfg.text, cfg.src_lang, cfg.tgt_lang)
    return Tokenizer.load(out)


def _tagged(tag: int, lines: Iterator[str]) -> Iterator[tuple[int, str]]:
    for line in lines:
        yield tag, line


def _train_spm(cfg: DataConfig, text: list[Path], out: Path) -> None:
    # The sample is drawn here, not by sentencepiece (its input_sentence_size):
    # its reservoir is not the same from one process to the next, whatever
    # its seed, and the same corpus must give the same tokenizer.
    def sample(*sides: tuple[str, str]) -> list[str]:
        """A sample of the lines of the (column, language) sides, normalised
        (Moses, for paper text) after sampling: only the sample is."""
        lines = itertools.chain(*(_tagged(k, _text_lines(text, column)) for k, (column, _) in enumerate(sides)))
        picked = sample_lines(lines, cfg.spm_sample)
        normalized = [""] * len(picked)
        for k, (_, lang) in enumerate(sides):
            where = [i for i, (side, _) in enumerate(picked) if side == k]
            for i, line in zip(where, TextNormalizer(cfg.text, lang).normalize([picked[i][1] for i in where])):
                normalized[i] = line
        return [line for line in normalized if line.strip()]

    src, tgt = ("src_text", cfg.src_lang), ("tgt_text", cfg.tgt_lang)
    spm_args = cfg.vocab_size, cfg.spm_model_type
    try:
        if cfg.joint_vocab:
            train_sentencepiece(sample(src, tgt), out / JOINT.removesuffix(".model"), *spm_args)
        else:
            train_sentencepiece(sample(src), out / SRC.removesuffix(".model"), *spm_args)
            train_sentencepiece(sample(tgt), out / TGT.removesuffix(".model"), *spm_args)
    except RuntimeError as e:  # sentencepiece's own checks, e.g. a vocabulary it cannot reach
        raise DataError(f"sentencepiece on training split {cfg.train_split!r}: {e}") from None


def _child_main(conn, fn: Callable, args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops this process
    try:
        fn(*args)
        conn.send(None)
    except BaseException as e:  # handed to the parent, which raises it
        conn.send(e)


def _in_child(fn: Callable, *args) -> None:
    """Run ``fn(*args)`` in a forked process; its exception is raised here."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(send, fn, args), daemon=True)
    child.start()
    send.close()
    try:
        try:
            error = receive.recv()
        except EOFError:  # it died without a word (killed, out of memory)
            error = RuntimeError(f"{fn.__name__} stopped in its child process (exit status {child.exitcode})")
        if error is not None:
            raise error
    finally:
        if child.is_alive():
            child.terminate()
        child.join()


def _drop_reason(n_src: int, n_tgt: int, cfg: DataConfig) -> int:
    """0 = keep, else 1 + the index of the reason in DROP_REASONS.
    n_src, n_tgt: subword tokens, without the source's EOS."""
    if n_src == 0 or n_tgt == 0:
        return 1
    if max(n_src, n_tgt) > cfg.max_len:
        return 2
    if max(n_src, n_tgt) / min(n_src, n_tgt) > cfg.max_ratio:
        return 3
    return 0


class _Encoder:
    """The batched function ``datasets.map`` runs (in worker processes too,
    so it is a picklable object rather than a closure): token ids, and the
    per-row columns that the filter and the summary are computed from."""

    def __init__(self, tok: Tokenizer, cfg: DataConfig):
        self.tok, self.cfg = tok, cfg

    def __call__(self, batch: dict) -> dict:
        src, tgt = self.tok.encode_src(batch["src_text"]), self.tok.encode_tgt(batch["tgt_text"])
        unk = self.tok.unk_id
        return {
            "src_ids": src,
            "tgt_ids": tgt,
            "drop": [_drop_reason(max(len(s) - 1, 0), len(t), self.cfg) for s, t in zip(src, tgt)],
            "src_unk": [s.count(unk) for s in src],
            "tgt_unk": [t.count(unk) for t in tgt],
        }


def _features():
    import datasets

    ids = datasets.Sequence(datasets.Value("int32"))
    return datasets.Features(
        {
            "src_text": datasets.Value("string"),
            "tgt_text": datasets.Value("string"),
            "src_ids": ids,
            "tgt_ids": ids,
            "drop": datasets.Value("uint8"),
            "src_unk": datasets.Value("int32"),
            "tgt_unk": datasets.Value("int32"),
        }
    )


def _num_proc(cfg: DataConfig, rows: int) -> int:
    if cfg.num_proc is not None:
        return cfg.num_proc
    return len(os.sched_getaffinity(0)) if rows >= PARALLEL_FROM else 1


def prepare(cfg: DataConfig, verbose: bool = True) -> dict:
    """Tokenize the corpus into ``cfg.prepared_path()``; reuse it when nothing changed.

    Returns the summary (also stored in prepare.json). Writes into a
    ``.partial`` directory and swaps it in at the end, so an interrupted run
    never leaves a prepared directory that looks complete.
    """
    import datasets

    datasets.disable_progress_bars()
    out = cfg.prepared_path()
    splits, corpus_fp = load_corpus(cfg, Path("data/raw") / cfg.corpus)
    fingerprint = _fingerprint(cfg, corpus_fp)
    meta_path = out / "prepare.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fingerprint and all((out / s).is_dir() for s in meta["summary"]["splits"]):
            summary = meta["summary"]
            if summary.get("train_batches", {}).get("max_tokens") != cfg.max_tokens:
                # batching is not part of the fingerprint: the stored figures may be for another max_tokens
                summary = {**summary, "train_batches": _train_batches(out / cfg.train_split, cfg.max_tokens)}
            if verbose:
                print(f"{out}: up to date (same inputs and config, fingerprint {fingerprint[:12]}); reusing it")
                print(format_summary(summary))
            return summary

    tmp = begin_directory(out, "prepare.json", "choose another data.prepared_dir")
    try:
        summary = _prepare_into(tmp, cfg, splits, fingerprint)
    except BaseException:  # an error or Ctrl-C: nothing half-made is left behind
        abandon_directory(tmp)
        raise
    finish_directory(tmp, out)
    if verbose:
        print(f"prepared {cfg.pair} into {out}")
        print(format_summary(summary))
    return summary


def _prepare_into(tmp: Path, cfg: DataConfig, splits: dict[str, SplitSource], fingerprint: str) -> dict:
    """Tokenizer, encoded splits and prepare.json into ``tmp``; returns the summary."""
    work = tmp / "work"  # the Arrow files in between, removed as they are used
    work.mkdir()
    # Every split is read (and checked) before the tokenizer trains: a defect
    # in a test file is reported before minutes of work, not after.
    text = {name: _write_text(source, work) for name, source in splits.items()}
    tok = _train_tokenizer(cfg, text[cfg.train_split][0], tmp)
    summary = {"pair": cfg.pair, "vocab": {"src": len(tok.src), "tgt": len(tok.tgt), "joint": tok.joint}, "splits": {}}
    for name, (chunks, rows) in text.items():
        train = name == cfg.train_split  # validation and test keep every line, aligned with references
        encoded = _encode(chunks, _Encoder(tok, cfg), _num_proc(cfg, rows), fingerprint)
        (tmp / name).mkdir()
        stats, dropped = _write_split(encoded, tmp / name / PAIRS_FILE, train)
        if train and stats["kept"] == 0:
            reasons = ", ".join(f"{k}: {v}" for k, v in dropped.items())
            raise DataError(f"training split {name!r}: no usable training pair is left ({reasons})")
        summary["splits"][name] = stats
    shutil.rmtree(work)

    summary["train_batches"] = _train_batches(tmp / cfg.train_split, cfg.max_tokens)
    (tmp / "prepare.json").write_text(json.dumps({"fingerprint": fingerprint, "summary": summary}, indent=2))
    return summary


def _encode(chunks: list[Path], encoder: _Encoder, num_proc: int, fingerprint: str) -> Iterator[Path]:
    """Encode each text chunk with ``datasets.map`` (memory-mapped, in
    ``num_proc`` processes); yields the Arrow files it writes, chunk by
    chunk. A chunk's files are unmapped (and its text removed) before the
    next chunk starts, so no process holds more than a chunk."""
    import datasets

    for path in chunks:
        chunk = datasets.Dataset.from_file(str(path))
        if len(chunk) == 0:
            continue
        encoded = chunk.map(
            encoder,
            batched=True,
            batch_size=ENCODE_BATCH,
            num_proc=num_proc if len(chunk) >= 2 * num_proc else None,
            features=_features(),
            cache_file_name=str(path.with_name(path.name.replace(".text-", ".ids-"))),
            new_fingerprint=hashlib.sha256(f"{fingerprint}/{path.name}".encode()).hexdigest()[:16],
        )
        files = [Path(f["filename"]) for f in encoded.cache_files]
        del chunk, encoded
        path.unlink()
        yield from files


def _write_split(encoded: Iterator[Path], out: Path, train: bool) -> tuple[dict, dict[str, int]]:
    """Read the encoded files back as streams into the split's file: the
    training split without its dropped pairs, every split without the
    per-row columns. Returns the summary of what is kept, and the drop counts."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = {"kept": 0, "src": 0, "tgt": 0, "src_unk": 0, "tgt_unk": 0}
    reasons = np.zeros(len(DROP_REASONS) + 1, dtype=np.int64)
    kept_columns = ["src_text", "tgt_text", "src_ids", "tgt_ids"]
    writer = None
    pending: list = []  # written WRITE_BYTES at a time: few record batches, each column's buffers contiguous

    def flush() -> None:
        if pending:
            writer.write_batch(pa.Table.from_batches(pending).combine_chunks().to_batches()[0])
            pending.clear()

    with pa.OSFile(str(out), "wb") as sink:
        for path in encoded:
            for batch in _read_stream(path):
                if writer is None:
                    writer = pa.ipc.new_stream(sink, batch.select(kept_columns).schema)
                drop = batch.column("drop").to_numpy()
                keep = drop == 0 if train else np.ones(len(batch), dtype=bool)
                reasons += np.bincount(drop[~keep], minlength=len(reasons))
                batch = batch.filter(pa.array(keep)) if not keep.all() else batch
                src_len = pc.list_value_length(batch.column("src_ids")).to_numpy()
                n["kept"] += len(batch)
                n["src"] += int(src_len.sum() - (src_len > 0).sum())  # without the source EOS
                n["tgt"] += int(pc.list_value_length(batch.column("tgt_ids")).to_numpy().sum())
                n["src_unk"] += int(pc.sum(batch.column("src_unk")).as_py() or 0)
                n["tgt_unk"] += int(pc.sum(batch.column("tgt_unk")).as_py() or 0)
                pending.append(batch.select(kept_columns))
                if sum(b.nbytes for b in pending) >= WRITE_BYTES:
                    flush()
            path.unlink()
        flush()
        if writer is None:  # an empty split
            from datasets.features import Features

            writer = pa.ipc.new_stream(sink, Features({k: _features()[k] for k in kept_columns}).arrow_schema)
        writer.close()
    dropped = {reason: int(reasons[k + 1]) for k, reason in enumerate(DROP_REASONS) if reasons[k + 1]}
    stats = {"kept": n["kept"], "dropped": sum(dropped.values()), "dropped_by_reason": dropped}
    for side in ("src", "tgt"):
        stats[f"{side}_tokens_per_sentence"] = round(n[side] / max(n["kept"], 1), 2)
        stats[f"{side}_unk_share"] = n[f"{side}_unk"] / max(n[side], 1)
    return stats, dropped


def _train_batches(split_dir: Path, max_tokens: int) -> dict:
    """How many training batches ``max_tokens`` makes of a prepared split, and their padding."""
    src_lens, tgt_lens = split_lengths(split_dir)
    batches = TokenBatchSampler(src_lens, tgt_lens, max_tokens).all_batches()
    return {
        "max_tokens": max_tokens,
        "batches": len(batches),
        "padding_waste": round(padding_waste(batches, src_lens, tgt_lens), 4),
    }


def format_summary(summary: dict) -> str:
    src, tgt = summary["pair"].split("-")
    vocab = summary["vocab"]
    lines = [
        f"vocabulary: {vocab['src']} (joint)" if vocab["joint"] else f"vocabulary: {vocab['src']} / {vocab['tgt']}",
        f"{'split':<20}{'kept':>8}{'dropped':>9}{'tok/sent ' + src:>14}{'tok/sent ' + tgt:>14}"
        f"{'unk ' + src:>10}{'unk ' + tgt:>10}",
    ]
    for name, s in summary["splits"].items():
        reasons = ", ".join(f"{k}: {v}" for k, v in s["dropped_by_reason"].items())
        lines.append(
            f"{name:<20}{s['kept']:>8}{s['dropped']:>9}{s['src_tokens_per_sentence']:>14}"
            f"{s['tgt_tokens_per_sentence']:>14}{s['src_unk_share']:>10.2%}{s['tgt_unk_share']:>10.2%}"
            + (f"   ({reasons})" if reasons else "")
        )
    if "train_batches" in summary:
        b = summary["train_batches"]
        lines.append(
            f"training batches at max_tokens={b['max_tokens']}: {b['batches']} per epoch, "
            f"{b['padding_waste']:.1%} of their tokens are padding"
        )
    return "\n".join(lines)
