"""Several trained models decoding as one (``mt translate --model A B``).

The ensemble's next-token distribution is the mean of its members'
probabilities, as in fairseq's ensembles:
``log p(y) = logsumexp_m log p_m(y) - log M``. It offers the ``encode`` /
``decode`` interface that ``mt.decode.search`` calls, so greedy and beam search,
the key/value caches and their reordering work unchanged: each member keeps
its own cache, and every reorder is applied to all of them.

Members must share the target vocabulary (the same tokenizer, checked when
loading them, ``mt.decode.inference.load_ensemble``); their sizes may differ.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from mt.decode.joining import join_sources
from mt.model.transformer import DecoderCache, DecoderOutput, EncoderOutput, Transformer


class EnsembleEncoding(NamedTuple):
    members: list[EncoderOutput]

    def index_select(self, index: Tensor) -> EnsembleEncoding:
        return EnsembleEncoding([e.index_select(index) for e in self.members])

    def join(self, other: EnsembleEncoding) -> EnsembleEncoding:
        return EnsembleEncoding([join_sources(a, b) for a, b in zip(self.members, other.members)])


@dataclass
class EnsembleCache:
    """One ``DecoderCache`` per member, reordered together."""

    members: list[DecoderCache]

    def reorder(self, index: Tensor, source_index: Tensor | None = None) -> EnsembleCache:
        return EnsembleCache([c.reorder(index, source_index) for c in self.members])

    def join(self, new: EnsembleCache, rows: int, drop: int = 0) -> EnsembleCache:
        return EnsembleCache([c.join(n, rows, drop) for c, n in zip(self.members, new.members)])


class Ensemble(nn.Module):
    """Models of one target vocabulary whose probabilities are averaged.

    ``cfg`` is the first member's config with the smallest ``max_positions``
    of all members, the one limit that search and truncation read from it.
    ``decode`` returns log-probabilities in place of logits (normalised
    already; search's log-softmax leaves them as they are).
    """

    def __init__(self, models: list[Transformer]):
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model")
        first = models[0].cfg
        for m in models[1:]:
            if (m.cfg.tgt_vocab_size, m.cfg.pad_id) != (first.tgt_vocab_size, first.pad_id):
                raise ValueError(
                    f"ensemble members disagree on the target vocabulary: {m.cfg.tgt_vocab_size} entries, "
                    f"pad {m.cfg.pad_id} against {first.tgt_vocab_size}, pad {first.pad_id}"
                )
        self.members = nn.ModuleList(models)
        self.cfg = dataclasses.replace(first, max_positions=min(m.cfg.max_positions for m in models))

    def encode(self, src: Tensor) -> EnsembleEncoding:
        """src: (B, T_s) -> each member's encoder output."""
        return EnsembleEncoding([m.encode(src) for m in self.members])

    def source_cache(self, enc: EnsembleEncoding) -> EnsembleCache:
        """Each member's ``Transformer.source_cache``."""
        return EnsembleCache([m.source_cache(e) for m, e in zip(self.members, enc.members)])

    def decode(
        self, tgt: Tensor, enc: EnsembleEncoding, cache: DecoderCache | EnsembleCache | None = None
    ) -> DecoderOutput:
        """tgt: (B, T_t) -> log of the members' mean probabilities (B, T_t, V), float32.

        As ``Transformer.decode``: without a cache ``tgt`` is the whole
        prefix; with one (start with an empty ``DecoderCache()``) only the
        new positions, and the returned ``EnsembleCache`` covers them all.
        """
        if cache is None:
            caches: list[DecoderCache | None] = [None] * len(self.members)
        elif isinstance(cache, EnsembleCache):
            caches = list(cache.members)
        elif cache.length == 0:
            caches = [DecoderCache() for _ in self.members]
        else:
            raise ValueError("an ensemble continues from its own EnsembleCache, not a single model's cache")
        outs = [m.decode(tgt, e, c) for m, e, c in zip(self.members, enc.members, caches)]
        log_probs = torch.stack([torch.log_softmax(o.logits.float(), dim=-1) for o in outs])  # (M, B, T_t, V)
        mixed = torch.logsumexp(log_probs, dim=0) - math.log(len(outs))  # (B, T_t, V)
        new_cache = EnsembleCache([o.cache for o in outs]) if cache is not None else None
        return DecoderOutput(mixed, new_cache, None, None)
