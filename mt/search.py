"""Batched greedy and beam search over ``Transformer.encode``/``decode``.

Both reuse the model's key/value cache: the source's cross-attention keys
and values are projected once, decoder self-attention keys/values grow by one
position per step, and beam search reorders the cache with one
``index_select`` per tensor. A hypothesis never contains pad or bos, and each
sentence stops at its own EOS or at ``max_len_a * source_length + max_len_b``
generated tokens (EOS included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mt.model import DecoderCache, Transformer


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, without bos and eos
    score: float  # sum of token log-probabilities (eos included) / length ** alpha
    log_prob: float  # sum of token log-probabilities, eos included


@dataclass
class SearchSettings:
    bos_id: int
    eos_id: int
    pad_id: int
    max_len_a: float = 1.5
    max_len_b: int = 10
    min_len: int = 1  #: fewest tokens to generate, eos included (benchmarks force a fixed length)


def max_lengths(src: Tensor, s: SearchSettings, max_positions: int) -> Tensor:
    """Per sentence, the most tokens to generate (eos included). src: (B, T_s) -> (B,)"""
    src_len = (src != s.pad_id).sum(1)
    limit = (s.max_len_a * src_len.float() + s.max_len_b).long()
    return limit.clamp(1, max_positions - 1)  # bos takes a position too


def _step_log_probs(logits: Tensor, s: SearchSettings, step: int, force_eos: Tensor) -> Tensor:
    """logits: (N, V) -> log-probabilities (N, V) that never pick pad or bos,
    nor eos before ``s.min_len`` tokens, and only eos in rows where ``force_eos`` (N,) is set."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    logp[:, s.pad_id] = float("-inf")
    logp[:, s.bos_id] = float("-inf")
    if step + 1 < s.min_len:
        logp[:, s.eos_id] = float("-inf")
    if force_eos.any():
        eos_col = logp[:, s.eos_id].clone()
        logp[force_eos] = float("-inf")
        logp[force_eos, s.eos_id] = eos_col[force_eos]
    return logp


@torch.no_grad()
def greedy_search(model: Transformer, src: Tensor, s: SearchSettings, alpha: float = 1.0) -> list[Hypothesis]:
    """src: (B, T_s) -> per sentence its most probable next token at each step,
    scored like beam search (log-probability / length ** alpha)."""
    b = src.size(0)
    enc = model.encode(src)
    limits = max_lengths(src, s, model.cfg.max_positions)
    tokens = torch.full((b, 1), s.bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(b, dtype=torch.bool, device=src.device)
    log_prob = torch.zeros(b, device=src.device)
    length = torch.zeros(b, device=src.device)
    cache = DecoderCache()
    outputs: list[Tensor] = []
    for step in range(int(limits.max())):
        dec = model.decode(tokens, enc, cache)
        cache = dec.cache
        logp = _step_log_probs(dec.logits[:, -1], s, step, limits <= step + 1)
        best, tokens = logp.max(-1, keepdim=True)  # (B, 1)
        tokens = tokens.masked_fill(finished[:, None], s.pad_id)
        log_prob += best[:, 0].masked_fill(finished, 0.0)
        length += (~finished).float()
        outputs.append(tokens)
        finished |= tokens[:, 0] == s.eos_id
        if finished.all():
            break
    out = torch.cat(outputs, 1).tolist()
    scores = (log_prob / length**alpha).tolist()
    return [Hypothesis(_strip(row, s), score, lp) for row, score, lp in zip(out, scores, log_prob.tolist())]


def _strip(ids: list[int], s: SearchSettings) -> list[int]:
    return ids[: ids.index(s.eos_id)] if s.eos_id in ids else [i for i in ids if i != s.pad_id]


@torch.no_grad()
def beam_search(
    model: Transformer, src: Tensor, s: SearchSettings, beam: int = 5, alpha: float = 1.0, n_best: int = 1
) -> list[list[Hypothesis]]:
    """src: (B, T_s) -> per sentence, its ``n_best`` hypotheses, best first.

    Each step scores ``beam * V`` continuations per sentence and keeps the
    best ``2 * beam``: those ending in EOS among the top ``beam`` are
    finished (score divided by length ** alpha), the best ``beam`` others
    continue. A sentence is done once it has ``beam`` finished hypotheses.
    """
    b, k, dev = src.size(0), beam, src.device
    if not 1 <= n_best <= beam:
        raise ValueError(f"n_best must be between 1 and the beam size {beam}")
    enc = model.encode(src).index_select(torch.arange(b, device=dev).repeat_interleave(k))  # B*K rows
    limits = max_lengths(src, s, model.cfg.max_positions).repeat_interleave(k)  # (B*K,)
    tokens = torch.full((b * k, 1), s.bos_id, dtype=torch.long, device=dev)  # (B*K, 1 + step)
    scores = torch.full((b, k), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    cache = DecoderCache()
    base = torch.arange(b, device=dev)[:, None] * k  # (B, 1) first row of each sentence
    for step in range(int(limits.max())):
        dec = model.decode(tokens[:, -1:], enc, cache)
        logp = _step_log_probs(dec.logits[:, -1], s, step, limits <= step + 1)  # (B*K, V)
        vocab = logp.size(-1)
        cand = (scores.view(-1, 1) + logp).view(b, k * vocab)  # (B, K*V)
        top_scores, top_idx = cand.topk(2 * k, dim=1)  # (B, 2K)
        top_beam, top_tok = top_idx // vocab, top_idx % vocab
        is_eos = top_tok == s.eos_id

        new_final = is_eos[:, :k] & torch.isfinite(top_scores[:, :k]) & ~done[:, None]
        if new_final.any():
            penalty = float(step + 1) ** alpha
            for i, j in new_final.nonzero().tolist():
                row = int(base[i, 0] + top_beam[i, j])
                lp = float(top_scores[i, j])
                if len(finished[i]) < k:
                    finished[i].append(Hypothesis(tokens[row, 1:].tolist(), lp / penalty, lp))
            done |= torch.tensor([len(f) >= k for f in finished], device=dev)
        if done.all():
            break

        # the best `beam` continuations that do not end here
        next_scores, pos = top_scores.masked_fill(is_eos, float("-inf")).topk(k, dim=1)  # (B, K)
        rows = (base + top_beam.gather(1, pos)).view(-1)  # (B*K,)
        tokens = torch.cat([tokens[rows], top_tok.gather(1, pos).view(-1, 1)], dim=1)
        cache = dec.cache.reorder(rows)
        scores = next_scores.masked_fill(done[:, None], float("-inf"))
    return [sorted(f, key=lambda h: -h.score)[:n_best] for f in finished]
