"""From raw parallel text to batches: ``prepare`` (sentencepiece + encoding
with Hugging Face ``datasets``), a token-count batch sampler, and the
LightningDataModule that serves both to training.

Prepared layout (``data.prepared_dir``)::

    spm.model | spm.src.model + spm.tgt.model   the tokenizer
    <split>/                                    datasets.save_to_disk: src_ids, tgt_ids, src_text, tgt_text
    prepare.json                                fingerprint of inputs and config, and the summary
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Sampler

from mt.config import DataConfig
from mt.corpus import load_corpus
from mt.errors import DataError
from mt.tokenizer import (
    JOINT,
    SRC,
    TGT,
    MergeDropout,
    TextNormalizer,
    Tokenizer,
    pad_batch,
    train_sentencepiece,
    write_text_config,
)

PREPARE_FORMAT = 3  # 2: source ids end with EOS; 3: the summary reports padding
FINGERPRINT_FIELDS = (
    "src_lang", "tgt_lang", "train_split", "text", "vocab_size", "joint_vocab", "spm_model_type", "max_len",
    "max_ratio",
)  # fmt: skip


def _fingerprint(cfg: DataConfig, corpus_fp: str) -> str:
    fields = {name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}
    blob = json.dumps({"format": PREPARE_FORMAT, "corpus": corpus_fp, "config": fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _train_tokenizer(cfg: DataConfig, src: list[str], tgt: list[str], out: Path) -> Tokenizer:
    src = [s for s in TextNormalizer(cfg.text, cfg.src_lang).normalize(src) if s.strip()]
    tgt = [t for t in TextNormalizer(cfg.text, cfg.tgt_lang).normalize(tgt) if t.strip()]
    if cfg.joint_vocab:
        train_sentencepiece(src + tgt, out / JOINT.removesuffix(".model"), cfg.vocab_size, cfg.spm_model_type)
    else:
        train_sentencepiece(src, out / SRC.removesuffix(".model"), cfg.vocab_size, cfg.spm_model_type)
        train_sentencepiece(tgt, out / TGT.removesuffix(".model"), cfg.vocab_size, cfg.spm_model_type)
    write_text_config(out, cfg.text, cfg.src_lang, cfg.tgt_lang)
    return Tokenizer.load(out)


def _drop_reason(n_src: int, n_tgt: int, cfg: DataConfig) -> str | None:
    """n_src, n_tgt: subword tokens, without the source's EOS."""
    if n_src == 0 or n_tgt == 0:
        return "empty"
    if max(n_src, n_tgt) > cfg.max_len:
        return "too long"
    if max(n_src, n_tgt) / min(n_src, n_tgt) > cfg.max_ratio:
        return "length ratio"
    return None


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

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    train_src, train_tgt = splits[cfg.train_split]
    tok = _train_tokenizer(cfg, train_src, train_tgt, tmp)

    def encode(batch: dict) -> dict:
        return {"src_ids": tok.encode_src(batch["src_text"]), "tgt_ids": tok.encode_tgt(batch["tgt_text"])}

    summary = {"pair": cfg.pair, "vocab": {"src": len(tok.src), "tgt": len(tok.tgt), "joint": tok.joint}, "splits": {}}
    for name, (src, tgt) in splits.items():
        ds = datasets.Dataset.from_dict({"src_text": src, "tgt_text": tgt})
        ds = ds.map(encode, batched=True, batch_size=1000)
        dropped = {}
        if name == cfg.train_split:  # validation and test keep every line, aligned with references
            keep = []
            columns = ds.select_columns(["src_ids", "tgt_ids"]).to_dict()
            for i, (s, t) in enumerate(zip(columns["src_ids"], columns["tgt_ids"])):
                reason = _drop_reason(max(len(s) - 1, 0), len(t), cfg)
                if reason is None:
                    keep.append(i)
                else:
                    dropped[reason] = dropped.get(reason, 0) + 1
            if len(keep) < len(ds):
                ds = ds.select(keep)
        ds.save_to_disk(str(tmp / name))
        summary["splits"][name] = _split_stats(ds, tok.unk_id, dropped)

    summary["train_batches"] = _train_batches(tmp / cfg.train_split, cfg.max_tokens)
    meta_path = tmp / "prepare.json"
    meta_path.write_text(json.dumps({"fingerprint": fingerprint, "summary": summary}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    if verbose:
        print(f"prepared {cfg.pair} into {out}")
        print(format_summary(summary))
    return summary


def _train_batches(split_dir: Path, max_tokens: int) -> dict:
    """How many training batches ``max_tokens`` makes of a prepared split, and their padding."""
    import datasets

    train = datasets.load_from_disk(str(split_dir)).select_columns(["src_ids", "tgt_ids"]).to_dict()
    src_lens, tgt_lens = [len(x) for x in train["src_ids"]], [len(x) for x in train["tgt_ids"]]
    batches = TokenBatchSampler(src_lens, tgt_lens, max_tokens).all_batches()
    return {
        "max_tokens": max_tokens,
        "batches": len(batches),
        "padding_waste": round(padding_waste(batches, src_lens, tgt_lens), 4),
    }


def _split_stats(ds, unk_id: int, dropped: dict[str, int]) -> dict:
    stats = {"kept": len(ds), "dropped": sum(dropped.values()), "dropped_by_reason": dropped}
    for side in ("src", "tgt"):
        ids = ds.select_columns([f"{side}_ids"]).to_dict()[f"{side}_ids"]
        n_tokens = sum(len(x) for x in ids) - (len(ids) if side == "src" else 0)  # without the source EOS
        stats[f"{side}_tokens_per_sentence"] = round(n_tokens / max(len(ids), 1), 2)
        stats[f"{side}_unk_share"] = sum(x.count(unk_id) for x in ids) / max(n_tokens, 1)
    return stats


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


@dataclass
class Batch:
    """One training or evaluation batch. Padded with the tokenizer's pad id."""

    src: Tensor  # (B, T_s)
    tgt_in: Tensor  # (B, T_t): bos y_1 ... y_n
    tgt_out: Tensor  # (B, T_t): y_1 ... y_n eos
    index: Tensor  # (B,) row of each pair in its split
    pad_id: int

    @property
    def src_mask(self) -> Tensor:  # (B, T_s), True = real token
        return self.src != self.pad_id

    @property
    def tgt_mask(self) -> Tensor:  # (B, T_t), True = real token
        return self.tgt_out != self.pad_id


class BatchedPairs:
    """A split's pairs, read a batch at a time: ``pairs[indices]`` is the
    padded ``Batch`` of those rows. The loader's sampler yields the index
    lists (``TokenBatchSampler``) with automatic batching off. ``segment``,
    when given, supplies the rows' token ids in place of the stored ones
    (BPE-dropout)."""

    def __init__(
        self,
        src: list[list[int]],
        tgt: list[list[int]],
        tok: Tokenizer,
        segment: Callable[[list[int]], tuple[list[list[int]], list[list[int]]]] | None = None,
    ):
        self.src, self.tgt, self.tok, self.segment = src, tgt, tok, segment

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, indices: list[int]) -> Batch:
        t = self.tok
        if self.segment is None:
            src, tgt = [self.src[i] for i in indices], [self.tgt[i] for i in indices]
        else:
            src, tgt = self.segment(indices)
        return Batch(
            src=pad_batch(src, t.pad_id),
            tgt_in=pad_batch([[t.bos_id, *y] for y in tgt], t.pad_id),
            tgt_out=pad_batch([[*y, t.eos_id] for y in tgt], t.pad_id),
            index=torch.tensor(indices),
            pad_id=t.pad_id,
        )


class BPEDropout:
    """BPE-dropout on the training split: segmented anew for each epoch,
    every merge skipped with probability ``p`` (``MergeDropout``), so the
    model sees many segmentations of each word; validation, test and
    translation keep the deterministic one.

    An epoch's segmentation depends only on ``seed`` and the epoch, so a run
    is reproducible and a resumed run draws what the uninterrupted one drew.
    A sentence that comes out longer than ``max_len`` pieces keeps its
    deterministic segmentation, as the training filter assumed it would.
    ``epoch_of`` (the training sampler) says which epoch batches belong to.
    """

    def __init__(self, tok: Tokenizer, split: Split, p: float, seed: int, max_len: int):
        self.tok, self.p, self.seed, self.max_len = tok, p, seed, max_len
        self.split = split
        self.src, self.tgt = MergeDropout(tok.src), MergeDropout(tok.tgt)
        # Normalise and split into words once (paper text runs Moses here).
        self.src_words = self.src.words(tok.src_text.normalize(split.src_text))
        self.tgt_words = self.tgt.words(tok.tgt_text.normalize(split.tgt_text))
        self.epoch_of: TokenBatchSampler | None = None
        self._cached: tuple[int, list[list[int]], list[list[int]]] | None = None

    def ids(self, epoch: int) -> tuple[list[list[int]], list[list[int]]]:
        """The split's (source ids + EOS, target ids) for ``epoch``."""
        if self._cached is None or self._cached[0] != epoch:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            src, tgt = [], []
            for i, (src_words, tgt_words) in enumerate(zip(self.src_words, self.tgt_words)):
                s, t = self.src.sample(src_words, self.p, rng), self.tgt.sample(tgt_words, self.p, rng)
                if len(s) <= self.max_len and len(t) <= self.max_len:
                    src.append([*s, self.tok.eos_id])
                    tgt.append(t)
                else:
                    src.append(self.split.src[i])
                    tgt.append(self.split.tgt[i])
            self._cached = epoch, src, tgt
        return self._cached[1], self._cached[2]

    def __call__(self, indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        src, tgt = self.ids(self.epoch_of.epoch if self.epoch_of is not None else 0)
        return [src[i] for i in indices], [tgt[i] for i in indices]


class TokenBatchSampler(Sampler[list[int]]):
    """Batches of at most ``max_tokens`` tokens, padding included.

    The cost of a batch is ``n_pairs * longest side``, where a pair's length is
    the larger of its source and target lengths (bos/eos included). Pairs are
    sorted by that length, then by the shorter side, so each batch pads little; with ``shuffle`` the ties
    are broken at random and the batch order is shuffled, both from
    ``seed + epoch`` (call ``set_epoch``), so an epoch's batches are
    reproducible. With ``world_size > 1`` each rank takes every
    ``world_size``-th batch of a list cut to a multiple of ``world_size``:
    distinct shares, equal in number.

    With ``segmentation`` (BPE-dropout) lengths change from epoch to epoch,
    but Lightning counts an epoch's batches once: every epoch is cut into the
    number of batches that ``max_tokens`` gives on a first draw, each as
    small as that count allows (about ``max_tokens``).
    """

    def __init__(
        self,
        src_lens: list[int],
        tgt_lens: list[int],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        segmentation: BPEDropout | None = None,
    ):
        self.src_lens = torch.tensor(src_lens)
        self.tgt_lens = torch.tensor(tgt_lens) + 1  # bos or eos
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.skip = 0  # batches of the current epoch already trained on (set when resuming mid-epoch)
        self.rank, self.world_size = rank, world_size
        longest = int(torch.maximum(self.src_lens, self.tgt_lens).max()) if len(src_lens) else 0
        if longest > max_tokens:
            raise DataError(f"a pair of {longest} tokens does not fit in max_tokens={max_tokens}")
        self.segmentation = segmentation
        self.n_batches: int | None = None
        self._cache: tuple[int, list[list[int]]] | None = None
        if segmentation is not None:
            order, lengths = self._sorted(*self._lengths(-1), torch.Generator().manual_seed(seed - 1))
            self.n_batches = len(self._pack(order, lengths, max_tokens))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _ranks(self) -> tuple[int, int]:
        if self.world_size is not None:
            return self.rank or 0, self.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _lengths(self, epoch: int) -> tuple[Tensor, Tensor]:
        if self.segmentation is None:
            return self.src_lens, self.tgt_lens
        src, tgt = self.segmentation.ids(epoch)
        return torch.tensor([len(x) for x in src]), torch.tensor([len(x) + 1 for x in tgt])

    def _sorted(self, src_lens: Tensor, tgt_lens: Tensor, gen: torch.Generator) -> tuple[list[int], list[int]]:
        """Pair indices sorted by the longer side, ties by the shorter one
        (stable sorts: the secondary key first), and their lengths. On
        Multi30k this pads less than sorting by source then target once
        batches hold more than a few hundred pairs."""
        n = len(src_lens)
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        longer = torch.maximum(src_lens, tgt_lens)
        order = order[torch.sort(torch.minimum(src_lens, tgt_lens)[order], stable=True).indices]
        order = order[torch.sort(longer[order], stable=True).indices]
        return order.tolist(), longer[order].tolist()

    @staticmethod
    def _pack(order: list[int], lengths: list[int], cap: int) -> list[list[int]]:
        """Cut the sorted pairs into consecutive batches of cost <= cap."""
        batches, current, longest = [], [], 0
        for i, length in zip(order, lengths):
            if current and (len(current) + 1) * max(longest, length) > cap:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, length)
        if current:
            batches.append(current)
        return batches

    def _pack_into(self, order: list[int], lengths: list[int], n: int) -> list[list[int]]:
        """Exactly ``n`` consecutive batches (fewer only if there are fewer
        pairs), the costliest as cheap as greedy packing can make it."""
        lo, hi = max(lengths), max(lengths) * len(lengths)  # hi: a single batch
        while lo < hi:  # the smallest cap that needs at most n batches
            mid = (lo + hi) // 2
            if len(self._pack(order, lengths, mid)) <= n:
                hi = mid
            else:
                lo = mid + 1
        batches = self._pack(order, lengths, lo)
        position = {i: k for k, i in enumerate(order)}
        while len(batches) < min(n, len(order)):  # split the costliest batch in two
            cost = [len(b) * lengths[position[b[-1]]] if len(b) > 1 else 0 for b in batches]
            k = max(range(len(batches)), key=cost.__getitem__)
            half = len(batches[k]) // 2
            batches[k : k + 1] = [batches[k][:half], batches[k][half:]]
        return batches

    def all_batches(self) -> list[list[int]]:
        """Every batch of this epoch, before sharding across ranks."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order, lengths = self._sorted(*self._lengths(self.epoch), gen)
        if self.n_batches is None:
            batches = self._pack(order, lengths, self.max_tokens)
        else:
            batches = self._pack_into(order, lengths, self.n_batches)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
        self._cache = self.epoch, batches
        return batches

    def __iter__(self):
        rank, world = self._ranks()
        batches = self.all_batches()
        if world > 1:
            batches = batches[: len(batches) - len(batches) % world][rank::world]
        skip, self.skip = self.skip, 0
        yield from batches[skip:]

    def __len__(self) -> int:
        _, world = self._ranks()
        return len(self.all_batches()) // world


def padding_waste(batches: list[list[int]], src_lens: list[int], tgt_lens: list[int]) -> float:
    """Share of padding in the padded source and target tensors of ``batches``."""
    real = padded = 0
    for b in batches:
        s = [src_lens[i] for i in b]
        t = [tgt_lens[i] + 1 for i in b]
        real += sum(s) + sum(t)
        padded += len(b) * (max(s) + max(t))
    return 1.0 - real / padded


class Split:
    """One prepared split in memory: token ids and the raw text."""

    def __init__(self, path: Path):
        import datasets

        if not path.is_dir():
            raise DataError(f"{path}: prepared split missing (run `mt prepare --config ...` first)")
        columns = datasets.load_from_disk(str(path)).to_dict()
        self.src: list[list[int]] = columns["src_ids"]
        self.tgt: list[list[int]] = columns["tgt_ids"]
        self.src_text: list[str] = columns["src_text"]
        self.tgt_text: list[str] = columns["tgt_text"]

    def __len__(self) -> int:
        return len(self.src)


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    path = cfg.prepared_path()
    if not (path / "prepare.json").exists():
        raise DataError(f"{path}: no prepared data for {cfg.pair} (run `mt prepare --config ...` first)")
    return Tokenizer.load(path)


class TranslationDataModule(L.LightningDataModule):
    """Serves prepared splits: token-bucketed, shuffled training batches and
    length-sorted validation batches (``Batch.index`` restores the order)."""

    def __init__(self, cfg: DataConfig, seed: int = 0):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.tokenizer = load_tokenizer(cfg)
        self.splits: dict[str, Split] = {}
        self.train_sampler: TokenBatchSampler | None = None
        self._resume_skip = 0

    def split(self, name: str) -> Split:
        if name not in self.splits:
            self.splits[name] = Split(self.cfg.prepared_path() / name)
        return self.splits[name]

    def setup(self, stage: str | None = None) -> None:
        self.split(self.cfg.train_split)
        self.split(self.cfg.valid_split)

    def loader(self, name: str, shuffle: bool) -> DataLoader:
        """Training (``shuffle``): this rank's share of the batches. Evaluation:
        every batch on every rank, so metrics cover the whole split."""
        s = self.split(name)
        segmentation = None
        if shuffle and self.cfg.bpe_dropout > 0:
            segmentation = BPEDropout(self.tokenizer, s, self.cfg.bpe_dropout, self.seed, self.cfg.max_len)
        sampler = TokenBatchSampler(
            [len(x) for x in s.src],
            [len(x) for x in s.tgt],
            self.cfg.max_tokens,
            shuffle,
            self.seed,
            rank=None if shuffle else 0,
            world_size=None if shuffle else 1,
            segmentation=segmentation,
        )
        if segmentation is not None:
            segmentation.epoch_of = sampler
        # The token sampler is the loader's `sampler` (batch_size=None: it
        # yields whole batches), because that is where Lightning calls
        # `set_epoch` at the start of each epoch; as a `batch_sampler` it
        # would never be told the epoch and every epoch would repeat the
        # first one's batches in the same order.
        # A private generator: creating the loader's iterator must not draw
        # from the global RNG, or a resumed run's dropout would drift.
        return DataLoader(
            BatchedPairs(s.src, s.tgt, self.tokenizer, segmentation),
            sampler=sampler,
            batch_size=None,  # the default collate then hands each Batch on untouched
            generator=torch.Generator(),
        )

    def train_dataloader(self) -> DataLoader:
        loader = self.loader(self.cfg.train_split, shuffle=True)
        self.train_sampler = loader.sampler
        if 0 < self._resume_skip < len(self.train_sampler):
            self.train_sampler.skip = self._resume_skip
        self._resume_skip = 0
        return loader

    # Lightning stores these in checkpoints: a run resumed mid-epoch skips
    # the batches of that epoch it has already trained on.
    def state_dict(self) -> dict:
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current if self.trainer else None
        return {"batches_done_in_epoch": progress.completed if progress else 0}

    def load_state_dict(self, state: dict) -> None:
        self._resume_skip = int(state.get("batches_done_in_epoch", 0))

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.cfg.valid_split, shuffle=False)
