"""Batched greedy and beam search over ``Transformer.encode``/``decode``.

Both reuse the model's key/value cache: the source's cross-attention keys
and values are projected once, decoder self-attention keys/values grow by one
position per step, and beam search reorders the cache by row index (the
next step carries the reorder out as it appends). A hypothesis never
contains pad or bos, and each sentence stops at its own EOS or at
``max_len_a * source_length + max_len_b`` generated tokens (EOS included);
finished sentences leave the batch. No hypothesis repeats an n-gram more
times in a row than its source allows, and a loop past the source's length
ends the hypothesis (``loop_guard``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mt.config import DECODING
from mt.decode.fastpath import arg_max, top_k
from mt.model.transformer import DecoderCache, Transformer


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
    max_len_a: float = DECODING.max_len_a
    max_len_b: int = DECODING.max_len_b
    loop_ngram: int = DECODING.loop_ngram
    loop_margin: int | None = DECODING.loop_margin  # None: no loop guard


def repeat_runs(ids: Tensor, max_n: int, pad_id: int) -> Tensor:
    """(R, L) token ids -> (R, L): at each position, the most copies of an n-gram
    (1 <= n <= max_n) that come in a row and end there; 1 where none repeats.
    Pad ids never count as a repeat.

    A run of c copies of an n-gram is a stretch after its first copy where each
    token equals the one n before it, (c - 1) * n tokens long."""
    best = torch.ones_like(ids)
    for n in range(1, min(max_n, ids.size(1) // 2) + 1):
        same = (ids[:, n:] == ids[:, :-n]) & (ids[:, n:] != pad_id)  # (R, L - n): token t + n is token t
        at = torch.arange(same.size(1), device=ids.device).expand_as(same)
        run = at - torch.where(same, -1, at).cummax(1).values  # distance to where the run last broke
        best[:, n:] = torch.maximum(best[:, n:], 1 + run // n)
    return best


def loop_allowance(src: Tensor, s: SearchSettings) -> Tensor | None:
    """src: (B, T_s) -> (B,) the most copies of an n-gram in a row each sentence's output
    may hold (``loop_guard``); None without a loop guard."""
    if s.loop_margin is None:
        return None
    return repeat_runs(src, s.loop_ngram, s.pad_id).max(1).values + s.loop_margin


def loop_guard(
    history: Tensor, allowed: Tensor | None, full: Tensor, s: SearchSettings
) -> tuple[tuple[Tensor, Tensor] | None, Tensor | None]:
    """The loop guard, for one step. history: (R, L) each row's generated tokens, the
    newest last (pad and bos may come before a row's first: they end any run);
    allowed: (R,) (``loop_allowance``); full: (R,) True where the row's output is
    already as long as its source (in pieces).

    A row whose next token could continue a run of copies of an n-gram past
    ``allowed`` (the token n back, for each n) may not take that token while it is
    shorter than its source: a model that stutters ("Salalalalal") goes on with the
    rest of its sentence, as it often does. Once it is as long as its source, it
    takes EOS instead: a loop with nothing left to translate. -> (banned, end):
    (rows, tokens) those rows may not take, or None; (R,) rows that must end, or None.
    """
    if allowed is None or history.size(1) < int(allowed.min()):
        return None, None  # too few tokens for any row's next one to go past its allowance
    window = history[:, -min(history.size(1), (int(allowed.max()) + 1) * s.loop_ngram) :]  # (R, L)
    max_n = min(s.loop_ngram, window.size(1))
    # every n at once: earlier[:, n - 1, t] is the token n before t (pad before the window)
    padded = F.pad(window, (max_n, 0), value=s.pad_id)
    earlier = torch.stack([padded[:, max_n - n : padded.size(1) - n] for n in range(1, max_n + 1)], 1)
    same = (earlier == window[:, None]) & (window[:, None] != s.pad_id)  # (R, max_n, L)
    run = same.flip(2).cumprod(2).sum(2)  # (R, max_n): at the end of each row
    n = torch.arange(1, max_n + 1, device=window.device)
    over = 1 + (run + 1) // n > allowed[:, None]  # the copies if the run went on one more token
    rows, which = over.nonzero().unbind(1)
    tokens = window[rows, -1 - which]  # the token n back continues the run
    ending = full[rows]
    end = torch.zeros_like(full)
    end[rows[ending]] = True
    return (rows[~ending], tokens[~ending]), end


def max_lengths(src: Tensor, s: SearchSettings, max_positions: int, prefix: Tensor | None = None) -> Tensor:
    """Per sentence, the most tokens to generate (eos included): room for its prefix
    and at least one token after it. src: (B, T_s) -> (B,)"""
    src_len = (src != s.pad_id).sum(1)
    limit = (s.max_len_a * src_len.float() + s.max_len_b).long()
    if prefix is not None:
        limit = torch.maximum(limit, (prefix >= 0).sum(1) + 1)
    return limit.clamp(1, max_positions - 1)  # bos takes a position too


def step_log_probs(
    logits: Tensor,
    s: SearchSettings,
    force_eos: Tensor,
    forced: Tensor | None = None,
    banned: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """logits: (N, V) -> log-probabilities (N, V) that never pick pad or bos, and only
    eos in rows where ``force_eos`` (N,) is set (at their length limit).
    ``forced`` (N,): a token id that row must take (a prefix), or -1.
    ``banned``: (rows, tokens) those rows may not take (``loop_guard``); a prefix's
    token is taken all the same."""
    logits = logits.float()
    # in place where possible: (rows, vocabulary) temporaries are a step's largest
    # allocations, and on CPU each fresh one is paid in page faults
    logp = torch.log_softmax(logits, dim=-1, out=logits if logits.is_contiguous() else None)
    logp[:, s.pad_id] = float("-inf")
    logp[:, s.bos_id] = float("-inf")
    if banned is not None:
        rows, tokens = banned
        if forced is not None:  # inside its prefix, a row takes the prefix's token whatever it repeats
            free = forced[rows] < 0
            rows, tokens = rows[free], tokens[free]
        logp[rows, tokens] = float("-inf")
    if forced is not None:  # a prefix's token wins over the loop guard's EOS too
        force_eos = force_eos & (forced < 0)
    if force_eos.any():
        eos_col = logp[:, s.eos_id].clone()
        logp[force_eos] = float("-inf")
        logp[force_eos, s.eos_id] = eos_col[force_eos]
    if forced is not None and (forced >= 0).any():
        rows = (forced >= 0).nonzero()[:, 0]
        kept = logp[rows, forced[rows]]  # the prefix token keeps its log-probability: it counts in the score
        logp[rows] = float("-inf")
        logp[rows, forced[rows]] = kept
    return logp


def prefix_tensor(prefixes: list[list[int]] | None, b: int, device) -> Tensor | None:
    """Per sentence the tokens its output must start with -> (B, P), padded with -1; None if none has any."""
    if not prefixes or not any(prefixes):
        return None
    if len(prefixes) != b:
        raise ValueError(f"{len(prefixes)} prefixes for {b} sentences")
    out = torch.full((b, max(len(p) for p in prefixes)), -1, dtype=torch.long)
    for i, p in enumerate(prefixes):
        out[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return out.to(device)


def _forced(prefix: Tensor | None, rows: Tensor, step: int) -> Tensor | None:
    """The token each of ``rows`` (sentence indices) must take at ``step``, or -1."""
    if prefix is None or step >= prefix.size(1):
        return None
    return prefix[rows, step]


class BeamStep(NamedTuple):
    """What one beam search step decided, per sentence (N of them, W live rows each)."""

    finished: list[tuple[int, int, float]]  # (sentence, row it extends, log-probability) of each new EOS ending
    rows: Tensor  # (N, W') the row each continuing hypothesis extends
    tokens: Tensor  # (N, W') its new token
    scores: Tensor  # (N, W') its log-probability so far


def beam_step(logp: Tensor, scores: Tensor, beam: int, eos_id: int) -> BeamStep:
    """One step of beam search, the same for every search that runs one.

    logp: (N*W, V) next-token log-probabilities of each row (``step_log_probs``);
    scores: (N, W) each row's log-probability so far (-inf for a row not in use).
    Of a sentence's W x V continuations the best ``2 * beam`` are ranked: those
    that end in EOS among the top ``beam`` finish here, and the best ``beam``
    of the others continue. The 2 * beam best of a sentence are among the 2 *
    beam best of each of its rows, so only those are ranked (``top_k``).
    """
    n, width = scores.shape
    logp, tok = top_k(logp, min(2 * beam, logp.size(1)))  # (N*W, K)
    per_row = tok.size(1)
    cand = (logp + scores.view(-1, 1)).view(n, width * per_row)
    top_scores, top_idx = cand.topk(min(2 * beam, width * per_row), dim=1)  # (N, C)
    top_row = torch.arange(n, device=logp.device)[:, None] * width + top_idx // per_row  # (N, C) rows of tokens
    top_tok = tok.view(n, width * per_row).gather(1, top_idx)
    is_eos = top_tok == eos_id
    new_final = (is_eos[:, :beam] & torch.isfinite(top_scores[:, :beam])).nonzero()  # (F, 2): sentence, rank
    finished = list(zip(new_final[:, 0].tolist(), top_row[new_final[:, 0], new_final[:, 1]].tolist(),
                        top_scores[new_final[:, 0], new_final[:, 1]].tolist()))  # fmt: skip
    next_scores, pos = top_scores.masked_fill(is_eos, float("-inf")).topk(min(beam, top_idx.size(1)), dim=1)
    return BeamStep(finished, top_row.gather(1, pos), top_tok.gather(1, pos), next_scores)


@torch.inference_mode()
def greedy_search(
    model: Transformer, src: Tensor, s: SearchSettings, alpha: float = 1.0, prefixes: list[list[int]] | None = None
) -> list[Hypothesis]:
    """src: (B, T_s) -> per sentence its most probable next token at each step,
    scored like beam search (log-probability / length ** alpha). Finished
    sentences leave the batch once they are a quarter of its rows (each
    removal copies the cache, so not one at a time). ``prefixes[i]``: tokens
    sentence i's output starts with; the search continues from them."""
    b, dev = src.size(0), src.device
    enc = model.encode(src)
    prefix = prefix_tensor(prefixes, b, dev)
    limits = max_lengths(src, s, model.cfg.max_positions, prefix)
    allowed = loop_allowance(src, s)
    src_len = (src != s.pad_id).sum(1) - 1  # pieces, without the EOS
    span = 0 if allowed is None else (int(allowed.max()) + 1) * s.loop_ngram
    n_steps = int(limits.max())
    out = torch.full((b, n_steps), s.pad_id, dtype=torch.long, device=dev)
    log_prob = torch.zeros(b, device=dev)
    length = torch.zeros(b, device=dev)
    sentence = torch.arange(b, device=dev)  # the sentence in each batch row
    live = torch.ones(b, dtype=torch.bool, device=dev)  # per batch row: still generating
    tokens = torch.full((b, 1), s.bos_id, dtype=torch.long, device=dev)
    cache = DecoderCache()
    for step in range(n_steps):
        dec = model.decode(tokens, enc, cache)
        at_limit = limits[sentence] <= step + 1
        history = out[sentence, max(0, step - span) : step]  # the last tokens, all loop_guard looks at
        banned, end = loop_guard(history, None if allowed is None else allowed[sentence], src_len[sentence] <= step, s)
        at_limit = at_limit if end is None else at_limit | end
        logp = step_log_probs(dec.logits[:, -1], s, at_limit, _forced(prefix, sentence, step), banned)
        best, tok = arg_max(logp)  # (N,)
        rows = sentence[live]
        out[rows, step] = tok[live]
        log_prob[rows] += best[live]
        length[rows] += 1
        live &= tok != s.eos_id
        if not live.any():
            break
        tokens, cache = tok[:, None], dec.cache
        if (~live).sum() * 4 >= live.numel():
            keep = live.nonzero()[:, 0]
            sentence, live, tokens = sentence[keep], live[keep], tokens[keep]
            enc = enc.index_select(keep)
            cache = cache.reorder(keep, source_index=keep)
    scores = normalized(log_prob, length, alpha).tolist()
    return [Hypothesis(_strip(row, s), score, lp) for row, score, lp in zip(out.tolist(), scores, log_prob.tolist())]


def normalized(log_prob, length, alpha: float):
    """The length-normalised score ``log_prob / length ** alpha`` (floats or tensors),
    computed as a product with ``length ** -alpha``: for lengths >= 1 and alpha >= 0
    that factor is at most 1, so no alpha can overflow it (a huge one underflows to 0)."""
    return log_prob * length**-alpha


def _strip(ids: list[int], s: SearchSettings) -> list[int]:
    return ids[: ids.index(s.eos_id)] if s.eos_id in ids else [i for i in ids if i != s.pad_id]


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    s: SearchSettings,
    beam: int = 5,
    alpha: float = 1.0,
    n_best: int = 1,
    prefixes: list[list[int]] | None = None,
) -> list[list[Hypothesis]]:
    """src: (B, T_s) -> per sentence, its ``n_best`` hypotheses, best first.

    Each step (``beam_step``) scores ``beam * V`` continuations per sentence and keeps the
    best ``2 * beam``: those ending in EOS among the top ``beam`` are
    finished (score divided by length ** alpha), the best ``beam`` others
    continue. A sentence is done once it has ``beam`` finished hypotheses,
    and leaves the batch.

    The first step runs one row per sentence (its beams would all be the
    same); the cache reorder then fans each row out to ``beam`` rows. The
    source's keys/values keep one row per sentence throughout: its beams
    attend to it as a group (see grouped queries in ``mt.model.attention``).

    ``prefixes[i]``: tokens sentence i's hypotheses all start with. While a
    sentence is inside its prefix every row may take only the prefix token,
    so one hypothesis carries it (the others stay at -inf) and the beam
    opens where the prefix ends.
    """
    b, dev = src.size(0), src.device
    if not 1 <= n_best <= beam:
        raise ValueError(f"n_best must be between 1 and the beam size {beam}")
    enc = model.encode(src)
    prefix = prefix_tensor(prefixes, b, dev)
    limits = max_lengths(src, s, model.cfg.max_positions, prefix)  # (B,)
    allowed = loop_allowance(src, s)  # (B,) or None
    src_len = (src != s.pad_id).sum(1) - 1  # pieces, without the EOS
    sentence = torch.arange(b, device=dev)  # original index of each sentence still searching
    tokens = torch.full((b, 1), s.bos_id, dtype=torch.long, device=dev)  # (N*W, 1 + step)
    scores = torch.zeros(b, 1, device=dev)  # (N, W): N sentences left, W live beams each
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    cache = DecoderCache()
    for step in range(int(limits.max())):
        n, width = scores.shape
        dec = model.decode(tokens[:, -1:], enc, cache)
        at_limit = (limits[sentence] <= step + 1).repeat_interleave(width)
        row_allowed = None if allowed is None else allowed[sentence].repeat_interleave(width)
        banned, end = loop_guard(tokens[:, 1:], row_allowed, (src_len[sentence] <= step).repeat_interleave(width), s)
        at_limit = at_limit if end is None else at_limit | end
        forced = _forced(prefix, sentence, step)
        forced = forced.repeat_interleave(width) if forced is not None else None
        logp = step_log_probs(dec.logits[:, -1], s, at_limit, forced, banned)
        step_out = beam_step(logp, scores, beam, s.eos_id)
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        if step_out.finished:
            for i, row, lp in step_out.finished:
                hyps = finished[int(sentence[i])]
                if len(hyps) < beam:
                    hyps.append(Hypothesis(tokens[row, 1:].tolist(), normalized(lp, float(step + 1), alpha), lp))
            done = torch.tensor([len(finished[i]) >= beam for i in sentence.tolist()], device=dev)
            if done.all():
                break

        rows, next_tok, next_scores = step_out.rows, step_out.tokens, step_out.scores  # (N, W')
        keep = None
        if done.any():
            keep = (~done).nonzero()[:, 0]
            rows, next_tok, next_scores, sentence = rows[keep], next_tok[keep], next_scores[keep], sentence[keep]
            enc = enc.index_select(keep)
        rows = rows.view(-1)
        tokens = torch.cat([tokens[rows], next_tok.view(-1, 1)], dim=1)
        cache = dec.cache.reorder(rows, source_index=keep)
        scores = next_scores
    return [sorted(f, key=lambda h: -h.score)[:n_best] for f in finished]
