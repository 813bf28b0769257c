"""Transformer building blocks: positions, feed-forward, encoder and decoder layers.

Shapes: B batch, T_s source length, T_t target length (new positions when
decoding with a cache), D model width. Masks as in ``mt.model.masks``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt.config import ModelConfig
from mt.model.attention import KV, MultiHeadAttention


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(...). -> (n_positions, D)"""
    position = torch.arange(n_positions, dtype=torch.float32)[:, None]  # (P, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_positions, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table


class PositionalEncoding(nn.Module):
    """Adds sinusoidal (fixed) or learned position vectors to (B, T, D) inputs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.max_positions = cfg.max_positions
        if cfg.positional == "learned":
            self.table = nn.Parameter(torch.randn(cfg.max_positions, cfg.d_model) * cfg.d_model**-0.5)
        else:
            self.register_buffer("table", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)

    def forward(self, x: Tensor, start: int | Tensor = 0) -> Tensor:
        """x: (B, T, D) at positions start .. start + T - 1; ``start`` is one
        number, or one per row (B,) when rows are at different positions."""
        if isinstance(start, Tensor):
            positions = start[:, None] + torch.arange(x.size(1), device=x.device)  # (B, T)
            end = int(positions.max()) + 1
        else:
            end = start + x.size(1)
        if end > self.max_positions:
            raise ValueError(f"sequence of {end} positions exceeds model.max_positions={self.max_positions}")
        if isinstance(start, Tensor):
            return x + self.table[positions].to(x.dtype)  # (B, T, D) + (B, T, D)
        return x + self.table[start:end].to(x.dtype)  # (B, T, D) + (T, D)


class FeedForward(nn.Module):
    """w_2(dropout(activation(w_1 x))): (B, T, D) -> (B, T, D) through a (B, T, d_ff) hidden layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w_2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.activation = F.relu if cfg.activation == "relu" else F.gelu
        self.dropout = nn.Dropout(cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout)
        for layer in (self.w_1, self.w_2):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.dropout(self.activation(self.w_1(x))))  # (B, T, D)


class Sublayer(nn.Module):
    """Residual connection around a sublayer, with pre- or post-layer-norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.norm_first = cfg.norm_first

    def pre(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm_first else x

    def post(self, x: Tensor, residual: Tensor) -> Tensor:
        x = residual + self.dropout(x)
        return x if self.norm_first else self.norm(x)


class EncoderLayerOutput(NamedTuple):
    x: Tensor  # (B, T_s, D)
    weights: Tensor | None  # (B, H, T_s, T_s)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout, cfg.attention_impl)
        self.ffn = FeedForward(cfg)
        self.attn_sub = Sublayer(cfg)
        self.ffn_sub = Sublayer(cfg)

    def forward(
        self, x: Tensor, mask: Tensor, need_weights: bool = False, temperature: float = 1.0
    ) -> EncoderLayerOutput:
        h = self.attn_sub.pre(x)
        attn = self.self_attn(h, h, mask, need_weights=need_weights, temperature=temperature)
        x = self.attn_sub.post(attn.output, x)
        x = self.ffn_sub.post(self.ffn(self.ffn_sub.pre(x)), x)
        return EncoderLayerOutput(x, attn.weights)


class LayerCache(NamedTuple):
    """One decoder layer's cached keys/values: its own past positions and the source."""

    self_kv: KV | None
    cross_kv: KV | None


class DecoderLayerOutput(NamedTuple):
    x: Tensor  # (B, T_t, D)
    cache: LayerCache
    self_weights: Tensor | None  # (B, H, T_t, T_past + T_t)
    cross_weights: Tensor | None  # (B, H, T_t, T_s)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        impl = cfg.attention_impl
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout, impl)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout, impl)
        self.ffn = FeedForward(cfg)
        self.self_sub = Sublayer(cfg)
        self.cross_sub = Sublayer(cfg)
        self.ffn_sub = Sublayer(cfg)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        self_mask: Tensor | None,
        cross_mask: Tensor,
        cache: LayerCache | None = None,
        need_weights: bool = False,
        temperature: float = 1.0,
    ) -> DecoderLayerOutput:
        """x: (B, T_t, D) new target positions; memory: (B, T_s, D) encoder output.
        With a cache, the self-attention keys grow by T_t and the source's keys
        and values are projected on the first call only."""
        past_self = cache.self_kv if cache is not None else None
        past_cross = cache.cross_kv if cache is not None else None

        h = self.self_sub.pre(x)
        self_attn = self.self_attn(h, h, self_mask, past=past_self, need_weights=need_weights, temperature=temperature)
        x = self.self_sub.post(self_attn.output, x)

        h = self.cross_sub.pre(x)
        source = memory if past_cross is None else None  # project the source once
        cross = self.cross_attn(
            h, source, cross_mask, past=past_cross, need_weights=need_weights, temperature=temperature
        )
        x = self.cross_sub.post(cross.output, x)

        x = self.ffn_sub.post(self.ffn(self.ffn_sub.pre(x)), x)
        return DecoderLayerOutput(x, LayerCache(self_attn.kv, cross.kv), self_attn.weights, cross.weights)
