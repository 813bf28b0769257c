"""Prepared data to training batches: a token-count batch sampler,
BPE-dropout, and the LightningDataModule that serves them to training.
The data it reads is ``mt prepare``'s (``mt.data.prepare``)."""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Sampler

from mt.config import DataConfig
from mt.data.tokenizer import MergeDropout, Tokenizer, pad_batch
from mt.errors import DataError


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
    padded ``Batch`` of those rows, read from the split's file. The
    loader's sampler yields the index lists (``TokenBatchSampler``) with
    automatic batching off. ``segment``, when given, supplies the rows' token
    ids in place of the stored ones (BPE-dropout)."""

    def __init__(
        self,
        split: Split,
        tok: Tokenizer,
        segment: Callable[[list[int]], tuple[list[list[int]], list[list[int]]]] | None = None,
    ):
        self.split, self.tok, self.segment = split, tok, segment

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, indices: list[int]) -> Batch:
        t = self.tok
        src, tgt = self.split.ids(indices) if self.segment is None else self.segment(indices)
        return Batch(
            src=pad_batch(src, t.pad_id),
            tgt_in=pad_batch([[t.bos_id, *y] for y in tgt], t.pad_id),
            tgt_out=pad_batch([[*y, t.eos_id] for y in tgt], t.pad_id),
            index=torch.as_tensor(indices, dtype=torch.long),
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

    def _sorted(self, src_lens: Tensor, tgt_lens: Tensor, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Pair indices sorted by the longer side, ties by the shorter one
        (stable sorts: the secondary key first), and their lengths. On
        Multi30k this pads less than sorting by source then target once
        batches hold more than a few hundred pairs."""
        n = len(src_lens)
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        longer = torch.maximum(src_lens, tgt_lens)
        order = order[torch.sort(torch.minimum(src_lens, tgt_lens)[order], stable=True).indices]
        order = order[torch.sort(longer[order], stable=True).indices]
        return order.numpy(), longer[order].numpy()

    @staticmethod
    def _pack(order: np.ndarray, lengths: np.ndarray, cap: int) -> list[np.ndarray]:
        """Cut the sorted pairs into consecutive batches of cost <= cap, each
        as long as it can be (greedily, in order). ``lengths`` never decrease,
        so a batch's cost is its size times its last pair's length, and the
        cost of a batch starting at ``i`` grows with its size: the longest one
        that fits is a binary search, not a walk over every pair."""
        lengths = np.asarray(lengths, dtype=np.int64)
        ends, i, n = [], 0, len(lengths)
        while i < n:
            window = lengths[i : i + max(1, cap // max(1, int(lengths[i])))]  # a longer batch would cost more than cap
            cost = np.arange(1, len(window) + 1) * window
            i += max(1, int(np.searchsorted(cost, cap, side="right")))  # a lone pair over cap goes alone
            ends.append(i)
        return np.split(np.asarray(order), ends[:-1])

    def _pack_into(self, order: np.ndarray, lengths: np.ndarray, n: int) -> list[np.ndarray]:
        """Exactly ``n`` consecutive batches (fewer only if there are fewer
        pairs), the costliest as cheap as greedy packing can make it."""
        lo, hi = int(max(lengths)), int(max(lengths)) * len(lengths)  # hi: a single batch
        while lo < hi:  # the smallest cap that needs at most n batches
            mid = (lo + hi) // 2
            if len(self._pack(order, lengths, mid)) <= n:
                hi = mid
            else:
                lo = mid + 1
        ends = np.cumsum([len(b) for b in self._pack(order, lengths, lo)]).tolist()
        spans = list(zip([0, *ends[:-1]], ends))  # [start, end) of each batch in the sorted order
        while len(spans) < min(n, len(order)):  # split the costliest batch in two
            cost = [(e - s) * lengths[e - 1] if e - s > 1 else 0 for s, e in spans]
            k = max(range(len(spans)), key=cost.__getitem__)
            s, e = spans[k]
            spans[k : k + 1] = [(s, s + (e - s) // 2), (s + (e - s) // 2, e)]
        return [order[s:e] for s, e in spans]

    def all_batches(self) -> list[np.ndarray]:
        """Every batch of this epoch (arrays of pair indices), before sharding across ranks."""
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
        for batch in batches[skip:]:
            yield batch.tolist()

    def __len__(self) -> int:
        _, world = self._ranks()
        return len(self.all_batches()) // world


def padding_waste(batches: list[np.ndarray], src_lens: np.ndarray, tgt_lens: np.ndarray) -> float:
    """Share of padding in the padded source and target tensors of ``batches``."""
    src_lens, tgt_lens = np.asarray(src_lens), np.asarray(tgt_lens) + 1  # + bos or eos
    real = padded = 0
    for b in batches:
        s, t = src_lens[b], tgt_lens[b]
        real += int(s.sum()) + int(t.sum())
        padded += len(b) * (int(s.max()) + int(t.max()))
    return 1.0 - real / padded


PAIRS_FILE = "pairs.arrow"  # a prepared split: one Arrow IPC stream file (mt.data.prepare)


def _load_split(path: Path):
    """A prepared split as a ``datasets.Dataset`` memory-mapped from its file."""
    import datasets

    if (path / PAIRS_FILE).is_file():
        return datasets.Dataset.from_file(str(path / PAIRS_FILE))
    if (path / "state.json").is_file():  # prepared by an earlier mt, with datasets.save_to_disk
        return datasets.load_from_disk(str(path))
    raise DataError(f"{path}: prepared split missing (run `mt prepare --config ...` first)")


class ListRows:
    """Rows of ``list<int32>`` columns of an Arrow IPC stream file, each read
    with a positioned read (``os.pread``) from where the file's own layout
    puts it. The file is memory-mapped for its layout only: its metadata and
    the columns' offsets are read once (the offsets into memory, 8 bytes a
    row), its rows never through the mapping. A page that a process reads
    through a mapping counts as its resident memory from then on, and with
    the kernel's fault-around (64 KiB a fault) random rows soon map all of a
    large split; positioned reads go through the page cache, shared by every
    process that reads the file (DDP ranks, loader workers), and leave a
    process's own memory as it was."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        import pyarrow as pa

        self.path, self.columns = Path(path), columns
        mapped = pa.memory_map(str(path))
        base, size = mapped.read_buffer(1).address, mapped.size()
        mapped.seek(0)
        batches = pa.ipc.open_stream(mapped).read_all().to_batches()
        self.starts = np.cumsum([0] + [len(b) for b in batches])  # first row of each record batch
        self.offsets: dict[str, list[np.ndarray]] = {c: [] for c in columns}  # per batch: n + 1 item offsets
        self.values: dict[str, list[int]] = {c: [] for c in columns}  # per batch: file position of the items
        with open(path, "rb") as f:
            for batch in batches:
                for c in columns:
                    column = batch.column(batch.schema.get_field_index(c))
                    _, offsets, _, values = column.buffers()
                    if column.type != pa.list_(pa.int32()) or column.offset or column.values.offset:
                        raise DataError(f"{path}: column {c} is not a plain list<int32> column")
                    if not all(base <= b.address <= base + size for b in (offsets, values)):  # a copy: no position
                        raise DataError(f"{path}: column {c} is not laid out in the file")
                    n = 4 * (len(column) + 1)
                    self.offsets[c].append(np.frombuffer(os.pread(f.fileno(), n, offsets.address - base), "<i4"))
                    self.values[c].append(values.address - base)
        self._fd: tuple[int, int] | None = None  # (process id, descriptor): each process opens its own

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._fd[0] == os.getpid():
            os.close(self._fd[1])

    def lengths(self, column: str) -> np.ndarray:
        """Items per row of ``column``, for every row."""
        return np.concatenate([np.diff(o) for o in self.offsets[column]] or [np.zeros(0, np.int32)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, rows: list[int]) -> list[list[list[int]]]:
        """For each column, the items of ``rows``."""
        if self._fd is None or self._fd[0] != os.getpid():
            self._fd = os.getpid(), os.open(self.path, os.O_RDONLY)
        fd = self._fd[1]
        at = np.searchsorted(self.starts, rows, side="right") - 1
        out = []
        for c in self.columns:
            items = []
            for row, k in zip(rows, at.tolist()):
                offsets, j = self.offsets[c][k], row - self.starts[k]
                start, end = int(offsets[j]), int(offsets[j + 1])
                raw = os.pread(fd, 4 * (end - start), self.values[c][k] + 4 * start)
                items.append(np.frombuffer(raw, "<i4").tolist())
            out.append(items)
        return out


def _lengths(ds) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow.compute as pc

    table = ds.data  # the memory-mapped Arrow table: list lengths come from its offsets
    return tuple(pc.list_value_length(table.column(c)).to_numpy() for c in ("src_ids", "tgt_ids"))


def split_lengths(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Token counts of a prepared split's (source ids + EOS, target ids)."""
    return Split(path).lengths()


class Split:
    """One prepared split, read from its file as rows are asked for, so a
    split of millions of pairs costs each process that opens it (every DDP
    rank, every loader worker) little memory of its own: the operating
    system's page cache holds the file, once, for all of them.

    ``src_lens``/``tgt_lens`` are the token counts (arrays, for batching);
    ``ids(rows)`` reads token ids (``ListRows``); ``src``/``tgt``/``src_text``/
    ``tgt_text`` read a whole column into lists, for evaluation-sized splits,
    through ``ds``, the split as a memory-mapped ``datasets.Dataset``."""

    def __init__(self, path: Path):
        self.path = path
        self.ds = _load_split(path)
        if (path / PAIRS_FILE).is_file():
            self.rows: ListRows | None = ListRows(path / PAIRS_FILE, ("src_ids", "tgt_ids"))
            self.src_lens, self.tgt_lens = self.rows.lengths("src_ids"), self.rows.lengths("tgt_ids")
        else:  # prepared by an earlier mt (datasets.save_to_disk): rows through the mapping
            self.rows = None
            self.src_lens, self.tgt_lens = _lengths(self.ds)

    def __len__(self) -> int:
        return len(self.ds)

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        return self.src_lens, self.tgt_lens

    def ids(self, rows: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(source ids + EOS, target ids) of ``rows``."""
        if self.rows is not None:
            src, tgt = self.rows.read(rows)
            return src, tgt
        got = self.ds.select_columns(["src_ids", "tgt_ids"])[list(rows)]
        return got["src_ids"], got["tgt_ids"]

    def _column(self, name: str) -> list:
        return self.ds.data.column(name).to_pylist()

    @functools.cached_property
    def src(self) -> list[list[int]]:
        return self._column("src_ids")

    @functools.cached_property
    def tgt(self) -> list[list[int]]:
        return self._column("tgt_ids")

    @functools.cached_property
    def src_text(self) -> list[str]:
        return self._column("src_text")

    @functools.cached_property
    def tgt_text(self) -> list[str]:
        return self._column("tgt_text")


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
            s.src_lens,
            s.tgt_lens,
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
        # Worker processes (data.num_workers) read and pad batches ahead of
        # the training step; each maps the split's files itself.
        workers = self.cfg.num_workers if shuffle else 0
        return DataLoader(
            BatchedPairs(s, self.tokenizer, segmentation),
            sampler=sampler,
            batch_size=None,  # the default collate then hands each Batch on untouched
            generator=torch.Generator(),
            num_workers=workers,
            persistent_workers=workers > 0,
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
