import math

import pytest
import torch

from mt.config import ModelConfig
from mt.decode.continuous import ContinuousBeamSearch, Sentence
from mt.decode.search import (
    SearchSettings,
    arg_max,
    beam_search,
    greedy_search,
    loop_allowance,
    repeat_runs,
    top_k,
)
from mt.model.attention import KV
from mt.model.layers import LayerCache
from mt.model.transformer import DecoderCache, DecoderOutput, EncoderOutput, Transformer

PAD, UNK, BOS, EOS = 0, 1, 2, 3
# the search's mechanics are compared with plain references without the loop guard
# (random models loop, and the guard changes most of their outputs); G has it
S = SearchSettings(BOS, EOS, PAD, max_len_a=1.0, max_len_b=4, loop_margin=None)
G = SearchSettings(BOS, EOS, PAD, max_len_a=2.0, max_len_b=12, loop_ngram=3, loop_margin=1)


def tiny_model(vocab: int = 30, layers: int = 2, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        d_model=32, n_heads=4, enc_layers=layers, dec_layers=layers, d_ff=64, dropout=0.0,
        src_vocab_size=vocab, tgt_vocab_size=vocab, pad_id=PAD,
    )  # fmt: skip
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def model():
    m = tiny_model()
    with torch.no_grad():  # a peaky output distribution, so that EOS comes up in short outputs
        m.tgt_embed.weight.mul_(6.0)
    return m


def sources(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 8, (n,), generator=g)
    src = torch.full((n, int(lengths.max())), PAD)
    for i, n_i in enumerate(lengths.tolist()):
        src[i, :n_i] = torch.randint(4, 30, (n_i,), generator=g)
    return src


def copies_at_end(seq: list[int], max_n: int) -> int:
    """The most copies of an n-gram (n <= max_n) that come in a row at the end of seq, counted one by one."""
    best = 1
    for n in range(1, max_n + 1):
        c = 1
        while len(seq) >= (c + 1) * n and seq[len(seq) - (c + 1) * n : len(seq) - c * n] == seq[len(seq) - n :]:
            c += 1
        best = max(best, c)
    return best


def uncached_greedy(model, src, s: SearchSettings = S):
    """Greedy decoding that re-runs the decoder on the whole prefix at each step, and
    never takes a token after which the output would end in more copies of an n-gram
    than its source allows (``s``'s loop guard, counted by ``copies_at_end``): it takes
    another while the output is shorter than the source (EOS aside), else EOS."""
    outs = []
    for row in src:
        row = row[row != PAD][None]
        enc = model.encode(row)
        ys = [BOS]
        limit = int(s.max_len_a * row.size(1) + s.max_len_b)
        source = row[0].tolist()
        if s.loop_margin is not None:
            allowed = max(copies_at_end(source[:end], s.loop_ngram) for end in range(1, len(source) + 1))
            allowed += s.loop_margin
        for step in range(limit):
            logits = model.decode(torch.tensor([ys]), enc).logits[0, -1]
            logits[[PAD, BOS]] = -math.inf
            loops = False
            if s.loop_margin is not None:
                for token in set(ys[1:]):
                    if copies_at_end(ys[1:] + [token], s.loop_ngram) > allowed:
                        logits[token], loops = -math.inf, True
            nxt = EOS if step + 1 >= limit or (loops and step >= len(source) - 1) else int(logits.argmax())
            if nxt == EOS:
                break
            ys.append(nxt)
        outs.append(ys[1:])
    return outs


@pytest.mark.parametrize("s", [S, G], ids=["no-guard", "guard"])
def test_cached_greedy_equals_uncached(model, s):
    src = sources(12)
    assert [h.tokens for h in greedy_search(model, src, s)] == uncached_greedy(model, src, s)


def test_repeat_runs_counts_the_copies_one_by_one():
    rng = torch.Generator().manual_seed(0)
    for _ in range(40):  # short rows of few distinct tokens: many runs; pad on the left (joined rows) and right
        ids = torch.randint(4, 7, (6, 14), generator=rng)
        ids[0, :3], ids[1, -4:], ids[2, :] = PAD, PAD, 5
        ids[0, 3] = BOS
        runs = repeat_runs(ids, 4, PAD)
        for row, got in zip(ids.tolist(), runs.tolist()):
            for end in range(1, len(row) + 1):
                tail = row[:end]
                if PAD in tail:  # pads never repeat: count from the last pad on
                    tail = tail[len(tail) - tail[::-1].index(PAD) :]
                assert got[end - 1] == (copies_at_end(tail, 4) if tail else 1), (row, end)


def test_the_loop_guard_holds_in_every_search(model):
    """A random model loops; with the guard, no output of greedy, beam or the continuous
    search holds more copies of an n-gram in a row than its source allows, and the
    continuous search gets what beam search gets."""
    src = sources(12)
    plain = [h.tokens for h in greedy_search(model, src, SearchSettings(**{**vars(G), "loop_margin": None}))]
    guarded = [h.tokens for h in greedy_search(model, src, G)]
    allowed = loop_allowance(src, G).tolist()
    assert (
        sum(any(copies_at_end(p[:end], G.loop_ngram) > a for end in range(len(p) + 1)) for p, a in zip(plain, allowed))
        >= 3
    )  # fmt: skip - without the guard, runs go past the allowance
    for beam in (1, 4):
        nbest = beam_search(model, src, G, beam=beam, n_best=beam)
        for hyps, a in zip(nbest, allowed):
            for h in hyps:
                assert all(copies_at_end(h.tokens[:end], G.loop_ngram) <= a for end in range(len(h.tokens) + 1))
        if beam == 1:
            assert [h[0].tokens for h in nbest] == guarded
        search = ContinuousBeamSearch(model, G, beam)
        search.add([Sentence(row[row != PAD].tolist(), n_best=beam, tag=i) for i, row in enumerate(src)])
        got = {}
        for _ in range(100):
            got |= {x.tag: hyps for x, hyps in search.step()}
            if not len(search):
                break
        assert [[h.tokens for h in got[i]] for i in range(len(src))] == [[h.tokens for h in n] for n in nbest]


def test_a_prefix_is_kept_whole_even_where_it_loops(model):
    src = sources(3)
    prefixes = [[9] * 6, [9, 10] * 4, []]  # past the guard's allowance (loop_margin 1)
    for hyps in (
        ([h] for h in greedy_search(model, src, G, prefixes=prefixes)),
        beam_search(model, src, G, beam=3, prefixes=prefixes),
    ):
        for (h,), prefix in zip(hyps, prefixes):
            assert h.tokens[: len(prefix)] == prefix


def test_beam_one_equals_greedy(model):
    src = sources(8, seed=2)
    greedy = greedy_search(model, src, S)
    beam = beam_search(model, src, S, beam=1)
    for g, (b,) in zip(greedy, beam):
        assert g.tokens == b.tokens
        assert g.score == pytest.approx(b.score, abs=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_batch_equals_one_by_one(model, beam):
    src = sources(5, seed=3)
    batched = beam_search(model, src, S, beam=beam, n_best=beam)
    for i in range(src.size(0)):
        row = src[i : i + 1, : int((src[i] != PAD).sum())]
        alone = beam_search(model, row, S, beam=beam, n_best=beam)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[i]]
        for a, b in zip(alone, batched[i]):
            assert a.score == pytest.approx(b.score, abs=1e-4)
    greedy = greedy_search(model, src, S)
    assert [h.tokens for h in greedy] == [
        h.tokens for h in (greedy_search(model, src[i : i + 1], S)[0] for i in range(5))
    ]


def test_n_best_is_sorted_and_never_has_pad_or_bos(model):
    for nbest in beam_search(model, sources(6, seed=4), S, beam=5, n_best=5):
        assert len(nbest) == 5
        assert [h.score for h in nbest] == sorted((h.score for h in nbest), reverse=True)
        for h in nbest:
            assert PAD not in h.tokens and BOS not in h.tokens and EOS not in h.tokens


class TableModel:
    """A 'model' whose next-token distribution is a fixed table of prefixes:
    A (0.6) then mostly-flat continuations; B (0.4) then EOS (0.9)."""

    A, B = 4, 5
    cfg = ModelConfig(src_vocab_size=6, tgt_vocab_size=6, max_positions=32)

    def table(self, prefix: tuple) -> list[float]:
        p = [1e-9] * 6
        if prefix == ():
            p[self.A], p[self.B] = 0.6, 0.4
        elif prefix == (self.A,):
            p[EOS], p[self.A], p[self.B] = 0.4, 0.3, 0.3
        elif prefix == (self.B,):
            p[EOS], p[self.A] = 0.9, 0.1
        else:
            p[EOS] = 1.0
        return p

    def encode(self, src):
        return EncoderOutput(src[..., None].float(), src[:, None, None, :] != PAD, None)

    def decode(self, tgt, enc, cache):
        prev = cache.layers[0].self_kv.k if cache.layers else tgt.new_zeros((tgt.size(0), 1, 0, 1)).float()
        k = torch.cat([prev, tgt.float()[:, None, :, None]], dim=2)  # the prefix so far
        prefixes = [tuple(int(t) for t in row[0, 1:, 0]) for row in k]
        logits = torch.tensor([self.table(p) for p in prefixes]).log()[:, None, :]
        return DecoderOutput(logits, DecoderCache([LayerCache(KV(k, k), None)]), None, None)


def test_beam_finds_the_better_output_that_greedy_misses():
    m, src = TableModel(), torch.tensor([[7, 7]])
    settings = SearchSettings(BOS, EOS, PAD, max_len_a=0.0, max_len_b=5)
    greedy = greedy_search(m, src, settings)[0]
    best = beam_search(m, src, settings, beam=2)[0][0]
    assert greedy.tokens == [m.A] and greedy.log_prob == pytest.approx(math.log(0.6 * 0.4))
    assert best.tokens == [m.B] and best.log_prob == pytest.approx(math.log(0.4 * 0.9))
    assert best.score > greedy.score


@pytest.mark.parametrize(
    "shape,k", [((7, 40_000), 10), ((3, 8_001), 10), ((5, 2_560), 10), ((4, 300), 10), ((2, 9), 3)]
)
def test_block_top_k_equals_topk(shape, k):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
    x[0, -1] = 50.0  # the best entry in the short last block
    x[1, :k] = -float("inf")
    want, got = x.topk(k, dim=1), top_k(x, k)
    assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)


def test_block_arg_max_returns_the_first_maximum():
    x = torch.randn(6, 8_000, generator=torch.Generator().manual_seed(0))
    x[2, 100] = x[2, 7_000] = 9.0  # a tie across blocks: the first one wins, as in max()
    x[3, 64] = x[3, 65] = 9.0  # ... and inside a block
    x[4] = -float("inf")
    values, index = arg_max(x)
    want = x.max(dim=1)
    assert torch.equal(values, want.values) and torch.equal(index, want.indices)
    assert index[2] == 100 and index[3] == 64


def test_search_with_block_selection_equals_plain_topk(monkeypatch):
    """A vocabulary large enough for the block path (beam 5 x 640 entries, greedy over 640)."""
    m = tiny_model(vocab=640, layers=1, seed=1)
    src = torch.randint(4, 640, (5, 7), generator=torch.Generator().manual_seed(2))
    src[:, -1] = EOS
    fast = beam_search(m, src, S, beam=5, n_best=3), greedy_search(m, src, S)
    import mt.decode.search

    monkeypatch.setattr(mt.decode.search, "top_k", lambda x, k: x.topk(k, dim=1))
    monkeypatch.setattr(mt.decode.search, "arg_max", lambda x: x.max(dim=1))
    assert (beam_search(m, src, S, beam=5, n_best=3), greedy_search(m, src, S)) == fast


def uncached_forced_greedy(model, row, prefix):
    """Greedy decoding of one source that takes ``prefix`` first, re-running the whole target each step."""
    row = row[row != PAD][None]
    enc = model.encode(row)
    ys = [BOS]
    limit = max(int(S.max_len_a * row.size(1) + S.max_len_b), len(prefix) + 1)
    for step in range(limit):
        logits = model.decode(torch.tensor([ys]), enc).logits[0, -1]
        logits[[PAD, BOS]] = -math.inf
        nxt = prefix[step] if step < len(prefix) else EOS if step + 1 >= limit else int(logits.argmax())
        if nxt == EOS:
            break
        ys.append(nxt)
    return ys[1:]


def test_greedy_with_prefixes_continues_from_them(model):
    src = sources(6, seed=4)
    prefixes = [[5, 6], [], [7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [], [20]]  # one past the limit
    hyps = greedy_search(model, src, S, prefixes=prefixes)
    for h, row, prefix in zip(hyps, src, prefixes):
        assert h.tokens[: len(prefix)] == prefix
        assert h.tokens == uncached_forced_greedy(model, row, prefix)
    plain = greedy_search(model, src, S)
    own = [h.tokens[:2] for h in plain]  # the model's own first tokens as prefixes: the same outputs
    assert [h.tokens for h in greedy_search(model, src, S, prefixes=own)] == [h.tokens for h in plain]


@pytest.mark.parametrize("beam", [1, 4])
def test_beam_with_prefixes_keeps_them_in_every_hypothesis(model, beam):
    src = sources(5, seed=6)
    prefixes = [[5, 6, 7], [], [9], [], [10, 11]]
    nbest = beam_search(model, src, S, beam=beam, n_best=beam, prefixes=prefixes)
    for hyps, prefix, row in zip(nbest, prefixes, src):
        assert len(hyps) == beam and all(h.tokens[: len(prefix)] == prefix for h in hyps)
        assert all(math.isfinite(h.score) for h in hyps)
        alone = beam_search(model, row[row != PAD][None], S, beam=beam, n_best=beam, prefixes=[prefix])[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]  # batched as alone
    if beam == 1:
        greedy = greedy_search(model, src, S, prefixes=prefixes)
        assert [h[0].tokens for h in nbest] == [h.tokens for h in greedy]
