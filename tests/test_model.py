import dataclasses
import re

import pytest
import torch

from mt.config import Config, ConfigError, ModelConfig, load_config
from mt.model.layers import FeedForward
from mt.model.transformer import DecoderCache, Transformer

PAD, BOS = 0, 1


def tiny_config(**kw) -> ModelConfig:
    base = dict(
        d_model=32, n_heads=4, enc_layers=2, dec_layers=2, d_ff=64, dropout=0.0,
        src_vocab_size=50, tgt_vocab_size=50, pad_id=PAD, max_positions=64,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


VARIANTS = {
    "pre-ln": {},
    "post-ln-gelu-learned": {"norm_first": False, "activation": "gelu", "positional": "learned"},
    "separate-embeddings": {"share_embeddings": False, "tie_output": False, "src_vocab_size": 40},
}


@pytest.fixture(params=list(VARIANTS))
def model(request):
    torch.manual_seed(0)
    return Transformer(tiny_config(**VARIANTS[request.param])).eval()


def tokens(b, t, low=3, high=40, gen=None):
    return torch.randint(low, high, (b, t), generator=gen)


def test_forward_shapes_and_param_count(model):
    src, tgt = tokens(3, 7), tokens(3, 5)
    logits = model(src, tgt)
    assert logits.shape == (3, 5, 50)
    n = model.num_parameters()
    assert n == sum(p.numel() for p in set(model.parameters()))
    assert n > 0


def test_causality(model):
    src, tgt = tokens(2, 6), tokens(2, 8)
    out = model(src, tgt)
    for t in range(7):
        changed = tgt.clone()
        changed[:, t + 1 :] = tokens(2, 7 - t, gen=torch.Generator().manual_seed(t))
        assert not torch.equal(changed, tgt)
        torch.testing.assert_close(model(src, changed)[:, : t + 1], out[:, : t + 1])


def test_source_padding_invariance(model):
    src, tgt = tokens(2, 6), tokens(2, 5)
    out = model(src, tgt)
    padded = torch.cat([src, torch.full((2, 4), PAD)], dim=1)
    torch.testing.assert_close(model(padded, tgt), out, rtol=1e-5, atol=1e-5)
    enc = model.encode(padded)
    torch.testing.assert_close(enc.memory[:, :6], model.encode(src).memory, rtol=1e-5, atol=1e-5)


def test_cached_step_by_step_equals_full_prefix(model):
    src, tgt = tokens(3, 6), tokens(3, 7)
    enc = model.encode(src)
    full = model.decode(tgt, enc).logits
    cache = DecoderCache()
    steps = []
    for t in range(7):
        out = model.decode(tgt[:, t : t + 1], enc, cache)
        cache = out.cache
        steps.append(out.logits)
    assert cache.length == 7
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    # a chunk of several positions after a cached prefix
    out = model.decode(tgt[:, :3], enc, DecoderCache())
    out = model.decode(tgt[:, 3:], enc, out.cache)
    torch.testing.assert_close(out.logits, full[:, 3:], rtol=1e-5, atol=1e-5)


def test_cache_reorder_follows_batch_index(model):
    src, tgt = tokens(3, 6), tokens(3, 4)
    enc = model.encode(src)
    cache = model.decode(tgt, enc, DecoderCache()).cache
    index = torch.tensor([2, 0, 0])
    reordered = cache.reorder(index, source_index=index)
    nxt = tokens(3, 1)
    a = model.decode(nxt, enc.index_select(index), reordered).logits
    b = model.decode(torch.cat([tgt[index], nxt], 1), enc.index_select(index)).logits[:, -1:]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_successive_reorders_compose_and_work_with_gradients(model):
    # reorders are applied lazily by the next step: two in a row must compose,
    # and the step that applies them must also work when gradients are on
    src, tgt, nxt = tokens(3, 6), tokens(3, 4), tokens(3, 1)
    first, second = torch.tensor([2, 0, 1]), torch.tensor([1, 1, 0])
    picked = first[second]
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.decode(tgt, enc, DecoderCache()).cache
        twice = cache.reorder(first, source_index=first).reorder(second, source_index=second)
        expected = model.decode(torch.cat([tgt[picked], nxt], 1), enc.index_select(picked)).logits[:, -1:]
        torch.testing.assert_close(model.decode(nxt, enc.index_select(picked), twice).logits, expected)
    with torch.enable_grad():
        enc = model.encode(src)
        cache = model.decode(tgt, enc, DecoderCache()).cache.reorder(picked, source_index=picked)
        model.decode(nxt, enc.index_select(picked), cache).logits.sum().backward()
    assert model.output_weight.grad is not None


def test_weights_are_returned_per_layer(model):
    src, tgt = tokens(2, 6), tokens(2, 5)
    enc = model.encode(src, need_weights=True)
    dec = model.decode(tgt, enc, need_weights=True)
    assert [w.shape for w in enc.weights] == [(2, 4, 6, 6)] * 2
    assert [w.shape for w in dec.self_weights] == [(2, 4, 5, 5)] * 2
    assert [w.shape for w in dec.cross_weights] == [(2, 4, 5, 6)] * 2


def test_too_long_sequence_is_a_clear_error(model):
    with pytest.raises(ValueError, match="max_positions"):
        model.encode(tokens(1, 65))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("d_model", 30, "model.d_model"),
        ("n_heads", 0, "model.n_heads"),
        ("activation", "tanh", "model.activation"),
        ("dropout", 1.5, "model.dropout"),
        ("activation_dropout", 1.0, "model.activation_dropout"),
        ("positional", "rope", "model.positional"),
    ],
)
def test_config_validation_names_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(tiny_config(), **{field: value})


@pytest.mark.parametrize(("activation_dropout", "random"), [(None, True), (0.0, False), (0.5, True)])
def test_ffn_dropout_follows_activation_dropout(activation_dropout, random):
    """The FFN's inner dropout is model.dropout unless activation_dropout is set."""
    ffn = FeedForward(tiny_config(dropout=0.5, activation_dropout=activation_dropout)).train()
    x = torch.randn(4, 7, 32)
    assert (not torch.equal(ffn(x), ffn(x))) == random


def test_yaml_config_errors_name_file_and_key(tmp_path):
    path = tmp_path / "c.yaml"
    bad = [
        ("model:\n  d_modle: 128\n", r"c\.yaml.*unknown key model\.d_modle"),
        ("model:\n  d_model: big\n", r"model\.d_model must be int"),
        *((f"train: {falsy}\n", r"c\.yaml: train must be a mapping") for falsy in ("0", "[]", "''")),  # however empty
        ("- model\n", r"c\.yaml: the top level must be a mapping of sections, got list"),
    ]
    for text, message in bad:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    path.write_bytes(b"\x93NUMPY")  # not text
    with pytest.raises(ConfigError, match=r"c\.yaml: not UTF-8 text"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(tmp_path))}: cannot read the config \(Is a directory\)"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"^d\.json: the top level must be a mapping of sections, got list$"):
        Config.from_dict(["model"], "d.json")  # the same words for callers that skip load_config
    path.write_text("train:\n")
    assert load_config(path).train == load_config(None).train  # an empty section keeps the defaults
    path.write_text("model:\n  d_model: 96\n  n_heads: 4\n")
    assert load_config(path, ["model.n_heads=8"]).model.n_heads == 8
    cfg = load_config(path, ["model.activation_dropout=0", "train.max_minutes=60", "train.lr=1"])
    assert [type(v) for v in (cfg.model.activation_dropout, cfg.train.max_minutes, cfg.train.lr)] == [float] * 3
    with pytest.raises(ConfigError, match="not divisible"):
        load_config(path, ["model.n_heads=5"])
