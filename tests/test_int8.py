"""--dtype int8: the output projection in int8 (mt/int8.py) on a trained toy model."""

import sacrebleu
import torch
from conftest import mt_cmd, run_command

from mt.cli import main
from mt.inference import Translator, load
from mt.int8 import Int8OutputProjection, quantize, quantize_rows


def test_rows_are_quantized_to_within_half_a_step():
    w = torch.randn(50, 16) * torch.logspace(-3, 1, 50)[:, None]  # rows of very different sizes
    int8, scales = quantize_rows(w)
    assert int8.dtype == torch.int8 and int8.abs().max() == 127
    assert ((int8.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()


def test_int8_logits_are_close_and_translations_keep_their_bleu(toy_run, toy_data):
    from mt.data import Split

    test = Split(toy_data / "test")
    model, tok, _ = load(toy_run)
    states = torch.randn(3, 5, model.cfg.d_model)
    with torch.inference_mode():
        want = model.project(states)
        fp32 = Translator(model, tok, beam=5, workers=1).translate(test.src_text)
        quantize(model)
        got = model.project(states)
        int8 = Translator(model, tok, beam=5, workers=1).translate(test.src_text)
    assert any(isinstance(m, Int8OutputProjection) for m in model.modules())
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # a per-row int8 weight, per-call int8 states
    fp32_bleu = sacrebleu.corpus_bleu(fp32, [test.tgt_text]).score
    int8_bleu = sacrebleu.corpus_bleu(int8, [test.tgt_text]).score
    assert fp32_bleu > 80 and int8_bleu >= fp32_bleu - 1.0, (fp32_bleu, int8_bleu)  # the stated tolerance: 1 BLEU


def test_the_commands_decode_in_int8_on_the_cpu_only(toy_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("the big dog sees a red bird\na cat runs\n")
    done = run_command(mt_cmd("translate", "--model", str(toy_run), "-i", str(src), "--dtype", "int8"), check=True)
    assert len(done.stdout.splitlines()) == 2 and all(done.stdout.splitlines())
    assert main(["evaluate", "--model", str(toy_run), "--split", "test", "--dtype", "int8", "--json"]) == 0
    assert '"dtype": "int8"' in capsys.readouterr().out
    assert (toy_run / "eval" / "test.beam5.int8.json").exists()  # kept apart from the float32 scores
    assert main(["translate", "--model", str(toy_run), "-i", str(src), "--dtype", "int8", "--device", "cuda"]) == 1
    assert "--dtype int8 decodes on the CPU" in capsys.readouterr().err
