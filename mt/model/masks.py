"""Attention masks, built here and nowhere else.

One convention for the whole project: a mask is a boolean tensor that
broadcasts to the attention scores (B, H, T_q, T_k), and ``True`` means
"this query may attend to this key". A query row whose mask is all
``False`` has nothing to attend to; the attention core turns it into zeros.
"""

from __future__ import annotations

import torch
from torch import Tensor


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """Keys that are real tokens. tokens: (B, T_k) -> mask (B, 1, 1, T_k)."""
    return (tokens != pad_id)[:, None, None, :]


def lengths_mask(lengths: Tensor, max_len: int) -> Tensor:
    """Keys inside each sequence's length. lengths: (B,) -> mask (B, 1, 1, max_len)."""
    positions = torch.arange(max_len, device=lengths.device)  # (T_k,)
    return (positions[None, :] < lengths[:, None])[:, None, None, :]


def causal_mask(t_q: int, t_k: int | None = None, device: torch.device | None = None) -> Tensor:
    """Each query sees keys at its own position and before. -> mask (1, 1, T_q, T_k).

    With ``t_k > t_q`` the queries are the last ``t_q`` positions of a sequence
    of length ``t_k`` (incremental decoding with ``t_k - t_q`` cached keys).
    """
    t_k = t_q if t_k is None else t_k
    offset = t_k - t_q
    q_pos = torch.arange(t_q, device=device)[:, None] + offset  # (T_q, 1)
    k_pos = torch.arange(t_k, device=device)[None, :]  # (1, T_k)
    return (k_pos <= q_pos)[None, None, :, :]
