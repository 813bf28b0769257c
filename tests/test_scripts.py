"""The helper scripts in scripts/: those that read run directories, and the decoding benchmark's product replay."""

import importlib.util
import os
import sys

import torch
from conftest import ROOT, TOY, run_command, write_corpus

import mt.decode.fastpath
from mt.config import ModelConfig
from mt.data.corpus import read_lines
from mt.data.toy import toy_corpus
from mt.decode.fastpath import speed_up
from mt.decode.search import SearchSettings, greedy_search
from mt.model.transformer import Transformer

HEADER = "epoch,grad_norm,lr-AdamW,step,tok_per_s,train_loss,val_bleu,val_loss,val_ppl\n"


def write_metrics(run_dir, version, rows):
    path = run_dir / "logs" / f"version_{version}" / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_text(HEADER + "".join(rows))


def test_val_windows_averages_windows_and_reports_median_throughput(tmp_path):
    run = tmp_path / "run"
    # steps are 0-based: a row at step 99 is update 100
    write_metrics(
        run, 0, ["0,,,49,1000.0,5,,,\n", "0,,,99,,,10.0,3,20\n", "1,,,149,3000.0,4,,,\n", "1,,,199,,,30.0,2,7\n"]
    )
    # resumed from the checkpoint at update 100: update 200 is logged again, and the later version wins
    write_metrics(run, 1, ["1,,,199,,,20.0,2,7\n", "2,,,249,2000.0,3,,,\n", "3,,,299,,,40.0,1,2\n"])
    out = run_command(
        [sys.executable, str(ROOT / "experiments" / "val_windows.py"), str(run), "--window", "200"], check=True
    ).stdout
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["1-200", "15.00", "(2)"]  # updates 100 and 200: (10 + 20) / 2
    assert lines[2].split()[:3] == ["201-300", "40.00", "(1)"]
    assert lines[3].endswith("best 40.00 at update 300, last 40.00 at update 300, median 2,000 target tokens/s")
    command = [sys.executable, str(ROOT / "experiments" / "val_windows.py"), str(run), "--window", "200"]
    lines = run_command([*command, "--column", "val_loss"], check=True).stdout.splitlines()
    assert lines[1].split()[:3] == ["1-200", "2.5000", "(2)"]  # the loss: lower is better
    assert lines[3].endswith("best 1.0000 at update 300, last 1.0000 at update 300, median 2,000 target tokens/s")


def test_distill_trains_a_student_on_the_sources_paired_with_the_teachers_translations(tmp_path, toy_run):
    splits = toy_corpus({"train": 200, "val": 30, "test": 30}, seed=7)
    raw = write_corpus(tmp_path / "raw", splits, langs=("src", "tgt"), gz=True)
    kd, student = tmp_path / "kd", tmp_path / "student"
    env = {**os.environ, "MT_DATA_DIR": str(raw), "KD_DIR": str(kd), "KD_RUN": str(student), "KD_TEST": "test"}
    env["CONFIG"] = str(TOY)
    command = ["bash", str(ROOT / "scripts" / "distill.sh"), str(toy_run), "--", "train.max_steps=20"]
    run_command(command, env=env, check=True)

    sources, targets = splits["train"]
    teacher = read_lines(kd / "train.tgt.teacher")
    assert len(teacher) == len(sources)
    # in order, one line per source: the toy teacher gets most of them exactly right (76% here)
    assert sum(h == t for h, t in zip(teacher, targets)) >= 0.5 * len(targets)
    assert read_lines(kd / "raw" / "train.src") == sources + sources
    assert read_lines(kd / "raw" / "train.tgt") == targets + teacher
    assert (student / "model.safetensors").is_file()
    assert (student / "eval" / "test.beam5.json").is_file()

    # KD_MIX=0: the teachers' translations alone, decoded once
    env.update(KD_MIX="0", KD_RUN=str(tmp_path / "student_kd_only"))
    out = run_command(command, env=env, check=True).stdout
    assert "reusing" in out
    assert read_lines(kd / "raw" / "train.src") == sources
    assert read_lines(kd / "raw" / "train.tgt") == teacher

    # other teachers than those that made the translations: refused, nothing rebuilt
    other = command[:2] + [str(toy_run), str(toy_run)] + command[3:]
    failed = run_command(other, env=env)
    assert failed.returncode == 1
    assert f"{kd / 'train.tgt.teacher'} was decoded by '{toy_run}', not '{toy_run} {toy_run}'" in failed.stderr
    assert read_lines(kd / "raw" / "train.tgt") == teacher

    # groups separated by +: each translates on its own (the first reused), every translation is added
    env.update(KD_MIX="1", KD_RUN=str(tmp_path / "student_two_groups"))
    groups = command[:3] + ["+", str(toy_run), str(toy_run)] + command[3:]
    out = run_command(groups, env=env, check=True).stdout
    assert f"reusing {kd / 'train.tgt.teacher'}" in out
    ensemble = read_lines(kd / "train.tgt.teacher2")
    assert len(ensemble) == len(sources)
    assert (kd / "train.tgt.teacher2.runs").read_text().split() == [str(toy_run)] * 2
    assert read_lines(kd / "raw" / "train.src") == sources * 3
    assert read_lines(kd / "raw" / "train.tgt") == targets + teacher + ensemble

    # an empty group: a usage error before anything runs
    for bad in (command[:3] + ["+"] + command[3:], command[:2] + ["+"] + command[2:]):
        failed = run_command(bad, env=env)
        assert failed.returncode == 2 and "usage:" in failed.stderr


def test_bench_decode_records_every_product_of_a_search_and_replays_them():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "scripts" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, enc_layers=2, dec_layers=3, d_ff=64, dropout=0.0,
                      src_vocab_size=50, tgt_vocab_size=50, pad_id=0)  # fmt: skip
    fast = speed_up(Transformer(cfg)).eval()
    s = SearchSettings(2, 3, 0, max_len_a=0.0, max_len_b=bench.OUT_LEN)
    model = bench.FixedLength(fast)  # every output OUT_LEN tokens long
    batches = [torch.randint(4, 50, (3, 5)), torch.randint(4, 50, (2, 7))]
    before = [greedy_search(model, b, s) for b in batches]
    original = mt.decode.fastpath.linear
    outputs = []
    recorded = bench.record_products(lambda b: outputs.append(greedy_search(model, b, s)), batches)
    assert mt.decode.fastpath.linear is original  # restored
    assert [[h.tokens for h in o] for o in outputs] == [[h.tokens for h in o] for o in before]
    # encoder: stacked q/k/v, output, two FFN products per layer; decoder: the source's
    # keys and values once per layer, then per step and layer stacked q/k/v, output,
    # cross-attention query and output, two FFN products, and the output projection
    per_batch = 2 * 4 + 3 * 2 + bench.OUT_LEN * (3 * 6 + 1)
    assert all(len(h.tokens) == bench.OUT_LEN - 1 for o in outputs for h in o)  # then the EOS
    assert [len(calls) for calls in recorded] == [per_batch, per_batch]
    assert recorded[1][0][2] == (2, 7, 32)  # the encoder's first product: all source rows
    assert recorded[0][-1][0] is fast.output_weight and recorded[0][-1][2] == (3, 1, 32)
    assert bench.replay_products(recorded) > 0
