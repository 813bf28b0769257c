"""Continuous batching: a beam search that sentences join and leave between steps.

``mt.decode.search.beam_search`` decodes a batch from start to end: it runs as
many steps as its longest sentence needs while its rows thin out, and a
sentence that arrives meanwhile waits for the next batch. A service whose
clients send one sentence each sees exactly that: small batches of mixed
lengths, each step nearly as costly for few rows as for many. Here one
search runs for as long as there are sentences to decode: sentences join
it at any step (``add``) and leave it as soon as they are finished, their
hypotheses returned by that ``step``, so the batch stays full under load.

Every step is ``beam_search``'s step (``mt.decode.search.beam_step``, the one
function both call) for each sentence in it; only the bookkeeping differs:

* The rows of sentences that joined at different steps share one
  ``JoinedCache`` (``mt.decode.joining``): slot t holds, for every row, the
  keys/values of the token decoded at the search's step t, and a row that
  joined at step j leaves slots before j unused (its ``pad``: its positions
  count from j and its queries do not see those slots). ``tokens`` has the
  same layout.
* Each sentence has ``beam`` rows from the start, its first with score 0
  and the others at -inf, so that its first step expands one hypothesis
  as ``beam_search``'s single first row does, and every sentence has the
  same number of rows (the beams share their source's keys/values).
* A joining sentence's source is encoded and projected for every decoder
  layer at once (``Transformer.source_cache``), and its rows are appended
  to the cache; sources of different lengths are padded to the longest.

So a sentence gets the same hypotheses as from ``beam_search`` (and from
``mt translate``), up to float rounding of differently padded batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from mt.data.tokenizer import pad_batch
from mt.decode.ensemble import Ensemble, EnsembleCache, EnsembleEncoding
from mt.decode.joining import JoinedCache, join_sources
from mt.decode.search import (
    Hypothesis,
    SearchSettings,
    beam_step,
    loop_allowance,
    loop_guard,
    max_lengths,
    normalized,
    prefix_tensor,
    step_log_probs,
)
from mt.model.transformer import DecoderCache, EncoderOutput, Transformer


@dataclass
class Sentence:
    """One sentence to translate, and what its search needs to know."""

    src: list[int]  # source ids, eos included
    prefix: list[int] = field(default_factory=list)  # target ids every hypothesis starts with
    alpha: float = 1.0  # length penalty: score = log-probability / length ** alpha
    n_best: int = 1  # hypotheses to return, at most the beam
    tag: object = None  # the caller's, handed back with the result


class JoinError(RuntimeError):
    """Sentences that could not join a search (``sentences``), and why (``__cause__``)."""

    def __init__(self, sentences: list[Sentence], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.sentences = sentences


class ContinuousBeamSearch:
    """A beam search of width ``beam`` over a batch that changes between steps.

    ``add`` queues sentences; ``step`` lets the queued ones join, decodes one
    token for every sentence under way and returns the sentences that
    finished, each with its ``n_best`` hypotheses, best first. Not for use
    from several threads at once.
    """

    def __init__(self, model: Transformer | Ensemble, s: SearchSettings, beam: int = 5):
        if beam < 1:
            raise ValueError(f"beam must be at least 1, got {beam}")
        self.model, self.s, self.beam = model, s, beam
        self.device = next(model.parameters()).device
        self.waiting: list[Sentence] = []
        self._reset()

    def _reset(self) -> None:
        self.sentences: list[Sentence] = []  # under way, in batch order
        self.finished: list[list[Hypothesis]] = []
        self.enc = self.cache = None
        self.tokens = torch.empty(0, 1, dtype=torch.long, device=self.device)  # (N*W, 1 + T): slot layout
        self.start = torch.empty(0, dtype=torch.long, device=self.device)  # (N*W,) the slot of each row's bos
        self.scores = torch.empty(0, self.beam, device=self.device)  # (N, W)
        self.steps = torch.empty(0, dtype=torch.long, device=self.device)  # (N,) tokens generated so far
        self.limits = torch.empty(0, dtype=torch.long, device=self.device)  # (N,) most tokens to generate
        self.allowed = torch.empty(0, dtype=torch.long, device=self.device)  # (N,) loop guard (loop_allowance)
        self.src_len = torch.empty(0, dtype=torch.long, device=self.device)  # (N,) source pieces, EOS aside
        self.prefix: Tensor | None = None  # (N, P) prefix ids padded with -1, or None if none has one
        self.dropped: set = set()  # tags of sentences under way that leave at the next step unanswered

    def __len__(self) -> int:
        """Sentences under way and waiting."""
        return len(self.sentences) + len(self.waiting)

    def add(self, sentences: list[Sentence]) -> None:
        """Queue sentences: they join at the next ``step``. Raises ValueError, and queues
        none of them, if one cannot be searched."""
        for x in sentences:
            if not x.src:
                raise ValueError("a sentence to translate has at least its eos")
            if not 1 <= x.n_best <= self.beam:
                raise ValueError(f"n_best must be between 1 and the beam size {self.beam}")
            if x.alpha < 0:
                raise ValueError(f"alpha must be >= 0, got {x.alpha}")
        self.waiting.extend(sentences)

    def drop(self, tags: set) -> None:
        """Forget the sentences whose tag is in ``tags`` (their requester has gone): waiting
        ones at once, those under way at the next step, where they leave unanswered."""
        self.waiting = [x for x in self.waiting if x.tag not in tags]
        self.dropped |= {x.tag for x in self.sentences if x.tag in tags}

    @torch.inference_mode()
    def step(self) -> list[tuple[Sentence, list[Hypothesis]]]:
        """One decoding step of every sentence; the ones it finished, with their hypotheses.
        Raises ``JoinError`` if the waiting sentences cannot join: they are gone from the
        search, and the sentences under way are untouched (the next ``step`` goes on)."""
        if self.waiting:
            new, self.waiting = self.waiting, []
            try:
                self._join(new)
            except Exception as e:
                raise JoinError(new, e) from e
        if not self.sentences:
            return []
        s, beam, dev = self.s, self.beam, self.device
        dec = self.model.decode(self.tokens[:, -1:], self.enc, self.cache)
        at_limit = (self.limits <= self.steps + 1).repeat_interleave(beam)
        # the slots before a row's bos hold pad: runs end there and at its bos
        allowed = self.allowed.repeat_interleave(beam) if s.loop_margin is not None else None
        banned, end = loop_guard(self.tokens, allowed, (self.src_len <= self.steps).repeat_interleave(beam), s)
        at_limit = at_limit if end is None else at_limit | end
        logp = step_log_probs(dec.logits[:, -1], s, at_limit, self._forced(), banned)
        step = beam_step(logp, self.scores, beam, s.eos_id)
        if step.finished:
            steps = self.steps.tolist()
            for i, row, lp in step.finished:
                hyps = self.finished[i]
                if len(hyps) < beam:
                    tokens = self.tokens[row, int(self.start[row]) + 1 :].tolist()
                    hyps.append(Hypothesis(tokens, normalized(lp, float(steps[i] + 1), self.sentences[i].alpha), lp))
        # done: `beam` hypotheses finished, or at the length limit (which forces eos)
        at_end = (self.steps + 1 >= self.limits).tolist()
        dropped = [x.tag in self.dropped for x in self.sentences]
        done = [len(h) >= beam or end or gone for h, end, gone in zip(self.finished, at_end, dropped)]
        out = [
            (x, sorted(h, key=lambda y: -y.score)[: x.n_best])
            for x, h, d, gone in zip(self.sentences, self.finished, done, dropped)
            if d and not gone
        ]
        self.dropped = set()  # every dropped sentence leaves the batch below
        if all(done):
            self._reset()
            return out

        rows, next_tok, next_scores = step.rows, step.tokens, step.scores  # (N, W)
        keep = None
        if any(done):
            keep = torch.tensor([i for i, d in enumerate(done) if not d], device=dev)
            rows, next_tok, next_scores = rows[keep], next_tok[keep], next_scores[keep]
            self._select(keep)
        rows = rows.view(-1)
        self.tokens = torch.cat([self.tokens[rows], next_tok.view(-1, 1)], dim=1)
        self.start = self.start[rows]
        self.cache = dec.cache.reorder(rows, source_index=keep)
        self.scores = next_scores
        self.steps = self.steps + 1
        return out

    def _forced(self) -> Tensor | None:
        """Per row the token its sentence's prefix makes it take at this step, or -1."""
        if self.prefix is None:
            return None
        p = self.prefix.size(1)
        at = self.steps.clamp(max=p - 1)[:, None]
        forced = self.prefix.gather(1, at)[:, 0].masked_fill(self.steps >= p, -1)  # (N,)
        return forced.repeat_interleave(self.beam)

    def _select(self, keep: Tensor) -> None:
        """Keep the sentences ``keep`` (their indices, in order): the others are done."""
        kept = keep.tolist()
        self.sentences = [self.sentences[i] for i in kept]
        self.finished = [self.finished[i] for i in kept]
        self.enc = self.enc.index_select(keep)
        self.steps, self.limits, self.allowed = self.steps[keep], self.limits[keep], self.allowed[keep]
        self.src_len = self.src_len[keep]
        if self.prefix is not None:
            self.prefix = self.prefix[keep]

    def _join(self, new: list[Sentence]) -> None:
        """Let ``new`` sentences into the batch: encoded, their sources projected, ``beam`` rows each.
        All of it is computed before any of the search's state changes: if it raises, the
        sentences under way are as they were."""
        s, beam, dev = self.s, self.beam, self.device
        src = pad_batch([x.src for x in new], s.pad_id).to(dev)
        prefix = prefix_tensor([x.prefix for x in new], len(new), dev)
        enc = self.model.encode(src)
        cache = self.model.source_cache(enc)
        limits = max_lengths(src, s, self.model.cfg.max_positions, prefix)
        allowed = loop_allowance(src, s)
        if allowed is None:  # no loop guard: kept in step with the sentences all the same
            allowed = torch.zeros_like(limits)
        rows = len(new) * beam
        scores = torch.full((len(new), beam), float("-inf"), device=dev)
        scores[:, 0] = 0.0  # one live hypothesis: its first step expands it alone
        if not self.sentences:
            cache = _joinable(cache)
            tokens = torch.full((rows, 1), s.bos_id, dtype=torch.long, device=dev)
            start = torch.zeros(rows, dtype=torch.long, device=dev)
        else:
            t = self.tokens.size(1) - 1  # slots in the cache
            drop = int(self.start.min())  # slots no row uses any more
            enc = _join_sources(self.enc, enc)
            cache = self.cache.join(cache, rows, drop)
            fresh = torch.full((rows, t + 1 - drop), s.pad_id, dtype=torch.long, device=dev)
            fresh[:, -1] = s.bos_id
            tokens = torch.cat([self.tokens[:, drop:], fresh])
            start = torch.cat([self.start - drop, self.start.new_full((rows,), t - drop)])
        if prefix is not None or self.prefix is not None:
            none = torch.full((len(self.sentences), 1), -1, dtype=torch.long, device=dev)
            old = self.prefix if self.prefix is not None else none
            add = prefix if prefix is not None else none[:0].new_full((len(new), 1), -1)
            width = max(old.size(1), add.size(1))
            prefix = torch.cat([_pad_right(old, width), _pad_right(add, width)])
        # commit
        self.enc, self.cache, self.tokens, self.start, self.prefix = enc, cache, tokens, start, prefix
        self.sentences += new
        self.finished += [[] for _ in new]
        self.scores = torch.cat([self.scores, scores])
        self.steps = torch.cat([self.steps, torch.zeros(len(new), dtype=torch.long, device=dev)])
        self.limits = torch.cat([self.limits, limits])
        self.allowed = torch.cat([self.allowed, allowed])
        self.src_len = torch.cat([self.src_len, (src != s.pad_id).sum(1) - 1])


def _pad_right(ids: Tensor, width: int) -> Tensor:
    """(N, P) ids -> (N, width), padded on the right with -1."""
    return F.pad(ids, (0, width - ids.size(1)), value=-1)


def _joinable(cache: DecoderCache | EnsembleCache) -> JoinedCache | EnsembleCache:
    """A model's ``source_cache`` as one that sentences can join (an ensemble's, member by member)."""
    if isinstance(cache, EnsembleCache):
        return EnsembleCache([_joinable(c) for c in cache.members])
    return JoinedCache(cache.layers)


def _join_sources(old: EncoderOutput | EnsembleEncoding, new: EncoderOutput | EnsembleEncoding):
    return old.join(new) if isinstance(old, EnsembleEncoding) else join_sources(old, new)
