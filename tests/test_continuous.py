"""Continuous batching (mt.decode.continuous): sentences that join a search under way
and leave it when finished get what beam search gives each of them alone."""

import random

import pytest
import torch
from test_search import BOS, EOS, PAD, S, tiny_model

from mt.data.tokenizer import pad_batch
from mt.decode.continuous import ContinuousBeamSearch, Sentence
from mt.decode.ensemble import Ensemble
from mt.decode.fastpath import speed_up
from mt.decode.joining import JoinedCache, join_sources
from mt.decode.search import SearchSettings, beam_search


def peaky(seed: int = 0):
    m = tiny_model(seed=seed)
    with torch.no_grad():  # a peaky output distribution: EOS comes up before the length limit
        m.tgt_embed.weight.mul_(6.0)
    return m


def random_sources(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 30) for _ in range(rng.randrange(1, 12))] + [EOS] for _ in range(n)]


def alone(model, x: Sentence, beam: int, s: SearchSettings = S):
    """What beam search gives the sentence in a batch of its own."""
    prefixes = [x.prefix] if x.prefix else None
    return beam_search(model, pad_batch([x.src], PAD), s, beam, x.alpha, x.n_best, prefixes)[0]


def run_staggered(search: ContinuousBeamSearch, sentences: list[Sentence], seed: int) -> dict:
    """Feed the sentences a few at a time, at random steps, until all are finished."""
    rng = random.Random(seed)
    got, i = {}, 0
    while i < len(sentences) or len(search):
        k = rng.choice([0, 0, 1, 1, 2, 5])
        search.add(sentences[i : i + k])
        i += k
        for x, hyps in search.step():
            assert x.tag not in got
            got[x.tag] = hyps
    return got


def assert_same(got, want):
    assert [h.tokens for h in got] == [h.tokens for h in want]
    assert [h.score for h in got] == pytest.approx([h.score for h in want], rel=1e-6, abs=1e-5)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("beam", [1, 3, 5])
def test_sentences_joining_at_any_step_get_what_they_get_alone(fast, beam):
    model = speed_up(peaky()) if fast else peaky()
    sentences = [Sentence(src, tag=n) for n, src in enumerate(random_sources(40, seed=beam))]
    got = run_staggered(ContinuousBeamSearch(model, S, beam), sentences, seed=beam)
    assert sorted(got) == list(range(40))
    lengths = {len(h[0].tokens) for h in got.values()}
    assert len(lengths) > 3  # sentences of many lengths, so that they finished at different steps
    for x in sentences:
        assert_same(got[x.tag], alone(model, x, beam))


def test_prefixes_length_penalties_and_n_best_are_per_sentence():
    model = speed_up(peaky())
    rng = random.Random(3)
    sentences = []
    for n, src in enumerate(random_sources(30, seed=3)):
        prefix = [rng.randrange(4, 30) for _ in range(rng.choice([0, 0, 1, 3]))]
        sentences.append(Sentence(src, prefix, alpha=rng.choice([0.0, 0.6, 1.0]), n_best=rng.randint(1, 4), tag=n))
    got = run_staggered(ContinuousBeamSearch(model, S, 4), sentences, seed=4)
    for x in sentences:
        assert len(got[x.tag]) == x.n_best
        assert all(h.tokens[: len(x.prefix)] == x.prefix for h in got[x.tag])
        assert_same(got[x.tag], alone(model, x, 4))


def test_an_ensemble_joins_and_leaves_as_one_model():
    model = Ensemble([speed_up(peaky(0)), speed_up(peaky(1))]).eval()
    sentences = [Sentence(src, tag=n) for n, src in enumerate(random_sources(20, seed=5))]
    got = run_staggered(ContinuousBeamSearch(model, S, 3), sentences, seed=6)
    for x in sentences:
        assert_same(got[x.tag], alone(model, x, 3))


def test_a_short_sentence_leaves_before_a_long_one_that_came_first():
    model = tiny_model()
    s = SearchSettings(BOS, EOS, PAD, max_len_a=1.0, max_len_b=0)  # at most as many tokens as the source has
    search = ContinuousBeamSearch(model, s, 2)
    # a prefix one token short of the limit: the sentence ends exactly at its limit
    search.add([Sentence([5] * 19 + [EOS], prefix=[9] * 19, tag="long")])
    steps = 0
    finished = []
    while len(search):
        if steps == 3:
            search.add([Sentence([6, 7, EOS], prefix=[9, 9], tag="short")])
        finished += [(x.tag, steps, len(h[0].tokens)) for x, h in search.step()]
        steps += 1
    assert finished == [("short", 3 + 2, 2), ("long", 19, 19)]  # 3 and 20 tokens, eos included


def test_the_cache_holds_only_the_steps_of_the_sentences_under_way():
    """Under a steady stream of sentences the search never empties; its cache must not grow with it."""
    model = speed_up(tiny_model())
    s = SearchSettings(BOS, EOS, PAD, max_len_a=1.0, max_len_b=2)
    search = ContinuousBeamSearch(model, s, 2)
    sources = random_sources(120, seed=7)
    longest = max(len(x) for x in sources) + 2  # generated tokens, eos included
    for n, src in enumerate(sources):
        search.add([Sentence(src, tag=n)])
        search.step()
        assert len(search.sentences) > 0 or n == 0
        assert search.tokens.size(1) <= 2 * longest + 1  # bos + slots
    assert search.tokens.size(1) <= 2 * longest + 1


def test_a_row_that_joins_a_cache_gets_the_logits_it_gets_alone():
    model = peaky()
    a, b = torch.tensor([[5, 6, 7, EOS]]), torch.tensor([[8, 9, EOS]])
    enc_a, enc_b = model.encode(a), model.encode(b)
    dec = model.decode(torch.tensor([[BOS]]), enc_a, JoinedCache(model.source_cache(enc_a).layers))
    dec = model.decode(torch.tensor([[11]]), enc_a, dec.cache)  # a has two positions; b joins at the third slot
    cache = dec.cache.join(model.source_cache(enc_b), rows=1)
    assert isinstance(cache, JoinedCache) and cache.pad.tolist() == [0, 2]
    both = join_sources(enc_a, enc_b)
    joined = model.decode(torch.tensor([[12], [BOS]]), both, cache)
    alone_a = model.decode(torch.tensor([[BOS, 11, 12]]), enc_a).logits[:, -1]
    alone_b = model.decode(torch.tensor([[BOS]]), enc_b).logits[:, -1]
    torch.testing.assert_close(joined.logits[:, -1], torch.cat([alone_a, alone_b]), atol=1e-5, rtol=1e-5)
    # one more step: b at its second position, a at its fourth
    nxt = model.decode(torch.tensor([[13], [14]]), both, joined.cache).logits[:, -1]
    want_b = model.decode(torch.tensor([[BOS, 14]]), enc_b).logits[:, -1]
    torch.testing.assert_close(nxt[1:], want_b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at least one position"):
        JoinedCache(model.source_cache(enc_a).layers).join(model.source_cache(enc_b), rows=1)
