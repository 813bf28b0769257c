"""The encoder-decoder Transformer (Vaswani et al., 2017), pre-LN by default.

Shapes: B batch, T_s source length, T_t target length, D model width,
V vocabulary size, H heads. Token tensors are (B, T) of ids, padded with
``cfg.pad_id`` on the right.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt.config import ModelConfig
from mt.model.layers import DecoderLayer, EncoderLayer, LayerCache, PositionalEncoding
from mt.model.masks import causal_mask, padding_mask


class EncoderOutput(NamedTuple):
    memory: Tensor  # (B, T_s, D)
    src_mask: Tensor  # (B, 1, 1, T_s)
    weights: list[Tensor] | None  # per layer (B, H, T_s, T_s), when asked for

    def index_select(self, index: Tensor) -> EncoderOutput:
        """Pick batch rows (e.g. repeat each source for its beams)."""
        return EncoderOutput(self.memory.index_select(0, index), self.src_mask.index_select(0, index), None)


@dataclass
class DecoderCache:
    """Keys/values of every decoder layer, for step-by-step decoding.

    Starts empty; each ``Transformer.decode`` call returns the grown cache.
    ``reorder`` follows beam search's choice of hypotheses. The source's
    keys/values may have fewer rows than the target's (a source shared by its
    beams, see ``mt.model.attention.MultiHeadAttention``): they are left as they
    are unless ``source_index`` picks source rows too (to drop finished sentences).
    """

    layers: list[LayerCache] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Target positions decoded so far."""
        if not self.layers or self.layers[0].self_kv is None:
            return 0
        return self.layers[0].self_kv.k.size(2)

    def positions(self) -> int | Tensor:
        """The position of the next target token: the cache's length."""
        return self.length

    def self_mask(self, t_new: int, device: torch.device) -> Tensor | None:
        """What ``t_new`` new positions may attend to: every cached one and, among
        themselves, their own past (None: everything, as for one new position)."""
        return None if t_new == 1 else causal_mask(t_new, self.length + t_new, device)  # (1, 1, T_t, T_k)

    def reorder(self, index: Tensor, source_index: Tensor | None = None) -> DecoderCache:
        """index: the target rows to keep, in their new order; source_index:
        the source rows to keep (default: all, unchanged)."""

        def pick(kv, rows):
            return kv if kv is None or rows is None else kv.select(rows)

        layers = [LayerCache(pick(c.self_kv, index), pick(c.cross_kv, source_index)) for c in self.layers]
        return dataclasses.replace(self, layers=layers)


class DecoderOutput(NamedTuple):
    logits: Tensor  # (B, T_t, V)
    cache: DecoderCache | None
    self_weights: list[Tensor] | None  # per layer (B, H, T_t, T_k)
    cross_weights: list[Tensor] | None  # per layer (B, H, T_t, T_s)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.src_vocab_size <= 0 or cfg.tgt_vocab_size <= 0:
            raise ValueError("model.src_vocab_size and model.tgt_vocab_size must come from the tokenizer (> 0)")
        self.cfg = cfg
        d = cfg.d_model
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, d, padding_idx=cfg.pad_id)
        if cfg.share_embeddings:
            self.src_embed = self.tgt_embed
        else:
            self.src_embed = nn.Embedding(cfg.src_vocab_size, d, padding_idx=cfg.pad_id)
        for emb in {self.src_embed, self.tgt_embed}:
            nn.init.normal_(emb.weight, std=d**-0.5)  # unit variance after the sqrt(D) scale
            nn.init.zeros_(emb.weight[cfg.pad_id])
        self.src_pos = PositionalEncoding(cfg)
        self.tgt_pos = self.src_pos if cfg.positional == "sinusoidal" else PositionalEncoding(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        # Pre-LN leaves the residual stream un-normalised: one final norm per stack.
        self.enc_norm = nn.LayerNorm(d) if cfg.norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(d) if cfg.norm_first else nn.Identity()
        self.output = None if cfg.tie_output else nn.Linear(d, cfg.tgt_vocab_size, bias=False)
        if self.output is not None:
            nn.init.xavier_uniform_(self.output.weight)
        self.embed_scale = math.sqrt(d)

    def num_parameters(self) -> int:
        """Trainable parameters, each shared tensor counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def encode(self, src: Tensor, need_weights: bool = False, temperature: float = 1.0) -> EncoderOutput:
        """src: (B, T_s) token ids -> memory (B, T_s, D)."""
        src_mask = padding_mask(src, self.cfg.pad_id)  # (B, 1, 1, T_s)
        x = self.dropout(self.src_pos(self.src_embed(src) * self.embed_scale))  # (B, T_s, D)
        weights = [] if need_weights else None
        for layer in self.encoder:
            x, w = layer(x, src_mask, need_weights, temperature)
            if need_weights:
                weights.append(w)
        return EncoderOutput(self.enc_norm(x), src_mask, weights)

    def source_cache(self, enc: EncoderOutput) -> DecoderCache:
        """The cache before the first step: every decoder layer's keys/values of
        the source (what the first cached ``decode`` would project), no target positions."""
        return DecoderCache([LayerCache(None, layer.cross_attn.project_kv(enc.memory)) for layer in self.decoder])

    def decode(
        self,
        tgt: Tensor,
        enc: EncoderOutput,
        cache: DecoderCache | None = None,
        need_weights: bool = False,
        temperature: float = 1.0,
    ) -> DecoderOutput:
        """tgt: (B, T_t) target ids -> logits (B, T_t, V).

        Without a cache, ``tgt`` is the whole (shifted) target prefix. With a
        cache (start with ``DecoderCache()``), ``tgt`` holds only the new
        positions; the returned cache covers all positions so far.
        """
        out = self._decoder_stack(tgt, enc, cache, need_weights, temperature)
        return out._replace(logits=self.project(out.logits))

    def _decoder_stack(
        self, tgt: Tensor, enc: EncoderOutput, cache: DecoderCache | None, need_weights: bool, temperature: float
    ) -> DecoderOutput:
        """decode() up to the final layer norm: DecoderOutput with states (B, T_t, D) in place of logits."""
        t_new = tgt.size(1)
        if cache is None:  # teacher forcing: the whole target at once, each position seeing its past
            positions, self_mask = 0, causal_mask(t_new, device=tgt.device) if t_new > 1 else None  # (1, 1, T_t, T_t)
        else:
            positions, self_mask = cache.positions(), cache.self_mask(t_new, tgt.device)
        x = self.dropout(self.tgt_pos(self.tgt_embed(tgt) * self.embed_scale, positions))  # (B, T_t, D)
        layer_caches = cache.layers if cache is not None and cache.layers else [None] * len(self.decoder)
        new_caches = []
        self_w = [] if need_weights else None
        cross_w = [] if need_weights else None
        for layer, layer_cache in zip(self.decoder, layer_caches):
            out = layer(x, enc.memory, self_mask, enc.src_mask, layer_cache, need_weights, temperature)
            x = out.x
            new_caches.append(out.cache)
            if need_weights:
                self_w.append(out.self_weights)
                cross_w.append(out.cross_weights)
        new_cache = dataclasses.replace(cache, layers=new_caches) if cache is not None else None
        return DecoderOutput(self.dec_norm(x), new_cache, self_w, cross_w)

    @property
    def output_weight(self) -> Tensor:
        """The output projection (V, D): the target embedding when tied."""
        return self.tgt_embed.weight if self.output is None else self.output.weight

    def project(self, states: Tensor) -> Tensor:
        """Decoder states (B, T_t, D) -> logits (B, T_t, V)."""
        return F.linear(states, self.output_weight)

    def hidden(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing up to the output projection: (B, T_t, D). Training
        fuses the projection with the loss (``mt.train.loss``)."""
        return self._decoder_stack(tgt_in, self.encode(src), None, False, 1.0).logits

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing: src (B, T_s), tgt_in (B, T_t) = bos + target -> logits (B, T_t, V)."""
        return self.project(self.hidden(src, tgt_in))
