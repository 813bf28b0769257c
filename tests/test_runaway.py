"""The loop guard on tests/data/adversarial/en.txt, 50 inputs made to make a model loop
or run long, through the toy model's tokenizer and a model of its shape with random
weights (the toy model itself seldom loops; a random one loops on nearly everything):
every output stays inside its allowance and its length limit, in mt translate's greedy
and beam search and in mt serve's continuous one."""

import pytest
import torch
from conftest import ROOT
from test_search import copies_at_end

from mt.data.tokenizer import pad_batch
from mt.decode.continuous import ContinuousBeamSearch, Sentence
from mt.decode.inference import load
from mt.decode.search import SearchSettings, loop_allowance
from mt.decode.translator import Translator
from mt.model.transformer import Transformer

ADVERSARIAL = (ROOT / "tests" / "data" / "adversarial" / "en.txt").read_text(encoding="utf-8").splitlines()


def test_fifty_adversarial_inputs_of_each_kind():
    assert len(ADVERSARIAL) == 50 and all(line.strip() for line in ADVERSARIAL)
    text = "\n".join(ADVERSARIAL)
    for kind in ("no no no", "http", "@", "1111", "TWO DOGS", "🐶", "你好", "Дети", ", five ,"):
        assert kind in text


@pytest.mark.parametrize("beam", [1, 5])
def test_no_adversarial_output_runs_away(toy_run, beam):
    trained, tok, _ = load(toy_run)
    torch.manual_seed(0)
    model = Transformer(trained.cfg).eval()
    with torch.no_grad():  # a peaky output distribution: greedy and beam search loop
        model.tgt_embed.weight.mul_(6.0)
    guarded, plain = Translator(model, tok, beam=beam, workers=1), Translator(model, tok, beam=beam, loop_margin=None)
    s: SearchSettings = guarded.settings
    src = guarded.encode(ADVERSARIAL)
    allowed = loop_allowance(pad_batch(src, tok.pad_id), s).tolist()
    outputs = [n_best[0][0] for n_best in guarded.translate_ids(src)]
    without = [n_best[0][0] for n_best in plain.translate_ids(src)]
    for x, out, a in zip(src, outputs, allowed):
        assert all(copies_at_end(out[:end], s.loop_ngram) <= a for end in range(1, len(out) + 1)), (x, out)
        assert len(out) < s.max_len_a * len(x) + s.max_len_b
    loops = [any(copies_at_end(out[:end], s.loop_ngram) > a for end in range(len(out) + 1))
             for out, a in zip(without, allowed)]  # fmt: skip
    assert sum(loops) >= 10  # without the guard, many run past their allowance
    search = ContinuousBeamSearch(model, s, beam)  # mt serve's search: the same outputs
    search.add([Sentence(x, tag=i) for i, x in enumerate(src)])
    got = {}
    for _ in range(10 * len(src) * max(map(len, src))):
        got |= {x.tag: hyps[0].tokens for x, hyps in search.step()}
        if not len(search):
            break
    assert [got[i] for i in range(len(src))] == outputs
