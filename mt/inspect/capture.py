"""Look inside a trained model: every layer's attention weights for one
sentence pair, per-head statistics and word-piece alignments.

Shapes: H heads; T_s source tokens (pieces + </s>); T_t target rows, one per
predicted token (pieces + </s>). Decoder rows at position t read the inputs
<s> y_1 ... y_t and predict y_{t+1}; rows are labelled with what they predict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mt.data.tokenizer import Tokenizer
from mt.model.masks import causal_mask
from mt.model.transformer import DecoderCache, Transformer

KINDS = ("encoder", "decoder", "cross")
#: what each kind of attention is called in titles and texts
KIND_NAMES = {"encoder": "encoder self-attention", "decoder": "decoder self-attention", "cross": "cross-attention"}


@dataclass
class AttentionMaps:
    src_tokens: list[str]  # T_s source pieces, </s> last
    tgt_inputs: list[str]  # T_t decoder inputs: <s> y_1 ... y_n
    tgt_outputs: list[str]  # T_t predicted tokens: y_1 ... y_n </s>
    encoder: list[Tensor]  # per layer (H, T_s, T_s)
    decoder: list[Tensor]  # per layer (H, T_t, T_t)
    cross: list[Tensor]  # per layer (H, T_t, T_s)

    def layers(self, kind: str) -> list[Tensor]:
        return getattr(self, kind)

    def axes(self, kind: str) -> tuple[list[str], list[str]]:
        """(row labels, column labels) of one kind's maps."""
        return {
            "encoder": (self.src_tokens, self.src_tokens),
            "decoder": (self.tgt_outputs, self.tgt_inputs),
            "cross": (self.tgt_outputs, self.src_tokens),
        }[kind]

    def mask(self, kind: str) -> Tensor:
        """Allowed keys of one kind, (1, 1, T_q, T_k)."""
        rows, cols = self.axes(kind)
        if kind == "decoder":
            return causal_mask(len(rows))
        return torch.ones(1, 1, len(rows), len(cols), dtype=torch.bool)


@torch.no_grad()
def force_decode(
    model: Transformer, tok: Tokenizer, src_ids: list[int], tgt_ids: list[int], temperature: float = 1.0
) -> AttentionMaps:
    """Every layer's weights (explicit path) for ``src_ids`` -> ``tgt_ids``
    (source with its EOS; target without bos/eos)."""
    src = torch.tensor([src_ids])
    tgt_in = torch.tensor([[tok.bos_id, *tgt_ids]])
    enc = model.encode(src, need_weights=True, temperature=temperature)
    dec = model.decode(tgt_in, enc, need_weights=True, temperature=temperature)
    return AttentionMaps(
        src_tokens=tok.src_pieces(src_ids),
        tgt_inputs=tok.tgt_pieces([tok.bos_id, *tgt_ids]),
        tgt_outputs=tok.tgt_pieces([*tgt_ids, tok.eos_id]),
        encoder=[w[0] for w in enc.weights],
        decoder=[w[0] for w in dec.self_weights],
        cross=[w[0] for w in dec.cross_weights],
    )


@torch.no_grad()
def translate_with_attention(
    model: Transformer, tok: Tokenizer, src_ids: list[int], max_len: int, temperature: float = 1.0
) -> tuple[list[int], list[Tensor]]:
    """Greedy translation that keeps the cross-attention weights of each step.
    Returns (target ids without bos/eos, per layer (H, T_t, T_s))."""
    src = torch.tensor([src_ids])
    enc = model.encode(src, temperature=temperature)
    cache, token, out = DecoderCache(), torch.tensor([[tok.bos_id]]), []
    steps: list[list[Tensor]] = []
    for step in range(max_len):
        dec = model.decode(token, enc, cache, need_weights=True, temperature=temperature)
        cache = dec.cache
        steps.append([w[0] for w in dec.cross_weights])  # per layer (H, 1, T_s)
        logits = dec.logits[0, -1]
        logits[[tok.pad_id, tok.bos_id]] = float("-inf")
        nxt = tok.eos_id if step == max_len - 1 else int(logits.argmax())
        if nxt == tok.eos_id:
            break
        out.append(nxt)
        token = torch.tensor([[nxt]])
    cross = [torch.cat([s[layer] for s in steps], dim=1) for layer in range(len(steps[0]))]
    return out, cross


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


def head_table(maps: AttentionMaps, kind: str, eos_piece: str = "</s>") -> list[dict]:
    """The debugging table for one kind: a row per (layer, head)."""
    rows_out = []
    row_labels, col_labels = maps.axes(kind)
    mask = maps.mask(kind)
    t_q, t_k = len(row_labels), len(col_labels)
    q_pos, k_pos = torch.arange(t_q)[:, None], torch.arange(t_k)[None, :]
    same, prev = k_pos == q_pos, k_pos == q_pos - 1  # (T_q, T_k)
    eos = torch.tensor([c == eos_piece for c in col_labels])
    for layer, w in enumerate(maps.layers(kind)):
        stats = attention_stats(w[None], mask)  # (H,) each
        for h in range(w.size(0)):
            wh = w[h].float()
            entry = {
                "kind": kind,
                "layer": layer,
                "head": h,
                "entropy": float(stats["entropy"][h]),
                "norm_entropy": float(stats["norm_entropy"][h]),
                "max_weight": float(stats["weight_max"][h]),
                # position shares only where rows and keys are the same sequence
                "same": float((wh * same).sum(-1).mean()) if kind != "cross" else None,
                "previous": float((wh * prev).sum(-1).mean()) if kind != "cross" else None,
                "eos": float(wh[:, eos].sum(-1).mean()) if eos.any() else None,
                "nan_rows": int(stats["nan_rows"][h]),
                "zero_rows": int(stats["zero_rows"][h]),
            }
            entry["flag"] = _flag(entry)
            rows_out.append(entry)
    return rows_out


def _flag(entry: dict) -> str:
    if entry["nan_rows"]:
        return "NaN rows"
    if entry["norm_entropy"] > 0.9:
        return "near-uniform"
    if entry["max_weight"] > 0.95:
        return "collapsed on one key"
    return ""


def format_table(rows: list[dict]) -> str:
    def f(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"{'kind':<8}{'layer':>6}{'head':>5}{'entropy':>9}{'norm':>6}{'max':>6}"
        f"{'same':>6}{'prev':>6}{'eos':>6}{'NaN':>5}{'zero':>5}  flag"
    ]
    for r in rows:
        lines.append(
            f"{r['kind']:<8}{r['layer']:>6}{r['head']:>5}{r['entropy']:>9.3f}{f(r['norm_entropy']):>6}"
            f"{f(r['max_weight']):>6}{f(r['same']):>6}{f(r['previous']):>6}{f(r['eos']):>6}"
            f"{r['nan_rows']:>5}{r['zero_rows']:>5}  {r['flag']}"
        )
    return "\n".join(lines)


def alignment(maps: AttentionMaps, layer: int) -> list[tuple[int, int]]:
    """Hard word-piece alignment from one layer's cross-attention, heads averaged:
    each target piece (not the final </s>) to its most-attended source piece
    (not the source </s>). Pairs are (source index, target index)."""
    w = maps.cross[layer].float().mean(0)  # (T_t, T_s)
    w = w[:-1, :-1]  # drop the </s> row and column
    if w.numel() == 0:
        return []
    return [(int(j), i) for i, j in enumerate(w.argmax(-1).tolist())]


def pharaoh(pairs: list[tuple[int, int]]) -> str:
    """Pharaoh format, as fairseq's --print-alignment: 'src-tgt' pairs."""
    return " ".join(f"{s}-{t}" for s, t in pairs)
