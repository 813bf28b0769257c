"""The attention core: scaled dot-product attention and multi-head attention.

Notation used in every shape comment of this module:

    B    batch size
    H    number of heads
    T_q  number of queries (target positions)
    T_k  number of keys/values (source positions, or target positions so far)
    D    model width (d_model);  D_h = D / H, the width of one head (d_k = d_v)

Masks follow ``mt.masks``: boolean, broadcastable to (B, H, T_q, T_k),
``True`` = may attend.

About the temperature: scores are divided by sqrt(d_k) * temperature. A
*larger* divisor shrinks the scores towards each other and so *flattens* the
softmax; a smaller one sharpens it. (Some course notes say to raise the
sqrt(d_k) denominator when the weights look too flat; that is backwards.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt.linear import Linear, StackedWeight


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    *,
    dropout: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ / (sqrt(d_k) * temperature)) v, step by step.

    q: (..., T_q, d_k), k: (..., T_k, d_k), v: (..., T_k, d_v);
    mask: bool, broadcastable to (..., T_q, T_k), True = may attend.
    Returns (output (..., T_q, d_v), weights (..., T_q, T_k)).
    A query row with no allowed key gets all-zero weights and a zero output.
    ``dropout`` (training only) drops weights before they multiply v; the
    returned weights are the ones before dropout.
    """
    d_k = q.size(-1)
    scores = q @ k.transpose(-2, -1) / (math.sqrt(d_k) * temperature)  # (..., T_q, T_k)
    if mask is None:
        weights = _softmax(scores)
    else:
        # A row with nothing to attend to would be softmax(all -inf) = NaN.
        # Let such rows see every key (any finite value would do) and zero them after.
        has_key = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
        scores = scores.masked_fill(~(mask | ~has_key), float("-inf"))
        # torch.softmax is the numerically stable form: it subtracts each
        # row's maximum before exponentiating, so exp() never overflows.
        weights = _softmax(scores) * has_key
    dropped = F.dropout(weights, dropout) if dropout else weights
    return dropped @ v, weights  # (..., T_q, d_v), (..., T_q, T_k)


def _softmax(scores: Tensor) -> Tensor:
    """``torch.softmax(scores, dim=-1)``. PyTorch's CPU kernel for the last
    dimension takes a slow path for rows shorter than a vector register (16
    floats): 2-3x slower there than softmax over another dimension, and
    decoding hits it at every step (a few source or target positions).
    Such rows go through the transpose instead (same values, a strided view)."""
    if scores.device.type == "cpu" and scores.size(-1) < 16:
        return torch.softmax(scores.transpose(-1, -2), dim=-2).transpose(-1, -2)
    return torch.softmax(scores, dim=-1)


class KVStore:
    """Key and value buffers (B, H, capacity, D_h) with room to grow: a
    cache's ``k`` and ``v`` are views of their first positions, so that the
    next decoding step writes its position in place instead of copying the
    whole cache (``torch.cat``) as it appends. ``length`` is how many positions
    are claimed: a second step from the same, shorter cache must not
    overwrite what the first wrote, so it copies instead."""

    __slots__ = ("k", "v", "length")

    def __init__(self, k: Tensor, v: Tensor, length: int):
        self.k, self.v, self.length = k, v, length


class KV(NamedTuple):
    """Projected keys and values of one attention layer, (B, H, T_k, D_h) each.

    ``rows`` (R,), when set, is a reordering not yet carried out: the cache
    stands for ``k[rows]`` and ``v[rows]``. Self-attention carries it out while
    appending the next position, in one copy of the cache instead of two
    (beam search reorders the whole cache at every step). ``store``, when set,
    holds ``k`` and ``v`` with room for more positions (``KVStore``).
    """

    k: Tensor
    v: Tensor
    rows: Tensor | None = None
    store: KVStore | None = None

    def select(self, rows: Tensor) -> KV:
        """The cache of batch rows ``rows`` (in that order), picked lazily."""
        return KV(self.k, self.v, rows if self.rows is None else self.rows[rows])

    def resolved(self) -> KV:
        """The same cache with any pending reordering carried out."""
        if self.rows is None:
            return self
        return KV(self.k.index_select(0, self.rows), self.v.index_select(0, self.rows))


class AttentionOutput(NamedTuple):
    output: Tensor  # (B, T_q, D)
    weights: Tensor | None  # (B, H, T_q, T_k) when asked for, else None
    kv: KV  # the keys and values attended to, for caching


class MultiHeadAttention(nn.Module):
    """Multi-head attention for encoder self-, decoder self- and cross-attention.

    ``forward(query, key_value, mask)`` projects the query and the key/value
    inputs, splits them into heads, attends and merges the heads. Caching for
    incremental decoding, without any mode switch:

    * ``past=KV`` with a ``key_value`` input: the new keys/values are appended
      to ``past`` (decoder self-attention, one step at a time);
    * ``past=KV`` with ``key_value=None``: ``past`` is attended as it is
      (cross-attention: the source's keys/values are projected once).

    The returned ``kv`` is what the next step passes back as ``past``.

    Grouped queries: the query batch may be G times the key/value batch
    (B*G rows against B); query rows ``i*G .. i*G+G-1`` then attend to key row
    ``i``. Beam search uses this so that a source's beams share its projected
    keys and values instead of copying them G times (and reordering the
    copies at every step). The mask then has one row per key row (B or 1)
    and no query dimension, as the source padding mask has.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, impl: str = "auto"):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if impl not in ("auto", "explicit", "fused"):
            raise ValueError(f"impl must be auto, explicit or fused, not {impl!r}")
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.dropout = dropout
        self.impl = impl
        self.w_q = Linear(d_model, d_model)
        self.w_k = Linear(d_model, d_model)
        self.w_v = Linear(d_model, d_model)
        self.w_o = Linear(d_model, d_model)
        for linear in (self.w_q, self.w_k, self.w_v, self.w_o):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)
        # inference: self-attention's three projections as one product (faster
        # decoding steps, see docs/results.md, Decoding speed); training keeps three
        self.w_qkv = StackedWeight()

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape  # (B, T, D)
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, D_h)

    def merge_heads(self, x: Tensor) -> Tensor:
        b, _, t, _ = x.shape  # (B, H, T, D_h)
        return x.transpose(1, 2).reshape(b, t, self.n_heads * self.d_head)  # (B, T, D)

    def use_fused(self, device: torch.device) -> bool:
        """The fused kernel where it is faster: on CUDA. On CPU, at translation
        lengths, the explicit path measured faster (see docs/results.md, Attention core)."""
        return self.impl == "fused" or (self.impl == "auto" and device.type == "cuda")

    def forward(
        self,
        query: Tensor,
        key_value: Tensor | None,
        mask: Tensor | None = None,
        *,
        past: KV | None = None,
        need_weights: bool = False,
        temperature: float = 1.0,
    ) -> AttentionOutput:
        """query: (B, T_q, D); key_value: (B, T_new, D) or None; mask: bool,
        broadcastable to (B, H, T_q, T_k) where T_k counts ``past`` keys too."""
        if key_value is query and not torch.is_grad_enabled():  # self-attention, inference
            b, t, _ = query.shape
            qkv = self.w_qkv(query, [self.w_q, self.w_k, self.w_v]).view(b, t, 3, self.n_heads, self.d_head)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D_h) each
            if past is None:
                k, v = k.contiguous(), v.contiguous()
        elif key_value is None:
            if past is None:
                raise ValueError("key_value=None needs past keys/values to attend to")
            q = self.split_heads(self.w_q(query))  # (B, H, T_q, D_h)
            cached = past.resolved()
            k, v = cached.k, cached.v
        else:
            q = self.split_heads(self.w_q(query))
            # contiguous: the products below would copy these strided views on every use,
            # and a cached source's keys/values are used at every decoding step
            k = self.split_heads(self.w_k(key_value)).contiguous()  # (B, H, T_new, D_h)
            v = self.split_heads(self.w_v(key_value)).contiguous()
        store = None
        if key_value is not None and past is not None:
            k, v, store = _append(past, k, v)  # (B, H, T_k, D_h) each
        dropout = self.dropout if self.training else 0.0
        groups = q.size(0) // k.size(0)
        if groups * k.size(0) != q.size(0):
            raise ValueError(f"{q.size(0)} query rows cannot share {k.size(0)} key/value rows evenly")
        if groups > 1:
            if mask is not None and (mask.size(-2) != 1 or mask.size(0) not in (1, k.size(0))):
                raise ValueError("grouped queries need a mask per key row without a query dimension")
            q = _group(q, groups)  # (B, H, G*T_q, D_h)

        if need_weights or not self.use_fused(q.device):
            out, weights = scaled_dot_product_attention(q, k, v, mask, temperature, dropout=dropout)
        else:
            weights = None
            has_key = None
            if mask is not None:  # same zero-row rule as the explicit path
                has_key = mask.any(dim=-1, keepdim=True)
                mask = mask | ~has_key
            scale = 1.0 / (math.sqrt(self.d_head) * temperature)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
            if has_key is not None:
                out = out * has_key
        if groups > 1:
            out = _ungroup(out, groups)
            weights = _ungroup(weights, groups) if need_weights else None
        kv = KV(k, v, None, store)
        return AttentionOutput(self.w_o(self.merge_heads(out)), weights if need_weights else None, kv)


def _append(past: KV, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KVStore | None]:
    """``torch.cat([past.k[past.rows], k], dim=2)``, and the same for v:
    (B_past, H, T, D_h), (B, H, T_new, D_h) -> (B, H, T + T_new, D_h).

    Without gradients the result lies in a ``KVStore`` with room to grow: the
    new positions are written in place where ``past`` has room and nothing
    was appended to it yet; otherwise ``past`` is copied once into a new
    store: of twice the length, or of just the length when ``past.rows``
    reorders it on the way."""
    t, n = past.k.size(2), k.size(2)
    if torch.is_grad_enabled() and (past.k.requires_grad or k.requires_grad or v.requires_grad):
        old_k, old_v = (past.k, past.v) if past.rows is None else (past.k[past.rows], past.v[past.rows])
        return torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2), None  # out= has no backward
    store = past.store
    if past.rows is not None or store is None or store.length != t or t + n > store.k.size(2):
        b, h, _, d = k.shape
        # room only where the cache is not being reordered: beam search reorders
        # (copies) it at every step anyway, and its attention runs faster on a
        # cache without gaps
        capacity = t + n if past.rows is not None else 2 * (t + n)
        store = KVStore(k.new_empty(b, h, capacity, d), v.new_empty(b, h, capacity, v.size(3)), t)
        for old, buf in ((past.k, store.k), (past.v, store.v)):
            if past.rows is None:
                buf[:, :, :t] = old
            else:
                torch.index_select(old, 0, past.rows, out=buf[:, :, :t])
    store.k[:, :, t : t + n] = k
    store.v[:, :, t : t + n] = v
    store.length = t + n
    return store.k[:, :, : t + n], store.v[:, :, : t + n], store


def _group(x: Tensor, g: int) -> Tensor:
    """(B*G, H, T, X) -> (B, H, G*T, X): a key row's G query rows side by side."""
    bg, h, t, d = x.shape
    return x.view(bg // g, g, h, t, d).transpose(1, 2).reshape(bg // g, h, g * t, d)


def _ungroup(x: Tensor, g: int) -> Tensor:
    """(B, H, G*T, X) -> (B*G, H, T, X), the inverse of ``_group``."""
    b, h, gt, d = x.shape
    return x.view(b, h, g, gt // g, d).transpose(1, 2).reshape(b * g, h, gt // g, d)


def attention_stats(weights: Tensor, mask: Tensor | None = None, scores: Tensor | None = None) -> dict[str, Tensor]:
    """Per-head debugging statistics of one attention layer.

    weights: (B, H, T_q, T_k); mask as for attention; scores: the raw scaled
    scores (B, H, T_q, T_k), optional. Returns a dict of (H,) tensors: mean
    row entropy (nats), the same normalised by log(number of allowed keys)
    (1 = uniform), mean row maximum, counts of NaN rows and all-zero rows and,
    with scores, their min/max/mean over allowed keys. Means are over rows
    that attend somewhere (normalised entropy: rows with two or more keys).
    """
    if mask is None:
        mask = torch.ones_like(weights, dtype=torch.bool)
    mask = mask.expand_as(weights)
    heads = weights.size(1)

    def per_head(x: Tensor) -> Tensor:
        return x.transpose(0, 1).reshape(heads, -1)  # (B, H, ...) -> (H, N)

    nan_rows = per_head(torch.isnan(weights).any(dim=-1))  # (H, B*T_q)
    zero_rows = per_head((weights == 0).all(dim=-1))
    live = (~(nan_rows | zero_rows)).float()
    w = weights.float().nan_to_num(0.0)
    entropy = per_head(-(w * torch.log(w.clamp_min(1e-30))).sum(-1))  # (H, B*T_q)
    n_keys = per_head(mask.sum(-1)).float()
    multi = live * (n_keys > 1).float()
    norm_entropy = entropy / torch.log(n_keys.clamp_min(2))
    stats = {
        "entropy": (entropy * live).sum(-1) / live.sum(-1).clamp_min(1),
        "norm_entropy": (norm_entropy * multi).sum(-1) / multi.sum(-1).clamp_min(1),
        "weight_max": (per_head(w.amax(-1)) * live).sum(-1) / live.sum(-1).clamp_min(1),
        "nan_rows": nan_rows.sum(-1),
        "zero_rows": zero_rows.sum(-1),
    }
    if scores is not None:
        allowed, s = per_head(mask), per_head(scores.float())
        inf = torch.tensor(float("inf"))
        stats["score_min"] = torch.where(allowed, s, inf).amin(-1)
        stats["score_max"] = torch.where(allowed, s, -inf).amax(-1)
        stats["score_mean"] = (s * allowed).sum(-1) / allowed.sum(-1).clamp_min(1)
    return stats
