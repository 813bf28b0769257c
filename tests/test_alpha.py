"""A model's length penalty chosen on validation (mt choose-alpha, train.choose_alpha):
the choice is the alpha of highest BLEU as mt evaluate scores it, it becomes the
model's default wherever it decodes, and an explicit --alpha still wins."""

import json
import shutil

import pytest
from conftest import train_args

from mt.cli.main import main
from mt.config import DECODING
from mt.decode.inference import DecodingOptions, default_alpha, open_translator


@pytest.fixture
def run(toy_run, tmp_path):
    """A copy of the toy run (its model.json is rewritten), without the checkpoints."""
    copy = tmp_path / "run"
    shutil.copytree(toy_run, copy, ignore=shutil.ignore_patterns("checkpoints", "eval"))
    return copy


def decoding(run_dir):
    return json.loads((run_dir / "model.json").read_text()).get("decoding")


def test_the_chosen_alpha_scores_highest_and_becomes_the_default(run, capsys):
    alphas = ["0", "1", "4"]
    assert main(["choose-alpha", "--model", str(run), "--alphas", *alphas]) == 0
    assert "written to" in capsys.readouterr().out
    chosen = decoding(run)
    assert chosen["chosen_on"] == "val" and chosen["beam"] == DECODING.beam and list(chosen["bleu"]) == alphas
    # each alpha's BLEU is what mt evaluate reports for it
    for alpha in alphas:
        assert main(["evaluate", "--model", str(run), "--split", "val", "--alpha", alpha, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(chosen["bleu"][alpha], abs=0.01)
    best = max(chosen["bleu"].values())
    assert chosen["alpha"] == min(float(a) for a, score in chosen["bleu"].items() if score == best)
    # the default from now on: evaluate writes it under the plain name, another alpha beside it
    assert main(["evaluate", "--model", str(run), "--split", "val", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["alpha"] == chosen["alpha"]
    assert json.loads((run / "eval" / "val.beam5.json").read_text())["alpha"] == chosen["alpha"]
    other = next(a for a in (0.25, 5.0) if a != chosen["alpha"])
    assert main(["evaluate", "--model", str(run), "--split", "val", "--alpha", str(other)]) == 0
    assert json.loads((run / "eval" / f"val.beam5.alpha{other:g}.json").read_text())["alpha"] == other


def test_where_the_default_comes_from(run, toy_run):
    assert default_alpha([toy_run]) == DECODING.alpha  # none chosen
    meta = json.loads((run / "model.json").read_text())
    for written, read in ((2.5, 2.5), (3, 3.0), ("2", DECODING.alpha), (-1, DECODING.alpha), (True, DECODING.alpha)):
        (run / "model.json").write_text(json.dumps({**meta, "decoding": {"alpha": written}}))
        assert default_alpha([run]) == read, written
    (run / "model.json").write_text(json.dumps({**meta, "decoding": {"alpha": 2.5}}))
    assert open_translator([run], DecodingOptions())[0].alpha == 2.5
    assert open_translator([run], DecodingOptions(alpha=0.6))[0].alpha == 0.6  # --alpha wins
    assert default_alpha([run, toy_run]) == DECODING.alpha  # an ensemble: each member's was its own


def test_exports_decode_with_the_chosen_alpha(run, tmp_path):
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    meta = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**meta, "decoding": {"alpha": 2.5}}))
    assert main(["export", "--model", str(run), "--to", "ct2", str(tmp_path / "ct2")]) == 0
    assert default_alpha([tmp_path / "ct2"]) == 2.5
    assert open_translator([tmp_path / "ct2"], DecodingOptions())[0].alpha == 2.5
    assert main(["export", "--model", str(run), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["length_penalty"] == 2.5
    assert "length_penalty=2.5" in (tmp_path / "hf" / "README.md").read_text()


def test_training_can_choose_it(toy_data, tmp_path, capsys):
    run = tmp_path / "r"
    assert main(train_args(toy_data, run, "train.max_steps=20", "train.choose_alpha=true")) == 0
    chosen = decoding(run)
    assert [float(a) for a in chosen["bleu"]] == list(DECODING.choose_alphas)
    assert f"length penalty {chosen['alpha']:g}: the highest BLEU on val" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--alphas", "11"], "length penalty 11.0: must be between 0 and 10"), (["--beam", "0"], "--beam must be")],
)
def test_choose_alpha_errors(run, capsys, args, message):
    assert main(["choose-alpha", "--model", str(run), *args]) == 1
    assert message in capsys.readouterr().err
