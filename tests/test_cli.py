"""translate, evaluate and attention on a trained toy model."""

import copy
import itertools
import math
import os
import re
import signal
import subprocess
import threading

import pytest
import torch
from conftest import ROOT, mt_cmd, run_command, train_args, wait_for

import mt.decode.translator
from mt.cli.main import main
from mt.data.batches import Split
from mt.decode.inference import decoding_dtype, load
from mt.decode.translator import Translator, decoding_workers
from mt.evaluate.metrics import bleu
from mt.inspect.capture import alignment, force_decode, pharaoh, translate_with_attention
from mt.inspect.plotting import heatmap_grid, save_figure
from mt.textio import atomic_output, new_file_mode


@pytest.fixture(scope="module")
def toy_model(toy_run):
    return load(toy_run)


@pytest.fixture(scope="module")
def toy_test(toy_data):
    s = Split(toy_data / "test")
    return s.src_text, s.tgt_text


def test_translations_are_good_and_beam_matches_batching(toy_model, toy_test):
    model, tok, _ = toy_model
    src, ref = toy_test
    hyps = Translator(model, tok, beam=5).translate(src)
    assert bleu(hyps, ref).score > 80
    one_by_one = [Translator(model, tok, beam=5).translate([s])[0] for s in src[:10]]
    assert one_by_one == hyps[:10]


@pytest.mark.parametrize("beam", [1, 3])
def test_workers_decode_batches_in_threads_with_the_same_output(toy_model, toy_test, monkeypatch, beam):
    """Two workers: the batches run in two threads with one intra-op thread
    each, the output is what one worker gives, in order (empty lines too),
    and the process's thread count is what it was."""
    model, tok, _ = toy_model
    src = toy_test[0][:150]
    src = src[:7] + [""] + src[7:]
    seen = []
    search = "greedy_search" if beam == 1 else "beam_search"
    original = getattr(mt.decode.translator, search)

    def spy(*args, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return original(*args, **kwargs)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = Translator(model, tok, beam=beam, batch_size=16, workers=1).translate(src)
        monkeypatch.setattr(mt.decode.translator, search, spy)
        two = Translator(model, tok, beam=beam, batch_size=16, workers=2).translate(src)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert two == one and one[7] == ""
    assert len(seen) == math.ceil(sum(map(bool, src)) / 16) > 2  # one search per batch of 16
    assert {n for n, _ in seen} <= {"mt-decode_0", "mt-decode_1"} and len({n for n, _ in seen}) == 2
    assert {k for _, k in seen} == {1}


def test_a_failing_worker_raises_and_restores_the_thread_count(toy_model, toy_test, monkeypatch):
    model, tok, _ = toy_model

    def broken(*args, **kwargs):
        raise RuntimeError("search failed")

    monkeypatch.setattr(mt.decode.translator, "greedy_search", broken)
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="search failed"):
        Translator(model, tok, beam=1, batch_size=4, workers=2).translate(toy_test[0][:20])
    assert torch.get_num_threads() == threads


def test_decoding_workers_default():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert decoding_workers(None, cpu) == 2
        assert decoding_workers(None, gpu) == 1  # batches would only queue on one stream
        assert decoding_workers(3, gpu) == 3  # as asked
        torch.set_num_threads(1)
        assert decoding_workers(None, cpu) == 1
    finally:
        torch.set_num_threads(threads)


def test_decoding_dtype_and_bfloat16_translations(toy_model, toy_test):
    cpu = torch.device("cpu")
    assert decoding_dtype("float32", cpu) == torch.float32
    assert decoding_dtype("bfloat16", cpu) == torch.bfloat16
    assert decoding_dtype("auto", cpu) == torch.float32
    model, tok, _ = toy_model
    src, ref = toy_test
    fp32 = Translator(model, tok, beam=5).translate(src[:100])
    bf16 = Translator(copy.deepcopy(model).to(torch.bfloat16), tok, beam=5).translate(src[:100])
    assert bleu(bf16, ref[:100]).score > 80
    assert sum(a == b for a, b in zip(fp32, bf16)) >= 90  # bfloat16 rounding may flip a few close calls


@pytest.mark.parametrize("slow", [True, False])
def test_translate_warns_of_bfloat16_on_a_cpu_without_it(toy_run, toy_test, tmp_path, capsys, monkeypatch, slow):
    monkeypatch.setattr("mt.hardware.bf16_speedup", lambda n: 0.01 if slow else 1.5)
    (tmp_path / "in.txt").write_text("\n".join(toy_test[0][:3]) + "\n")
    assert main(["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "--dtype", "bfloat16"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 3
    assert ("--dtype bfloat16: this CPU has no fast bfloat16 products" in captured.err) == slow


def test_translate_cli_one_line_per_line(toy_run, toy_model, toy_test, tmp_path, capsys):
    model, tok, _ = toy_model
    src = toy_test[0][:20]
    lines = src[:5] + [""] + src[5:]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    assert (
        main(["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt")])
        == 0
    )
    out = (tmp_path / "out.txt").read_text().split("\n")[:-1]
    assert len(out) == len(lines) and out[5] == ""
    assert out[:5] + out[6:] == Translator(model, tok, beam=5).translate(src)

    assert (
        main(["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "--beam", "3", "--n-best", "2"])
        == 0
    )
    nbest = capsys.readouterr().out.splitlines()
    assert len(nbest) == 2 * len(lines)
    assert all(re.fullmatch(r"\d+ \|\|\| .* \|\|\| -?\d+\.\d+", x) for x in nbest)
    assert [int(x.split()[0]) for x in nbest] == [i for i in range(len(lines)) for _ in range(2)]


def test_translate_stdin_to_stdout(toy_run, toy_test):
    src = toy_test[0][:3]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = run_command(
        mt_cmd("translate", "--model", str(toy_run), "--beam", "1", "--scores"),
        input="\n".join(src) + "\n", env=env, check=True,
    )  # fmt: skip
    rows = res.stdout.splitlines()
    assert len(rows) == 3 and all(len(r.split("\t")) == 2 and float(r.split("\t")[1]) <= 0 for r in rows)


def test_output_closed_early_is_not_a_traceback(toy_run, toy_test, tmp_path, children):
    """`mt translate ... | head -1`: the reader goes away, mt stops quietly (exit 128 + SIGPIPE)."""
    # 5,000 lines: more output than a pipe holds, so mt cannot finish before the reader leaves
    (tmp_path / "in.txt").write_text("\n".join(toy_test[0] * 50) + "\n")
    with open(tmp_path / "in.txt") as stdin:
        proc = children(
            mt_cmd("translate", "--model", str(toy_run), "--beam", "1"),
            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout.readline().strip()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait() == 141 and "Traceback" not in err, err


def test_streaming_does_not_read_all_input_first(toy_model):
    model, tok, _ = toy_model
    endless = itertools.cycle(["the cat runs", "a dog"])
    first = list(itertools.islice(Translator(model, tok, beam=1).stream(endless, chunk=4), 6))
    assert len(first) == 6


def test_bad_input_is_a_clear_error_and_leaves_no_output(toy_run, tmp_path, capsys):
    (tmp_path / "in.txt").write_bytes(b"the cat\nthe dog\nbad \xfe\n")
    out = tmp_path / "out.txt"
    assert main(["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "-o", str(out)]) == 1
    assert "in.txt:3: invalid UTF-8" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".out.txt*"))


def test_unwritable_output_is_a_clear_error(toy_run, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("the cat\n")
    (tmp_path / "afile").write_text("")
    args = ["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "-o"]
    for nested in (("out.txt",), ("sub", "out.txt")):  # the file in the way is named, however deep
        assert main([*args, str(tmp_path.joinpath("afile", *nested))]) == 1
        assert f"{tmp_path / 'afile'} is not a directory" in capsys.readouterr().err
    assert main([*args, str(tmp_path)]) == 1
    assert "is a directory, not an output file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in.txt"]


def test_bad_search_options_are_named(toy_run, capsys):
    bad = [
        (["--beam", "0"], "--beam must be at least 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--workers", "0"], "--workers must be at least 1, got 0"),
        (["--n-best", "6"], "--n-best must be"),
        (["--device", "tpu"], "--device tpu: not a device name"),
        (["--device", "meta"], "--device meta: mt decodes on cpu or cuda"),
        (["--device", "cuda:99"], "--device cuda:99: "),  # no GPU, or not that many
        (["--alpha", "nan"], "--alpha must be between 0 and 10.0, got nan"),
        (["--max-len-a", "-1"], "--max-len-a -1.0 --max-len-b 10: the output length limit"),
        (["--max-len-a", "0", "--max-len-b", "0"], "needs a >= 0, b >= 0, not both 0"),
    ]
    for opts, message in bad:
        assert main(["translate", "--model", str(toy_run), *opts]) == 1
        assert message in capsys.readouterr().err


def test_atomic_output_on_interrupt(tmp_path):
    with pytest.raises(KeyboardInterrupt), atomic_output(tmp_path / "o.txt") as f:
        f.write("partial\n")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_outputs_get_the_permissions_of_files_written_in_place(toy_run, tmp_path):
    """Temporary files are created 0o600; the renamed output must not keep
    that: a new file follows the umask, a replaced file keeps its mode."""
    umask = os.umask(0o027)
    try:
        assert new_file_mode() == 0o640
        with atomic_output(tmp_path / "new.txt") as f:
            f.write("x\n")
        assert (tmp_path / "new.txt").stat().st_mode & 0o7777 == 0o640
        (tmp_path / "old.txt").write_text("old\n")
        (tmp_path / "old.txt").chmod(0o604)
        with atomic_output(tmp_path / "old.txt") as f:
            f.write("new\n")
        assert (tmp_path / "old.txt").stat().st_mode & 0o7777 == 0o604
        assert (tmp_path / "old.txt").read_text() == "new\n"
    finally:
        os.umask(umask)
    # the run directory's inference model, exported by training under this session's umask
    for name in ("model.safetensors", "model.json"):
        assert (toy_run / name).stat().st_mode & 0o7777 == new_file_mode(), name


def _run_on_a_terminal(proc_args: list[str], children, timeout: float = 600) -> tuple[int, str]:
    """``proc_args`` run with its stdout and stderr on a pseudo-terminal: (exit status, what it showed)."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    proc = children(proc_args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
    return proc.wait(timeout=60), shown.decode("utf-8", "replace")


def test_a_file_written_from_a_terminal_shows_its_progress(toy_run, toy_test, tmp_path, children):
    """On a terminal, lines done of the file's total, lines/s (and the time left while running)
    on stderr; through pipes, nothing but the translations."""
    lines = toy_test[0] * 6
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    args = mt_cmd("translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt"),
                  "--beam", "1")  # fmt: skip
    status, shown = _run_on_a_terminal(args, children)
    assert status == 0, shown
    assert f"{len(lines):,} of {len(lines):,} lines (100%)" in shown and "lines/s" in shown
    assert len((tmp_path / "out.txt").read_text().splitlines()) == len(lines)
    piped = run_command(args, timeout=600, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert piped.returncode == 0 and "lines/s" not in piped.stderr


def test_ctrl_c_leaves_no_output_file(toy_run, toy_test_lines, tmp_path, children):
    """Interrupted while it writes a file (paragraphs split into sentences, streamed in chunks),
    mt translate stops with status 130 and leaves neither the output nor a temporary file.
    (A subtitle file is written only once all its cues are translated, through the same
    ``atomic_output``: tests/test_cli.py::test_atomic_output_on_interrupt.)"""
    lines = [f"{a}. {b}." for a, b in zip(toy_test_lines, toy_test_lines[1:])] * 400  # minutes of work
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    args = mt_cmd("translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "-o", str(out / "out.txt"),
                  "--split-sentences")  # fmt: skip
    proc = children(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(lambda: any(out.iterdir()), proc, "temporary output file")  # the translation has begun
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=600) == 130, proc.stderr.read().decode()
    assert list(out.iterdir()) == []


def test_count_lines_counts_a_last_line_without_its_newline(tmp_path):
    from mt.cli.progress import count_lines

    for text, lines in (("", 0), ("a\n", 1), ("a\nb", 2), ("a\n\n", 2), ("\n" * 3_000_000, 3_000_000)):
        (tmp_path / "f").write_text(text)
        assert count_lines(tmp_path / "f") == lines
    assert count_lines(tmp_path) is None and count_lines(tmp_path / "none") is None  # a directory, nothing


def test_long_line_with_n_best_is_truncated_with_warning(toy_run, tmp_path, capsys):
    """With --n-best a line is one input: past the model's positions it is truncated, and says so
    (one translation per line is cut into parts instead: tests/test_sentences.py)."""
    (tmp_path / "long.txt").write_text(" ".join(["cat"] * 300) + "\n")
    args = ["translate", "--model", str(toy_run), "-i", str(tmp_path / "long.txt"), "--beam", "2", "--n-best", "2"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "line 1:" in captured.err and "truncated" in captured.err
    assert len(captured.out.splitlines()) == 2


def test_model_directory_errors(toy_run, tmp_path, capsys):
    assert main(["translate", "--model", str(tmp_path / "none")]) == 1
    assert "does not exist" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("model.json", "spm.model"):
        (broken / f).write_bytes((toy_run / f).read_bytes())
    assert main(["translate", "--model", str(broken)]) == 1
    assert "model.safetensors missing" in capsys.readouterr().err
    (broken / "model.safetensors").write_bytes((toy_run / "model.safetensors").read_bytes()[:1000])
    assert main(["translate", "--model", str(broken)]) == 1
    assert "cannot load weights" in capsys.readouterr().err
    (broken / "model.safetensors").write_bytes((toy_run / "model.safetensors").read_bytes())
    (broken / "spm.model").write_bytes((toy_run / "spm.model").read_bytes()[:3000])
    assert main(["translate", "--model", str(broken)]) == 1
    assert f"{broken / 'spm.model'}: unreadable sentencepiece model" in capsys.readouterr().err
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["some other text entirely"] * 50), model_prefix=str(broken / "spm"),
        vocab_size=30, pad_id=0, unk_id=1, bos_id=2, eos_id=3, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    assert main(["translate", "--model", str(broken)]) == 1
    assert "tokenizer does not match the model" in capsys.readouterr().err
    import shutil

    no_config = tmp_path / "no_config"  # a complete model, but no config.yaml to find its test split by
    shutil.copytree(toy_run, no_config, ignore=shutil.ignore_patterns("config.yaml"))
    assert main(["evaluate", "--model", str(no_config), "--split", "test"]) == 1
    assert "config.yaml: missing" in capsys.readouterr().err
    (no_config / "config.yaml").write_text("data: [unclosed\n")
    assert main(["evaluate", "--model", str(no_config), "--split", "test"]) == 1
    assert f"{no_config / 'config.yaml'}: unreadable run config" in capsys.readouterr().err
    (no_config / "config.yaml").write_text("- data\n")
    assert main(["evaluate", "--model", str(no_config), "--split", "test"]) == 1
    assert "config.yaml: the top level must be a mapping of sections, got list" in capsys.readouterr().err


def test_evaluate_writes_scores(toy_run, toy_test, tmp_path, capsys):
    src, ref = toy_test
    (tmp_path / "t.src").write_text("\n".join(src) + "\n")
    (tmp_path / "t.ref").write_text("\n".join(ref) + "\n")
    (tmp_path / "t.tok").write_text("\n".join(r.lower() for r in ref) + "\n")
    args = ["evaluate", "--model", str(toy_run), "--src", str(tmp_path / "t.src"), "--ref", str(tmp_path / "t.ref")]
    assert main([*args, "--paper", "--paper-ref", str(tmp_path / "t.tok"), "--json"]) == 0
    import json

    scores = json.loads(capsys.readouterr().out)
    assert scores["bleu"] > 80 and scores["paper_bleu"] > 80 and scores["chrf"] > 80
    assert scores["bleu_signature"].startswith("nrefs:1")
    assert scores["dtype"] in ("float32", "bfloat16")
    assert scores["workers"] == (2 if torch.get_num_threads() >= 2 else 1)
    seconds, rate = scores["decode_seconds"], scores["sentences_per_s"]  # rounded to 0.001 s and 0.1 /s
    assert len(src) / (seconds + 5e-4) - 0.05 <= rate <= len(src) / max(seconds - 5e-4, 1e-9) + 0.05
    assert (toy_run / "eval" / "t.beam5.json").exists()
    hyp = (toy_run / "eval" / "t.beam5.hyp").read_text().splitlines()
    assert len(hyp) == len(src)
    assert main(["evaluate", "--model", str(toy_run), "--split", "test", "--beam", "1"]) == 0
    assert "BLEU" in capsys.readouterr().out


def test_evaluate_checks_line_counts_before_decoding(toy_run, toy_test, tmp_path, capsys, monkeypatch):
    src, ref = toy_test
    (tmp_path / "a.src").write_text("\n".join(src[:5]) + "\n")
    (tmp_path / "a.ref").write_text("\n".join(ref[:4]) + "\n")
    (tmp_path / "a.tok").write_text("\n".join(ref[:3]) + "\n")
    from mt.decode.translator import Translator

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before the line counts were checked")

    monkeypatch.setattr(Translator, "translate", no_decoding)
    args = ["evaluate", "--model", str(toy_run), "--src", str(tmp_path / "a.src")]
    assert main([*args, "--ref", str(tmp_path / "a.ref")]) == 1
    err = capsys.readouterr().err
    assert "a.src has 5 lines" in err and "a.ref has 4" in err
    (tmp_path / "a.ref").write_text("\n".join(ref[:5]) + "\n")
    assert main([*args, "--ref", str(tmp_path / "a.ref"), "--paper", "--paper-ref", str(tmp_path / "a.tok")]) == 1
    assert "a.tok: 3 lines, expected 5" in capsys.readouterr().err
    assert not (toy_run / "eval" / "a.beam5.json").exists()


def test_weights_during_translation_equal_force_decoding(toy_model, toy_test):
    model, tok, _ = toy_model
    src_ids = tok.encode_src([toy_test[0][0]])[0]
    tgt_ids, captured = translate_with_attention(model, tok, src_ids, max_len=60)
    maps = force_decode(model, tok, src_ids, tgt_ids)
    assert len(captured) == len(maps.cross)
    for a, b in zip(captured, maps.cross):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for kind in ("encoder", "decoder", "cross"):
        rows, cols = maps.axes(kind)
        for w in maps.layers(kind):
            assert w.shape[1:] == (len(rows), len(cols))
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:2]))
    assert torch.all(maps.decoder[0].triu(1) == 0)  # no attention to the future


def test_temperature_direction_on_a_trained_model(toy_model, toy_test):
    model, tok, _ = toy_model
    src_ids = tok.encode_src([toy_test[0][1]])[0]
    tgt_ids = tok.encode_tgt([toy_test[1][1]])[0]

    def entropy(t):
        w = force_decode(model, tok, src_ids, tgt_ids, temperature=t).cross[-1]
        return float(-(w * w.clamp_min(1e-30).log()).sum(-1).mean())

    assert entropy(0.5) < entropy(1.0) < entropy(2.0)
    assert entropy(1000.0) == pytest.approx(math.log(len(src_ids)), rel=1e-2)  # uniform in the limit


def test_alignment_and_plot(toy_model, toy_test, tmp_path):
    model, tok, _ = toy_model
    src_ids = tok.encode_src([toy_test[0][2]])[0]
    tgt_ids = tok.encode_tgt([toy_test[1][2]])[0]
    maps = force_decode(model, tok, src_ids, tgt_ids)
    pairs = alignment(maps, layer=0)
    assert len(pairs) == len(tgt_ids)
    assert all(0 <= s < len(src_ids) - 1 for s, _ in pairs)
    assert re.fullmatch(r"(\d+-\d+ )*\d+-\d+", pharaoh(pairs))
    rows, cols = maps.axes("cross")
    fig = heatmap_grid([[("h0", maps.cross[0][0]), ("h1", maps.cross[0][1])]], rows, cols)
    for ax in fig.axes[:2]:
        assert [t.get_text() for t in ax.get_xticklabels()] == cols
        assert [t.get_text() for t in ax.get_yticklabels()] == rows
    save_figure(fig, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_attention_cli(toy_run, tmp_path, capsys):
    out = tmp_path / "att.png"
    args = ["attention", "--model", str(toy_run), "--src", "the big cat sees a dog", "--kind", "all"]
    assert main([*args, "--out", str(out), "--stats", "--align", "--html", str(tmp_path / "a.html")]) == 0
    printed = capsys.readouterr().out
    for kind in ("encoder", "decoder", "cross"):
        assert (tmp_path / f"att-{kind}.png").exists()
    assert "entropy" in printed and re.search(r"^(\d+-\d+ )*\d+-\d+$", printed, re.M)
    page = (tmp_path / "a.html").read_text()
    assert "<script>" in page and "http" not in page.split("<script>")[1]
    (tmp_path / "s.txt").write_text("the cat\na dog runs\n")
    assert main(["attention", "--model", str(toy_run), "--src-file", str(tmp_path / "s.txt"), "--out", str(out)]) == 0
    assert (tmp_path / "att-0.png").exists() and (tmp_path / "att-1.png").exists()
    assert main(["attention", "--model", str(toy_run), "--src", "cat", "--layer", "9", "--out", str(out)]) == 1
    assert "--layer 9 out of range" in capsys.readouterr().err
    assert main(["attention", "--model", str(toy_run), "--src", "cat", "--head", "x", "--stats"]) == 1
    assert "--head must be an index, 'all' or 'mean'; got 'x'" in capsys.readouterr().err
    for t in ("0", "-1", "nan", "inf"):
        assert main(["attention", "--model", str(toy_run), "--src", "cat", "--stats", "--temperature", t]) == 1
        assert "--temperature must be between 0.01 and 100" in capsys.readouterr().err
    assert main(["attention", "--model", str(toy_run), "--src", "cat", "--align", "--align-layer", "7"]) == 1
    captured = capsys.readouterr()
    assert "--align-layer 7 out of range" in captured.err and "target:" not in captured.out  # before decoding
    (tmp_path / "afile").write_text("")
    for bad in (["--out", str(tmp_path / "afile" / "a.png")], ["--html", str(tmp_path / "afile" / "a.html")]):
        assert main(["attention", "--model", str(toy_run), "--src", "cat", *bad]) == 1
        assert "afile is not a directory" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_paper_text_model_normalises_input_and_scores_lowercase(toy_data, tmp_path, capsys):
    """A model trained with data.text=paper carries the mode in its run
    directory: input is lowercased and tokenized as in training, and its
    (lowercase) output is scored case-insensitively."""
    run_dir, prepared = tmp_path / "paper", tmp_path / "prepared"
    args = train_args(prepared, run_dir, "data.text=paper", "train.max_steps=300")
    assert main(["prepare", "--config", args[2], *args[3:]]) == 0  # the same overrides
    assert main(args) == 0
    assert (run_dir / "text.json").exists()
    model, tok, _ = load(run_dir)
    assert tok.lowercase
    translator = Translator(model, tok, beam=1)
    lines = ["young old tree sleeps", "a young bird jumps cat a big"]
    assert translator.translate([line.upper() for line in lines]) == translator.translate(lines)
    capsys.readouterr()  # what prepare and train printed
    (tmp_path / "t.src").write_text("\n".join(lines) + "\n")
    (tmp_path / "t.ref").write_text("Speelso eerto dloo gnuoyo\nGibo ao taco spmujo dribo gnuoyo ao\n")
    assert main(["evaluate", "--model", str(run_dir), "--src", str(tmp_path / "t.src"),
                 "--ref", str(tmp_path / "t.ref"), "--beam", "1", "--json"]) == 0  # fmt: skip
    import json

    scores = json.loads(capsys.readouterr().out)
    assert "case:lc" in scores["bleu_signature"] and scores["bleu"] > 20  # an untrained model scores ~0


def test_evaluate_keeps_other_decoding_settings_apart(toy_run, toy_test, tmp_path, capsys):
    src, ref = toy_test
    (tmp_path / "v.src").write_text("\n".join(src[:20]) + "\n")
    (tmp_path / "v.ref").write_text("\n".join(ref[:20]) + "\n")
    args = ["evaluate", "--model", str(toy_run), "--src", str(tmp_path / "v.src"), "--ref", str(tmp_path / "v.ref")]
    assert main(args) == 0
    assert main([*args, "--alpha", "0.6", "--dtype", "float32"]) == 0
    capsys.readouterr()
    import json

    default = json.loads((toy_run / "eval" / "v.beam5.json").read_text())
    other = json.loads((toy_run / "eval" / "v.beam5.alpha0.6.float32.json").read_text())
    assert (default["alpha"], other["alpha"], other["dtype"]) == (1.0, 0.6, "float32")
    assert len((toy_run / "eval" / "v.beam5.alpha0.6.float32.hyp").read_text().splitlines()) == 20


def test_translate_prefix_file(toy_run, tmp_path, capsys):
    src = tmp_path / "src.txt"
    src.write_text("the big dog sees a red bird\na cat runs\nthe small bird\n")
    assert main(["translate", "--model", str(toy_run), "-i", str(src), "--beam", "1"]) == 0
    plain = capsys.readouterr().out.splitlines()
    prefixes = tmp_path / "prefixes.txt"
    start = " ".join(plain[0].split()[:2])
    prefixes.write_text(f"{start}\n\nzzz qqq \n")
    for beam in ("1", "5"):
        assert main(["translate", "--model", str(toy_run), "-i", str(src), "--beam", beam,
                     "--prefix-file", str(prefixes)]) == 0  # fmt: skip
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 3 and out[2].startswith("zzz qqq") and len(out[2]) > len("zzz qqq")
        if beam == "1":
            assert out[:2] == plain[:2]  # greedy from its own start: the same; no prefix: unchanged
    prefixes.write_text("x\n")
    assert main(["translate", "--model", str(toy_run), "-i", str(src), "--prefix-file", str(prefixes)]) == 1
    assert f"--prefix-file {prefixes}: fewer prefixes than input lines: none for line 2" in capsys.readouterr().err
    prefixes.write_text("a\nb\nc\nd\n")
    assert main(["translate", "--model", str(toy_run), "-i", str(src), "--prefix-file", str(prefixes)]) == 1
    assert "more prefixes than input lines (3)" in capsys.readouterr().err
    missing = tmp_path / "none.txt"
    assert main(["translate", "--model", str(toy_run), "-i", str(src), "--prefix-file", str(missing)]) == 1
    assert f"--prefix-file {missing}: No such file or directory" in capsys.readouterr().err
