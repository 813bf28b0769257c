"""mt export --to hf: every architecture option loads in transformers (Blenderbot for
pre-LN, Marian for post-LN) and scores as mt does; generate() and pipeline() translate
as mt translate does; what no architecture holds is refused by name."""

import json
import os

import numpy as np
import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("MT_REQUIRE_EXTRAS") == "1":  # CI: the dev extras are installed, so this must run
        raise
    pytest.skip("the hf extra: pip install -e '.[hf]'", allow_module_level=True)

from conftest import ARCHITECTURE_OPTIONS, mt_cmd, option_id, perturbed_model, run_command  # noqa: E402
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline  # noqa: E402
from transformers.pipelines import SUPPORTED_TASKS  # noqa: E402

from mt.config import ModelConfig  # noqa: E402
from mt.decode.inference import export_model, load  # noqa: E402
from mt.decode.translator import Translator  # noqa: E402
from mt.errors import MTError  # noqa: E402
from mt.export.hf import export_hf, hf_model, translate_hf  # noqa: E402

SENTENCES = ["the big dog sees a red bird", "a cat runs", "the small bird sees the big cat", "dogs run"]


@pytest.fixture(scope="module")
def exported(toy_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "toy_hf"
    check = export_hf(toy_run, out)
    return out, check


@pytest.mark.parametrize(
    "option",
    [
        *ARCHITECTURE_OPTIONS,
        {"norm_first": False, "tie_output": False},  # Marian: shared embeddings, its own output projection
        {"norm_first": False, "share_embeddings": False},  # Marian: the output tied to the target side
    ],
    ids=option_id,
)
def test_every_architecture_option_exports_exactly(toy_run, tmp_path, option):
    """transformers' log-probability of each target token, given the source and the tokens
    before it, equals mt's to 1e-4, through the saved directory and AutoModelForSeq2SeqLM."""
    _, tok, meta = load(toy_run, fast=False)
    base = meta["model"] | {"d_model": 32, "n_heads": 4, "enc_layers": 2, "dec_layers": 3, "d_ff": 48}
    model = perturbed_model(ModelConfig(**(base | option)))
    run = tmp_path / "run"
    run.mkdir()
    export_model(model, toy_run, run)
    out = tmp_path / "hf"
    export_hf(run, out)
    hf = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(hf).__name__ == ("BlenderbotForConditionalGeneration" if model.cfg.norm_first else "MarianMTModel")

    src = tok.encode_src(["the big dog sees a red bird", "a cat runs"])
    tgt = tok.encode_tgt(["der große hund sieht einen roten vogel", "eine katze läuft"])
    for s, t in zip(src, tgt):
        with torch.no_grad():
            inp = torch.tensor([[tok.bos_id, *t]])
            ours = torch.log_softmax(model(torch.tensor([s]), inp)[0].float(), -1)
            theirs = torch.log_softmax(hf(input_ids=torch.tensor([s]), decoder_input_ids=inp).logits[0].float(), -1)
        targets = torch.tensor([*t, tok.eos_id])
        np.testing.assert_allclose(
            theirs.gather(1, targets[:, None]).numpy(), ours.gather(1, targets[:, None]).numpy(), atol=1e-4, rtol=0
        )


def test_generate_translates_as_mt_does(toy_run, exported, toy_test_lines):
    out, check = exported
    assert check["same"] == check["sentences"] and check["first_difference"] is None
    model, tok, _ = load(toy_run)
    lines = toy_test_lines + SENTENCES
    for beam in (1, 5):
        ours = Translator(model, tok, beam=beam, workers=1, loop_margin=None).translate(lines)
        theirs = translate_hf(out, lines, beam=beam)
        assert theirs == ours, [(a, b) for a, b in zip(ours, theirs) if a != b][:3]


@pytest.mark.skipif(
    "translation" not in SUPPORTED_TASKS,
    reason="transformers 5 removed pipeline('translation'); generate() is tested above, the pipeline with "
    "transformers 4 (docs/results/export.md)",
)
def test_the_translation_pipeline_translates_as_mt_does(toy_run, exported):
    model, tok, _ = load(toy_run)
    ours = Translator(model, tok, beam=5, workers=1, loop_margin=None).translate(SENTENCES)
    translate = pipeline("translation", model=str(exported[0]))
    # the pipeline's own default (beam 4) overrides the export's generation config: beam 5 is asked for
    assert [r["translation_text"] for r in translate(SENTENCES, num_beams=5)] == ours


def test_the_tokenizer_encodes_as_mt_does(toy_run, exported, toy_test_lines):
    _, tok, _ = load(toy_run)
    tokenizer = AutoTokenizer.from_pretrained(exported[0])
    lines = [*toy_test_lines, "  two  spaces ", "Ünïcödé “quotes” … 😀", "x_y"]
    assert [tokenizer(line).input_ids for line in lines] == tok.encode_src(lines)
    assert set(tokenizer(lines[0])) == {"input_ids", "attention_mask"}  # what generate() takes, in transformers 4 too
    info = json.loads((exported[0] / "mt_export.json").read_text())
    assert info["format"] == "hf" and info["architecture"] == "BlenderbotForConditionalGeneration"


def test_what_no_architecture_holds_is_refused_by_name(toy_run):
    model, tok, _ = load(toy_run, fast=False)
    model.cfg.norm_first, model.cfg.positional = False, "learned"  # past the config's own checks
    with pytest.raises(MTError, match="model.positional=learned with model.norm_first=false"):
        hf_model(model, tok)
    model.cfg.activation = "swish"
    with pytest.raises(MTError, match="model.activation='swish'"):
        hf_model(model, tok)


def test_export_hf_command(toy_run, tmp_path):
    out = tmp_path / "hf"
    result = run_command(mt_cmd("export", "--model", str(toy_run), "--to", "hf", str(out)), timeout=600)
    assert result.returncode == 0, result.stderr
    assert "(transformers)" in result.stdout and "check: 6 of 6" in result.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
        assert (out / name).exists(), name
    refused = run_command(mt_cmd("export", "--model", str(toy_run), "--to", "hf", str(out), "--quantization", "int8"))
    assert refused.returncode != 0 and "--quantization is for --to ct2 and argos" in refused.stderr
