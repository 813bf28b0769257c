import math

import pytest
import torch

from mt.config import ModelConfig
from mt.decode.search import SearchSettings, arg_max, beam_search, greedy_search, top_k
from mt.model.attention import KV
from mt.model.layers import LayerCache
from mt.model.transformer import DecoderCache, DecoderOutput, EncoderOutput, Transformer

PAD, UNK, BOS, EOS = 0, 1, 2, 3
S = SearchSettings(BOS, EOS, PAD, max_len_a=1.0, max_len_b=4)


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


def uncached_greedy(model, src):
    """Greedy decoding that re-runs the decoder on the whole prefix at each step."""
    outs = []
    for row in src:
        row = row[row != PAD][None]
        enc = model.encode(row)
        ys = [BOS]
        limit = int(S.max_len_a * row.size(1) + S.max_len_b)
        for step in range(limit):
            logits = model.decode(torch.tensor([ys]), enc).logits[0, -1]
            logits[[PAD, BOS]] = -math.inf
            nxt = EOS if step + 1 >= limit else int(logits.argmax())
            if nxt == EOS:
                break
            ys.append(nxt)
        outs.append(ys[1:])
    return outs


def test_cached_greedy_equals_uncached(model):
    src = sources()
    assert [h.tokens for h in greedy_search(model, src, S)] == uncached_greedy(model, src)


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
