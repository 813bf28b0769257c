"""Sentences that join a search under way: the caches and encodings of
``mt.decode.continuous``, where rows began at different steps.

Slot t of a ``JoinedCache`` holds, for every row, the keys/values of the
token decoded at the search's step t; a row that joined at step j leaves
the slots before j unused (its ``pad``): its positions count from j, and its
queries do not see those slots. Sources of different lengths are padded
to the longest, masked by their padding masks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from mt.decode.fastpath import GrowingKV
from mt.model.attention import KV
from mt.model.layers import LayerCache
from mt.model.masks import lengths_mask
from mt.model.transformer import DecoderCache, EncoderOutput


def cat_padded(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """``a`` and ``b`` concatenated along their first dimension, the shorter of the
    two along ``dim`` padded at its end with zeros (False in a mask)."""
    t = max(a.size(dim), b.size(dim))

    def pad(x: Tensor) -> Tensor:
        if x.size(dim) == t:
            return x
        shape = list(x.shape)
        shape[dim] = t - x.size(dim)
        return torch.cat([x, x.new_zeros(shape)], dim=dim)

    return torch.cat([pad(a), pad(b)])


def join_sources(old: EncoderOutput, new: EncoderOutput) -> EncoderOutput:
    """``old``'s rows, then ``new``'s: the shorter sources padded (masked) to the longer."""
    memory = cat_padded(old.memory, new.memory, 1)  # (B + B', T_s, D)
    return EncoderOutput(memory, cat_padded(old.src_mask, new.src_mask, 3), None)


def with_rows(kv: KV | GrowingKV, rows: int, drop: int = 0) -> KV | GrowingKV:
    """The cache without its first ``drop`` positions and with ``rows`` more batch rows
    of zeros after its own: (B, H, T, D_h) -> (B + rows, H, T - drop, D_h) each."""
    if isinstance(kv, GrowingKV):  # one copy, any pending reordering carried out on the way
        return kv.with_rows(rows, drop)
    k, v = kv.k[:, :, drop:], kv.v[:, :, drop:]
    return KV(torch.cat([k, k.new_zeros(rows, *k.shape[1:])]), torch.cat([v, v.new_zeros(rows, *v.shape[1:])]))


@dataclass
class JoinedCache(DecoderCache):
    """A decoder cache whose rows began at different steps. ``pad`` (B,): per target
    row, the number of leading slots it does not use. A row's position is the cache's
    length minus its ``pad``, and its queries attend only from that slot on."""

    pad: Tensor | None = None

    def positions(self) -> int | Tensor:
        return self.length if self.pad is None else self.length - self.pad  # (B,) when rows differ

    def self_mask(self, t_new: int, device: torch.device) -> Tensor | None:
        mask = super().self_mask(t_new, device)
        if self.pad is None:
            return mask
        used = ~lengths_mask(self.pad, self.length + t_new)  # (B, 1, 1, T_k): from each row's first slot on
        return used if mask is None else mask & used

    def reorder(self, index: Tensor, source_index: Tensor | None = None) -> JoinedCache:
        cache = super().reorder(index, source_index)
        return dataclasses.replace(cache, pad=None if self.pad is None else self.pad.index_select(0, index))

    def join(self, new: DecoderCache, rows: int, drop: int = 0) -> JoinedCache:
        """This cache's rows, then ``rows`` rows of sentences that join now, whose
        source keys/values ``new`` holds (``Transformer.source_cache``).

        The new rows have no positions yet: they start at this cache's length,
        and their slots before it are zeros that their ``pad`` masks. ``drop``
        leading slots that no row uses are dropped first."""
        t = self.length
        if t == 0:
            raise ValueError("sentences join a cache that has decoded at least one position")
        layers = []
        for old, fresh in zip(self.layers, new.layers):
            past = with_rows(old.self_kv, rows, drop)  # (B + rows, H, T - drop, D_h)
            cross = old.cross_kv
            cross = KV(cat_padded(cross.k, fresh.cross_kv.k, 2), cat_padded(cross.v, fresh.cross_kv.v, 2))
            layers.append(LayerCache(past, cross))
        b = layers[0].self_kv.k.size(0) - rows
        pad = self.pad if self.pad is not None else torch.zeros(b, dtype=torch.long, device=layers[0].self_kv.k.device)
        return JoinedCache(layers, torch.cat([pad - drop, pad.new_full((rows,), t - drop)]))
