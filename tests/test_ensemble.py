"""Ensembles: the mean of the members' probabilities, through the same search and caches."""

import dataclasses
import json
import shutil

import pytest
import torch
from test_search import PAD, S, sources, tiny_model, uncached_greedy

from mt.cli.main import main
from mt.data.tokenizer import write_text_config
from mt.decode.ensemble import Ensemble
from mt.decode.inference import WEIGHTS, export_model, load, load_ensemble
from mt.decode.search import beam_search, greedy_search
from mt.decode.translator import Translator
from mt.errors import ModelDirError
from mt.model.transformer import DecoderCache, Transformer


def peaky(seed: int) -> Transformer:
    m = tiny_model(seed=seed)
    with torch.no_grad():  # EOS comes up in short outputs (as test_search's model)
        m.tgt_embed.weight.mul_(6.0)
    return m


@pytest.fixture(scope="module")
def pair():
    return peaky(0), peaky(5)


def test_ensemble_averages_the_members_probabilities(pair):
    a, b = pair
    src, tgt = sources(4, seed=7), torch.randint(4, 30, (4, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = (a(src, tgt).softmax(-1) + b(src, tgt).softmax(-1)) / 2
        ens = Ensemble([a, b])
        got = ens.decode(tgt, ens.encode(src)).logits.exp()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got.sum(-1), torch.ones(4, 6))


def test_cached_ensemble_equals_uncached(pair):
    ens = Ensemble(list(pair))
    src, tgt = sources(3, seed=9), torch.randint(4, 30, (3, 5), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        enc = ens.encode(src)
        full = ens.decode(tgt, enc).logits
        cache, steps = DecoderCache(), []
        for t in range(tgt.size(1)):
            out = ens.decode(tgt[:, t : t + 1], enc, cache)
            cache = out.cache
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    src = sources()
    assert [h.tokens for h in greedy_search(ens, src, S)] == uncached_greedy(ens, src)


def test_ensemble_of_one_decodes_as_its_model(pair):
    m, src = pair[0], sources(6, seed=11)
    for got, want in zip(beam_search(Ensemble([m]), src, S, beam=4, n_best=4), beam_search(m, src, S, 4, n_best=4)):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-4)
    assert [h.tokens for h in greedy_search(Ensemble([m]), src, S)] == [h.tokens for h in greedy_search(m, src, S)]


@pytest.mark.parametrize("beam", [1, 4])
def test_ensemble_batch_equals_one_by_one(pair, beam):
    """Sentences finish at different steps and leave the batch: every member's cache must follow."""
    ens, src = Ensemble(list(pair)), sources(6, seed=12)
    batched = beam_search(ens, src, S, beam=beam, n_best=beam)
    greedy = greedy_search(ens, src, S)
    for i in range(src.size(0)):
        row = src[i : i + 1, : int((src[i] != PAD).sum())]
        alone = beam_search(ens, row, S, beam=beam, n_best=beam)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[i]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in batched[i]], abs=1e-4)
        assert greedy_search(ens, row, S)[0].tokens == greedy[i].tokens
    lengths = {len(n[0].tokens) for n in batched}
    assert len(lengths) > 1  # the batch did shrink on the way


def test_ensemble_limits_and_vocabulary_checks():
    a = tiny_model()
    short = Transformer(dataclasses.replace(a.cfg, max_positions=16))
    assert Ensemble([a, short]).cfg.max_positions == 16
    with pytest.raises(ValueError, match="target vocabulary"):
        Ensemble([a, tiny_model(vocab=31)])


@pytest.fixture(scope="module")
def other_run(toy_run, tmp_path_factory):
    """The toy run with its weights perturbed: a second member with the same tokenizer."""
    run = tmp_path_factory.mktemp("ens") / "other"
    shutil.copytree(toy_run, run, ignore=shutil.ignore_patterns("eval"))
    model, _, meta = load(run)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    export_model(model, run, run, {k: v for k, v in meta.items() if k != "model"})
    return run


def test_translate_and_evaluate_with_an_ensemble(toy_run, other_run, toy_data, tmp_path, capsys):
    from mt.data.batches import Split

    src = Split(toy_data / "test").src_text[:30]
    (tmp_path / "in.txt").write_text("\n".join(src) + "\n")

    def translate(out: str, *models) -> list[str]:
        args = ["translate", "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / out), "--beam", "3"]
        assert main([*args, "--model", *map(str, models)]) == 0
        return (tmp_path / out).read_text().splitlines()

    ens, tok, _ = load_ensemble([toy_run, other_run])
    assert translate("ens.txt", toy_run, other_run) == Translator(ens, tok, beam=3).translate(src)
    assert translate("twice.txt", toy_run, toy_run) == translate("one.txt", toy_run)  # a model with itself

    assert main(["evaluate", "--model", str(toy_run), str(other_run), "--split", "test", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["ensemble"] == [str(toy_run), str(other_run)] and scores["bleu"] > 50
    written = json.loads((toy_run / "eval" / "test.beam5.with-other.json").read_text())
    assert written == scores


def test_ensemble_members_must_share_the_tokenizer(toy_run, tmp_path, capsys):
    odd = tmp_path / "odd"
    shutil.copytree(toy_run, odd, ignore=shutil.ignore_patterns("eval"))
    write_text_config(odd, "paper", "en", "de")  # the same pieces, but lowercased, Moses-tokenized text
    assert main(["translate", "--model", str(toy_run), str(odd)]) == 1
    assert f"{odd}: its tokenizer differs from {toy_run}'s" in capsys.readouterr().err

    # the comparison comes before the member's weights are read: unreadable ones are never reached
    (odd / WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(ModelDirError, match="its tokenizer differs"):
        load_ensemble([toy_run, odd])
    same = tmp_path / "same"  # the same tokenizer: now the weights are read, and fail
    shutil.copytree(toy_run, same, ignore=shutil.ignore_patterns("eval"))
    (same / WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(ModelDirError, match="cannot load weights"):
        load_ensemble([toy_run, same])
