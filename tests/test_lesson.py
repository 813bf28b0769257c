"""The lesson view (mt attention --explain): one head step by step, checked against the model."""

import math
import re
import textwrap
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT

from mt.cli.main import main
from mt.config import ModelConfig
from mt.decode.inference import load
from mt.inspect import lesson as lesson_mod
from mt.inspect.capture import force_decode
from mt.inspect.lesson import capture, entropy, head_steps, save_npz, textbook_head
from mt.inspect.plotting import _cut_labels, flow_figure
from mt.model.transformer import Transformer

TOK = SimpleNamespace(
    bos_id=1, eos_id=2, src_pieces=lambda ids: [str(i) for i in ids], tgt_pieces=lambda ids: [str(i) for i in ids]
)
VARIANTS = {
    "pre-ln": {},
    "post-ln-gelu-learned": {"norm_first": False, "activation": "gelu", "positional": "learned"},
    "wide-heads": {"d_model": 48, "n_heads": 2, "enc_layers": 1, "dec_layers": 3},
}


def random_model(**kw) -> Transformer:
    cfg = dict(
        d_model=32, n_heads=4, enc_layers=2, dec_layers=2, d_ff=64, dropout=0.0,
        src_vocab_size=50, tgt_vocab_size=50, pad_id=0, max_positions=64,
    )  # fmt: skip
    cfg.update(kw)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**cfg)).eval()
    with torch.no_grad():  # biases away from their zero initialisation, as after training
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    return model


def labels(n: int) -> list[str]:
    return [f"t{i}" for i in range(n)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("temperature", [1.0, 0.3, 3.0])
def test_every_step_of_every_head_matches_the_forward_pass(variant, temperature):
    model = random_model(**VARIANTS[variant])
    src, tgt = [5, 9, 3, 17, 22, 2], [7, 8, 30, 4]
    captured = capture(model, TOK, src, tgt, temperature)
    n_layers = {"encoder": model.cfg.enc_layers, "decoder": model.cfg.dec_layers, "cross": model.cfg.dec_layers}
    assert set(captured) == {(k, i) for k, n in n_layers.items() for i in range(n)}
    maps = force_decode(model, TOK, src, tgt, temperature)  # weights through the model's own API
    for (kind, layer), c in captured.items():
        assert torch.equal(c.weights, maps.layers(kind)[layer])  # the capture is the model's forward
        t_q, t_k = c.weights.shape[-2:]
        assert c.mask.shape == (t_q, t_k)
        assert torch.equal(c.mask, torch.ones(t_q, t_k).tril().bool()) == (kind == "decoder")
        for head in range(model.cfg.n_heads):
            steps = head_steps(model, captured, kind, layer, head, labels(t_q), labels(t_k), temperature)
            assert steps.failures() == [], (kind, layer, head, steps.diffs)
            assert steps.diffs["weights"] <= 1e-5 and steps.diffs["sublayer"] < steps.allowed("sublayer")
            np.testing.assert_allclose(steps.steps["weights"].sum(-1), 1.0, atol=1e-12)
            if kind == "decoder":
                assert np.isneginf(steps.steps["masked"][np.triu_indices(t_q, 1)]).all()
                assert (steps.steps["weights"][np.triu_indices(t_q, 1)] == 0).all()


def test_a_wrong_step_is_named():
    """The checks can fail: a lesson computed from other weights, or a wrong textbook step, is caught at that step."""
    model = random_model()
    src, tgt = [5, 9, 3, 2], [7, 8]
    captured = capture(model, TOK, src, tgt)
    with torch.no_grad():
        model.encoder[1].self_attn.w_v.weight[8:16] += 1e-3  # head 1's V columns
    steps = head_steps(model, captured, "encoder", 1, 1, labels(4), labels(4))
    assert steps.failures()[0] == "v" and "q" not in steps.failures()
    assert head_steps(model, captured, "encoder", 1, 0, labels(4), labels(4)).failures() == ["heads", "sublayer"]


def test_a_fully_masked_row_gives_zeros():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8))
    w = [rng.normal(size=(8, 4)) if i % 2 == 0 else rng.normal(size=4) for i in range(6)]
    mask = np.array([[True, False, True], [False, False, False], [True, True, True]])
    steps = textbook_head(x, x, *w, mask)
    assert (steps["weights"][1] == 0).all() and (steps["output"][1] == 0).all()
    assert not np.isnan(steps["weights"]).any()
    assert steps["weights"][0, 1] == 0 and math.isclose(steps["weights"][0].sum(), 1.0)


def test_a_larger_temperature_flattens_the_query_row():
    model = random_model()
    src, tgt = [5, 9, 3, 17, 22, 2], [7, 8, 30]
    temperatures = [0.25, 0.5, 1.0, 2.0, 4.0]
    for kind, query in (("encoder", 2), ("decoder", 3), ("cross", 1)):
        rows = [
            head_steps(model, capture(model, TOK, src, tgt, t), kind, 0, 1, labels(6), labels(6), t).steps["weights"]
            for t in temperatures
        ]
        entropies = [entropy(w[query]) for w in rows]
        assert all(a < b for a, b in zip(entropies, entropies[1:])), (kind, entropies)
        assert max(rows[0][query]) > max(rows[-1][query])  # the largest weight shrinks as T grows


def test_cut_marker_for_long_sentences():
    assert _cut_labels(labels(25), 0, 20)[-1] == "… 5 cut"
    assert _cut_labels(labels(10), 0, 10) == labels(10)
    model = random_model()
    src = list(range(3, 30)) + [2]  # 28 pieces
    captured = capture(model, TOK, src, [7, 8])
    steps = head_steps(model, captured, "encoder", 0, 0, labels(28), labels(28))
    fig = flow_figure(steps, query=25)
    rows = [t.get_text() for t in fig.axes[0].get_yticklabels()]  # Q's rows: the query stays in view
    assert rows[0] == "… 6 cut" and rows[1] == "t6" and rows[-2:] == ["t25", "… 2 cut"] and len(rows) == 22
    keys = [t.get_text() for t in fig.axes[3].get_xticklabels()]  # the scores' columns
    assert keys[0] == "t0" and keys[-1] == "… 8 cut"
    fig = flow_figure(steps, query=3)
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]  # Q's rows
    assert ticks[0] == "t0" and ticks[-2:] == ["t19", "… 8 cut"]


def readme_snippet() -> str:
    """The NumPy lines that docs/attention.md shows for --npz (an indented block in a list item)."""
    text = (ROOT / "docs" / "attention.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    found = [textwrap.dedent(b) for b in blocks if 'np.load("head.npz")' in b]
    assert len(found) == 1, "docs/attention.md shows the NumPy snippet for --npz once"
    return found[0]


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_the_readme_numpy_snippet_reproduces_the_head(kind, tmp_path, monkeypatch, capsys):
    model = random_model()
    src, tgt = [5, 9, 3, 17, 2], [7, 8, 30]
    captured = capture(model, TOK, src, tgt)
    t_q, t_k = captured[kind, 1].weights.shape[-2:]
    steps = head_steps(model, captured, kind, 1, 2, labels(t_q), labels(t_k))
    monkeypatch.chdir(tmp_path)
    save_npz(steps, "head.npz")
    namespace: dict = {}
    exec(readme_snippet(), namespace)  # noqa: S102 - the README's own lines, as a reader runs them
    assert capsys.readouterr().out.strip()  # it prints its differences
    model_weights = captured[kind, 1].weights[2].numpy()
    model_output = captured[kind, 1].output[2].numpy()
    assert np.abs(namespace["weights"] - model_weights).max() <= 1e-5
    assert np.abs(namespace["output"] - model_output).max() <= 1e-5 * max(1, np.abs(model_output).max())


def test_explain_on_a_trained_model(toy_run, tmp_path, capsys):
    args = ["attention", "--model", str(toy_run), "--src", "the big dog sees a red bird", "--explain"]
    for kind in ("encoder", "decoder", "cross"):
        out = tmp_path / f"{kind}.svg"
        assert main([*args, "--kind", kind, "--layer", "1", "--head", "1", "--query", "2", "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        numbers = [line.split()[1:] for line in printed.splitlines() if line.startswith("1.")]
        assert numbers == [["tokens"]]
        for heading in ("2. x:", "3. this head's projections", "4. scores = Q·Kᵀ", "5. weights = softmax",
                        "6. head output", "7. all", "8. every step"):  # fmt: skip
            assert heading in printed
        assert printed.index("4. scores") < printed.index("5. weights") < printed.index("8. every step")
        assert printed.count("  ok") == len(lesson_mod.CHECKED) and "ABOVE" not in printed
        root = ET.parse(out).getroot()  # the SVG parses
        text = "".join(root.itertext())
        for label in ("Q·Kᵀ", "/ √d_k·T", "mask", "softmax", "· V", "weights = softmax(masked)"):
            assert label in text, label
    assert main([*args, "--kind", "decoder", "--query", "3", "--temperature", "0.5", "1", "2"]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("under each temperature") :].splitlines()[2:5]
    temps, entropies = zip(*[(float(r.split()[0]), float(r.split()[1])) for r in table])
    assert temps == (0.5, 1.0, 2.0) and entropies[0] < entropies[1] < entropies[2]
    npz, page = tmp_path / "head.npz", tmp_path / "flow.html"
    assert main([*args, "--kind", "cross", "--npz", str(npz), "--out", str(page), "--tgt", "dribo dero"]) == 0
    a = np.load(npz)
    assert a["x_q"].dtype == np.float32 and a["w_q"].shape == (a["x_q"].shape[1], int(a["d_k"]))
    assert a["mask"].dtype == bool and list(a["cols"])[-1] == "</s>"
    html = page.read_text()
    assert "renderSteps(" in html and "http" not in html.split("<script>")[1]


def test_explain_checks_fail_with_the_step_named(toy_run, monkeypatch, capsys):
    def wrong(*args, **kwargs):  # forgets to divide by sqrt(d_k)
        steps = textbook_head(*args, **kwargs)
        steps["scaled"] = steps["scores"]
        return steps

    monkeypatch.setattr(lesson_mod, "textbook_head", wrong)
    assert main(["attention", "--model", str(toy_run), "--src", "the dog", "--explain", "--kind", "encoder"]) == 1
    captured = capsys.readouterr()
    assert "step 'scaled' differs from the model's forward pass" in captured.err
    assert "ABOVE THE TOLERANCE" in captured.out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--query", "40"], "--query 40 out of range: the source has"),
        (["--query", "-1"], "--query -1 out of range"),
        (["--kind", "cross", "--query", "30"], "--query 30 out of range: cross attention here has"),
        (["--head", "9"], "--head 9 out of range"),
        (["--layer", "5", "--kind", "decoder"], "--layer 5 out of range"),
        (["--temperature", "1", "0"], "--temperature must be between 0.01 and 100, got 0"),
        (["--temperature", "nan"], "--temperature must be between 0.01 and 100, got nan"),
        (["--out", "flow.jpg"], "--out flow.jpg: with --explain use a .png, .svg, .pdf or .html"),
        (["--npz", "head.txt"], "--npz head.txt: use a .npz file name"),
        (["--kind", "all"], "--explain follows one kind"),
        (["--stats"], "--stats does not go with --explain"),
    ],
)
def test_explain_bad_options_are_one_line_errors(toy_run, tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.chdir(tmp_path)
    args = ["attention", "--model", str(toy_run), "--src", "the big dog", "--explain", "--kind", "encoder"]
    assert main([*args, *extra]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "1. tokens" not in captured.out and not list(tmp_path.iterdir())


def test_options_of_explain_alone_are_refused_without_it(toy_run, capsys):
    base = ["attention", "--model", str(toy_run), "--src", "the dog"]
    assert main([*base, "--stats", "--temperature", "1", "2"]) == 1
    assert "several --temperature values go with --explain" in capsys.readouterr().err
    assert main([*base, "--stats", "--npz", "h.npz"]) == 1
    assert "--npz goes with --explain" in capsys.readouterr().err


def test_the_explorer_page_carries_every_heads_steps(toy_run, tmp_path):
    page = tmp_path / "a.html"
    assert main(["attention", "--model", str(toy_run), "--src", "the big dog", "--html", str(page)]) == 0
    html = page.read_text()
    data = re.search(r'renderExplorer\(document.getElementById\("explorer"\), (.*)\);\n', html).group(1)
    import json

    data = json.loads(data.replace("<\\/", "</"))
    model, _, _ = load(toy_run, fast=False)
    for kind in ("encoder", "decoder", "cross"):
        steps = data[kind]["steps"]
        assert len(steps["layers"]) == len(data[kind]["layers"])
        assert len(steps["layers"][0]) == model.cfg.n_heads
        q = steps["layers"][0][0]["q"]
        assert q["shape"] == [len(steps["rows"]), model.cfg.d_model // model.cfg.n_heads]
        n_layers = model.cfg.enc_layers if kind == "encoder" else model.cfg.dec_layers
        assert len(data[kind]["stats"]) == n_layers * model.cfg.n_heads  # the per-head table
    assert "function renderSteps" in html
