"""Prepared data to training batches: a token-count batch sampler,
BPE-dropout, and the LightningDataModule that serves them to training.
The data it reads is ``mt prepare``'s (``mt.prepare``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Sampler

from mt.config import DataConfig
from mt.errors import DataError
from mt.tokenizer import MergeDropout, Tokenizer, pad_batch


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
