"""The attention core: scaled dot-product attention and multi-head attention.

Notation used in every shape comment of this module:

    B    batch size
    H    number of heads
    T_q  number of queries (target positions)
    T_k  number of keys/values (source positions, or target positions so far)
    D    model width (d_model);  D_h = D / H, the width of one head (d_k = d_v)

Masks follow ``mt.model.masks``: boolean, broadcastable to (B, H, T_q, T_k),
``True`` = may attend.

About the temperature: scores are divided by sqrt(d_k) * temperature. A
*larger* divisor shrinks the scores towards each other and so *flattens* the
softmax; a smaller one sharpens it. (Some course notes say to raise the
sqrt(d_k) denominator when the weights look too flat; that is backwards.)

This is the textbook path. Decoding swaps in faster versions of the same
computations (``mt.decode.fastpath``), proven equal by tests.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
        weights = torch.softmax(scores, dim=-1)  # stable: subtracts each row's maximum first
    else:
        mask, has_key = keyless_rows_see_all(mask)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1) * has_key  # keyless rows zeroed
    dropped = F.dropout(weights, dropout) if dropout else weights
    return dropped @ v, weights  # (..., T_q, d_v), (..., T_q, T_k)


class KV(NamedTuple):
    """One attention layer's projected keys and values, (B, H, T_k, D_h) each:
    what a decoding step keeps so that the next step projects only its new
    positions (a key/value cache)."""

    k: Tensor
    v: Tensor

    def append(self, k: Tensor, v: Tensor) -> KV:
        """The cache with new positions (B, H, T_new, D_h) after the old ones."""
        return KV(torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2))

    def select(self, rows: Tensor) -> KV:
        """The cache of batch rows ``rows``, in that order (beam search's reordering)."""
        return KV(self.k.index_select(0, rows), self.v.index_select(0, rows))


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

    Beam search keeps one copy of each source's keys and values for its G
    beams: the query batch may then be G times the key/value batch (B*G rows
    against B, see ``attend``), with a mask of one row per key row (B or 1).
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
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        for linear in (self.w_q, self.w_k, self.w_v, self.w_o):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape  # (B, T, D)
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, D_h)

    def merge_heads(self, x: Tensor) -> Tensor:
        b, _, t, _ = x.shape  # (B, H, T, D_h)
        return x.transpose(1, 2).reshape(b, t, self.n_heads * self.d_head)  # (B, T, D)

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
        if key_value is None and past is None:
            raise ValueError("key_value=None needs past keys/values to attend to")
        q, kv = self.project(query, key_value, past)  # (B, H, T_q, D_h); (B, H, T_k, D_h) each
        out, weights = self.attend(q, kv.k, kv.v, mask, need_weights, temperature)  # (B, H, T_q, D_h)
        return AttentionOutput(self.w_o(self.merge_heads(out)), weights, kv)

    def project(self, query: Tensor, key_value: Tensor | None, past: KV | None) -> tuple[Tensor, KV]:
        """Q = query·W_Q, K = key_value·W_K, V = key_value·W_V, split into heads;
        K and V after ``past``'s (or ``past``'s alone, when ``key_value`` is None)."""
        q = self.split_heads(self.w_q(query))  # (B, H, T_q, D_h)
        if key_value is None:  # cross-attention while decoding: the source was projected at the first step
            return q, past
        kv = self.project_kv(key_value)
        return q, kv if past is None else past.append(kv.k, kv.v)

    def project_kv(self, key_value: Tensor) -> KV:
        """K = key_value·W_K, V = key_value·W_V, split into heads: (B, T, D) -> KV of (B, H, T, D_h)."""
        # contiguous: every product of the attention reads them (a cached source's, at every decoding step)
        k = self.split_heads(self.w_k(key_value)).contiguous()  # (B, H, T, D_h)
        v = self.split_heads(self.w_v(key_value)).contiguous()
        return KV(k, v)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, need_weights: bool, temperature: float
    ) -> tuple[Tensor, Tensor | None]:
        """The heads' outputs (B, H, T_q, D_h), and their weights (B, H, T_q, T_k) if asked for:
        the explicit path whenever weights are asked for, else the fused kernel where ``use_fused``.

        Beams share their source: with G query rows per key/value row (beam search's
        G hypotheses of one sentence, rows ``i*G .. i*G+G-1`` for key row ``i``), each
        query row attends to its sentence's keys and values, repeated here for it."""
        if q.size(0) != k.size(0):
            groups = q.size(0) // k.size(0)
            if groups * k.size(0) != q.size(0):
                raise ValueError(f"{q.size(0)} query rows cannot share {k.size(0)} key/value rows evenly")
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)  # (B*G, H, T_k, D_h)
            if mask is not None and mask.size(0) > 1:
                mask = mask.repeat_interleave(groups, 0)
        dropout = self.dropout if self.training else 0.0
        if need_weights or not self.use_fused(q.device):
            out, weights = scaled_dot_product_attention(q, k, v, mask, temperature, dropout=dropout)
            return out, weights if need_weights else None
        return fused_attention(q, k, v, mask, temperature, dropout), None

    def use_fused(self, device: torch.device) -> bool:
        """The fused kernel where it is faster: on CUDA. On CPU, at translation
        lengths, the explicit path is the faster (docs/performance.md)."""
        return self.impl == "fused" or (self.impl == "auto" and device.type == "cuda")


def keyless_rows_see_all(mask: Tensor) -> tuple[Tensor, Tensor]:
    """The rule for a query row with nothing to attend to, which would be softmax(all
    -inf) = NaN: it sees every key (any finite values would do) and is zeroed after.
    mask (..., T_q, T_k) -> the mask to apply, and ``has_key`` (..., T_q, 1) to multiply
    the weights or outputs by. Every attention path of mt follows it through here."""
    has_key = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
    return mask | ~has_key, has_key


def fused_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, temperature: float = 1.0, dropout: float = 0.0
) -> Tensor:
    """``scaled_dot_product_attention``'s output through PyTorch's fused kernel (no weights),
    with the same rule for a query row that has no key: zeros."""
    has_key = None
    if mask is not None:
        mask, has_key = keyless_rows_see_all(mask)
    scale = 1.0 / (math.sqrt(q.size(-1)) * temperature)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out if has_key is None else out * has_key
