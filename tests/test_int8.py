"""--dtype int8 (mt/decode/int8.py) on a trained toy model: the output projection alone, and every product."""

import copy
import pickle

import sacrebleu
import torch
from conftest import mt_cmd, run_command

from mt.cli.main import main
from mt.decode.inference import load
from mt.decode.int8 import Int8Linear, Int8StackedProduct, Int8Transformer, quantize, quantize_rows
from mt.decode.translator import Translator

# BLEU that int8 may cost on the toy test set: its 100 sentences score ~86, and
# one translation changed by int8 rounding moves that by ~0.3
TOLERANCE = 2.0


def _assert_keeps_its_bleu(fp32: list[str], int8: list[str], refs: list[str]) -> None:
    fp32_bleu = sacrebleu.corpus_bleu(fp32, [refs]).score
    int8_bleu = sacrebleu.corpus_bleu(int8, [refs]).score
    assert sum(a != b for a, b in zip(int8, fp32)) <= 10  # of 100 sentences
    assert fp32_bleu > 80 and int8_bleu >= fp32_bleu - TOLERANCE, (fp32_bleu, int8_bleu)


def test_rows_are_quantized_to_within_half_a_step():
    w = torch.randn(50, 16) * torch.logspace(-3, 1, 50)[:, None]  # rows of very different sizes
    int8, scales = quantize_rows(w)
    assert int8.dtype == torch.int8 and int8.abs().max() == 127
    assert ((int8.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()


def test_the_output_projection_in_int8_keeps_the_logits_close_and_the_bleu(toy_run, toy_data):
    from mt.data.batches import Split

    test = Split(toy_data / "test")
    model, tok, _ = load(toy_run)
    states = torch.randn(3, 5, model.cfg.d_model)
    with torch.inference_mode():
        want = model.project(states)
        fp32 = Translator(model, tok, beam=5, workers=1).translate(test.src_text)
        quantize(model, layers=False)
        got = model.project(states)
        int8 = Translator(model, tok, beam=5, workers=1).translate(test.src_text)
    assert any(isinstance(m, Int8Transformer) for m in model.modules())
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # a per-row int8 weight, per-call int8 states
    _assert_keeps_its_bleu(fp32, int8, test.tgt_text)


def test_every_product_in_int8_keeps_the_logits_close_and_the_bleu(toy_run, toy_data):
    """What --dtype int8 does on a CPU with VNNI, tested on any CPU (it is only slower without)."""
    from mt.data.batches import Split

    test = Split(toy_data / "test")
    model, tok, _ = load(toy_run)
    src, tgt = torch.randint(4, model.cfg.src_vocab_size, (3, 7)), torch.randint(4, model.cfg.tgt_vocab_size, (3, 6))
    with torch.inference_mode():
        want = model(src, tgt)
        fp32 = Translator(model, tok, beam=5, workers=1).translate(test.src_text)
        quantize(model, layers=True)
        got = model(src, tgt)
        int8 = Translator(model, tok, beam=5, workers=1).translate(test.src_text)
        copied = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]  # mt serve's workers get a pickle
        assert all(torch.equal(m(src, tgt), got) for m in copied)  # each makes its own int8 weights, the same
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    stacked = [m.w_qkv for m in model.modules() if hasattr(m, "w_qkv")]  # the fast path's Q/K/V products
    assert stacked and all(isinstance(w, Int8StackedProduct) for w in stacked)
    assert model.int8 == "layers and output"
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # every layer's inputs rounded to 8 bits
    _assert_keeps_its_bleu(fp32, int8, test.tgt_text)


def test_the_commands_decode_in_int8_on_the_cpu_only(toy_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("the big dog sees a red bird\na cat runs\n")
    done = run_command(mt_cmd("translate", "--model", str(toy_run), "-i", str(src), "--dtype", "int8"), check=True)
    model, tok, _ = load(toy_run)
    quantize(model)  # what the command does, in this process
    assert done.stdout.splitlines() == Translator(model, tok, beam=5).translate(src.read_text().splitlines())
    assert main(["evaluate", "--model", str(toy_run), "--split", "test", "--dtype", "int8", "--json"]) == 0
    assert '"dtype": "int8"' in capsys.readouterr().out
    assert (toy_run / "eval" / "test.beam5.int8.json").exists()  # kept apart from the float32 scores
    assert main(["translate", "--model", str(toy_run), "-i", str(src), "--dtype", "int8", "--device", "cuda"]) == 1
    assert "--dtype int8 decodes on the CPU" in capsys.readouterr().err
