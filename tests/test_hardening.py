"""mt used as a careless or hostile user would: outputs that are not plain files,
checkpoints that carry code, two runs of one directory, broken corpora, signals."""

import gzip
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import time

import pytest
import torch
from conftest import ROOT, TOY, mt_cmd, run_command, train_args, wait_for, write_corpus

from mt.cli.main import main
from mt.data.prepare import prepare
from mt.errors import DataError
from mt.textio import atomic_output

# ---- outputs: written through links, into pipes and devices, never over something else


def test_output_through_a_symbolic_link_replaces_the_file_it_points_to(tmp_path):
    target, link = tmp_path / "t.txt", tmp_path / "l.txt"
    target.write_text("old\n")
    link.symlink_to(target)
    with atomic_output(link) as f:
        f.write("new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "later.txt")
    with atomic_output(dangling) as f:
        f.write("made\n")
    assert dangling.is_symlink() and (tmp_path / "later.txt").read_text() == "made\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "l.txt", "later.txt", "t.txt"]


def test_output_into_a_fifo_writes_it_directly(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader waits, so that opening it to write succeeds
    try:
        with atomic_output(fifo) as f:
            f.write("through the pipe\n")
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still a FIFO, not a file renamed over it
        assert os.read(reader, 1000) == b"through the pipe\n"
    finally:
        os.close(reader)


def test_output_into_a_character_device_writes_it_directly(tmp_path):
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is on Linux
    except (PermissionError, OSError):
        pytest.skip("cannot make a device node here (not root)")
    with atomic_output(node, binary=True) as f:
        f.write(b"discarded")
    assert stat.S_ISCHR(os.lstat(node).st_mode)  # still the device
    assert os.listdir(tmp_path) == ["null"]


def test_output_refuses_what_is_not_a_file_and_a_missing_directory(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        with pytest.raises(DataError, match="sock: is not a regular file"), atomic_output(tmp_path / "sock"):
            pass
    finally:
        sock.close()
    with pytest.raises(DataError, match="is a directory"), atomic_output(tmp_path):
        pass
    with pytest.raises(DataError, match="typo does not exist"), atomic_output(tmp_path / "typo" / "out.txt"):
        pass
    assert not (tmp_path / "typo").exists()


def test_translate_output_through_links_pipes_and_missing_directories(toy_run, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("the cat runs\na dog\n")
    target, link = tmp_path / "t.txt", tmp_path / "l.txt"
    link.symlink_to(target)
    assert main(["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "-o", str(link)]) == 0
    assert link.is_symlink() and len(target.read_text().splitlines()) == 2
    # -o a link to the process's own stdout: the translations appear there
    stdout_link = tmp_path / "stdout"
    stdout_link.symlink_to("/proc/self/fd/1")
    done = run_command(
        mt_cmd("translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "-o", str(stdout_link)),
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 2, done.stderr
    assert stdout_link.is_symlink()
    # a typo in a directory name: an error, and no directory made
    out = tmp_path / "no_such_dir" / "out.txt"
    assert main(["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "-o", str(out)]) == 1
    assert "does not exist" in capsys.readouterr().err and not out.parent.exists()


def test_attention_image_through_a_link(toy_run, tmp_path):
    target, link = tmp_path / "map.png", tmp_path / "link.png"
    link.symlink_to(target)
    assert main(["attention", "--model", str(toy_run), "--src", "the cat runs", "--out", str(link)]) == 0
    assert link.is_symlink() and target.read_bytes()[:4] == b"\x89PNG"


# ---- checkpoints are read as data only


class _Payload:
    """Unpickling this runs a command: what a hostile checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_carries_code_is_refused_everywhere(toy_data, toy_run, tmp_path, capsys):
    """Resuming, `mt average` and exporting read checkpoints as plain data only, whatever the
    environment says, and say so in one line naming the file."""
    run = tmp_path / "run"
    assert main(train_args(toy_data, run, "train.max_steps=20", "train.val_every_steps=10")) == 0
    marker = tmp_path / "pwned"
    last = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    checkpoint["extra"] = _Payload(marker)
    torch.save(checkpoint, last)
    capsys.readouterr()
    env = os.environ | {"PYTHONPATH": str(ROOT), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    done = run_command(mt_cmd(*train_args(toy_data, run, "train.max_steps=40", "train.val_every_steps=10")), env=env)
    assert done.returncode == 1, done.stderr
    assert f"{last}: refused" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists()
    for name in ("step=20.ckpt", "step=10.ckpt"):
        torch.save(checkpoint, run / "checkpoints" / name)
    done = run_command(mt_cmd("average", "--model", str(run), "--last", "2"), env=env)
    assert done.returncode == 1 and "refused" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not marker.exists()


# ---- one run directory, one training


def test_a_second_training_of_the_same_run_directory_stops_at_once(toy_data, tmp_path, children):
    run = tmp_path / "run"
    first = children(
        mt_cmd(*train_args(toy_data, run, "train.max_steps=100000", "train.val_every_steps=10")),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: (run / "checkpoints" / "last.ckpt").exists(), first, "a first checkpoint")
    config = (run / "config.yaml").read_text()
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    second = run_command(mt_cmd(*train_args(toy_data, run, "train.max_steps=200")), env=env)
    assert second.returncode == 1, second.stderr
    assert f"run directory {run} is in use by another mt train (process {first.pid})" in second.stderr
    assert "Traceback" not in second.stderr and (run / "config.yaml").read_text() == config
    first.send_signal(signal.SIGKILL)  # a crashed run never blocks the next
    first.wait()
    (run / "checkpoints" / ".last.ckpt.abc.partial").write_bytes(b"left by a killed run")
    (run / "checkpoints" / "best.ckpt.tmp").write_bytes(b"left by an older mt")
    done = run_command(mt_cmd(*train_args(toy_data, run, "train.max_steps=30", "train.val_every_steps=10")), env=env)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stdout
    assert not list((run / "checkpoints").glob(".*.partial")) and not list((run / "checkpoints").glob("*.tmp"))


def test_a_run_directory_that_is_a_file_is_named_as_such(toy_data, tmp_path, capsys):
    (tmp_path / "run").write_text("not a directory")
    assert main(train_args(toy_data, tmp_path / "run")) == 1
    assert f"train.run_dir {tmp_path / 'run'}: is a file, not a directory" in capsys.readouterr().err


def test_resume_point_is_the_newest_complete_checkpoint(tmp_path):
    from mt.train.run import resume_point

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    assert resume_point(tmp_path) is None
    (ckpt / "best.ckpt").write_bytes(b"")
    assert resume_point(tmp_path) == ckpt / "best.ckpt"
    for n in (7, 14):
        (ckpt / f"step={n}.ckpt").write_bytes(b"")
    assert resume_point(tmp_path) == ckpt / "step=14.ckpt"  # an interrupt before the first last.ckpt
    (ckpt / "last.ckpt").write_bytes(b"")
    assert resume_point(tmp_path) == ckpt / "last.ckpt"


def test_a_run_without_last_ckpt_resumes_from_its_newest_step_checkpoint(toy_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(toy_data, run, "train.max_steps=20", "train.val_every_steps=10")) == 0
    (run / "checkpoints" / "last.ckpt").unlink()
    assert main(train_args(toy_data, run, "train.max_steps=30", "train.val_every_steps=10")) == 0
    assert f"resuming from {run / 'checkpoints' / 'step=20.ckpt'}" in capsys.readouterr().out


# ---- signals


def test_sigint_inherited_as_ignored_stays_ignored_and_sigterm_stops_gracefully(toy_data, tmp_path, children):
    """Started as a shell's background job or under nohup (SIGINT ignored), `mt train`
    leaves SIGINT ignored, as POSIX programs do; SIGTERM stops it as Ctrl-C would."""
    run = tmp_path / "run"
    command = mt_cmd(*train_args(toy_data, run, "train.max_steps=100000", "train.val_every_steps=10"))
    proc = children(command, sigint_ignored=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (run / "checkpoints" / "last.ckpt").exists(), proc, "a first checkpoint")
    proc.send_signal(signal.SIGINT)
    time.sleep(2)
    assert proc.poll() is None  # still training
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM at update" in err and "rerun the same command to resume from" in err, err
    assert "Traceback" not in err


def test_a_second_ctrl_c_while_stopping_exits_130_quietly(toy_data, tmp_path, children):
    run = tmp_path / "run"
    command = mt_cmd(*train_args(toy_data, run, "train.max_steps=100000", "train.val_every_steps=10"))
    proc = children(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (run / "checkpoints" / "last.ckpt").exists(), proc, "a first checkpoint")
    proc.send_signal(signal.SIGINT)
    for _ in range(20):  # more Ctrl-C while it winds down, 20-50 ms apart
        time.sleep(0.03)
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "rerun the same command to resume from" in err, err


# ---- broken corpora


def test_a_gzip_damaged_inside_is_one_line_and_leaves_nothing_behind(data_cfg, tmp_path):
    raw = tmp_path / "raw"
    rng = random.Random(0)
    words = ["a", "dog", "runs", "on", "the", "beach", "big", "red"]
    text = "".join(" ".join(rng.choice(words) for _ in range(10)) + "\n" for _ in range(3000))
    data = bytearray(gzip.compress(text.encode()))
    data[100:132] = bytes(32)  # zeroed bytes inside the compressed stream: zlib fails, not the CRC check
    (raw / "train.en").unlink()
    (raw / "train.en.gz").write_bytes(bytes(data))
    with pytest.raises(DataError, match="train.en.gz: cannot read"):
        prepare(data_cfg, verbose=False)
    assert not list((tmp_path / "prepared").parent.glob("*.partial"))


def test_a_training_split_of_empty_lines_is_one_line_and_leaves_nothing_behind(data_cfg, tmp_path):
    raw = tmp_path / "raw"
    (raw / "train.en").write_text("\n" * 300)
    with pytest.raises(DataError, match="no usable training pair"):
        prepare(data_cfg, verbose=False)
    assert not list(tmp_path.glob("prepared*.partial")) and not (tmp_path / "prepared").exists()


def test_a_missing_validation_split_is_named_by_prepare_and_train(data_cfg, tmp_path, corpus_splits):
    raw = tmp_path / "raw"
    for f in raw.glob("val.*"):
        f.unlink()
    with pytest.raises(DataError, match=r"no 'val' split in .*raw \(data.valid_split\): expected val.en and val.de"):
        prepare(data_cfg, verbose=False)
    # data prepared before its validation split went missing: train says so before it makes the run directory
    write_corpus(raw, {"val": corpus_splits["val"]})
    prepare(data_cfg, verbose=False)
    shutil.rmtree(tmp_path / "prepared" / "val")
    overrides = [f"data.{k}={v}" for k, v in vars(data_cfg).items() if k in ("corpus", "prepared_dir", "local_dir")]
    args = ["train", "--config", str(TOY), "data.source=local", "data.src_lang=en", "data.tgt_lang=de", *overrides]
    assert main([*args, f"train.run_dir={tmp_path / 'run'}"]) == 1
    assert not (tmp_path / "run").exists()


# ---- mt never deletes what it did not write; bounds on the search; edges of the CLI


def test_prepare_replaces_only_a_directory_it_wrote(data_cfg, tmp_path, capsys):
    """data.prepared_dir naming the user's directory: refused, and nothing in it touched."""
    import dataclasses

    theirs = tmp_path / "thesis"
    theirs.mkdir()
    (theirs / "paper.tex").write_text("years of work")
    cfg = dataclasses.replace(data_cfg, prepared_dir=str(theirs))
    with pytest.raises(DataError, match=r"thesis: exists and was not written by mt \(no prepare.json in it\)"):
        prepare(cfg, verbose=False)
    assert [p.name for p in theirs.iterdir()] == ["paper.tex"]
    assert not (tmp_path / "thesis.partial").exists()

    partial = tmp_path / "prepared.partial"  # the user's, with the name prepare writes into
    partial.mkdir()
    (partial / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match=r"prepared.partial: exists and was not left by mt"):
        prepare(data_cfg, verbose=False)
    assert (partial / "keep.txt").read_text() == "mine" and not (tmp_path / "prepared").exists()

    (partial / "keep.txt").unlink()
    (partial / ".mt-partial").write_text("")  # as an interrupted run leaves it
    (partial / "half.arrow").write_text("")
    prepare(data_cfg, verbose=False)
    out = tmp_path / "prepared"
    assert (out / "prepare.json").exists() and not partial.exists() and not (out / ".mt-partial").exists()
    (out / "prepare.json").write_text("{}")  # ours, but stale: prepared anew, in its place
    prepare(data_cfg, verbose=False)
    assert "fingerprint" in (out / "prepare.json").read_text()

    # the command line, as the issue ran it
    d = tmp_path / "d"
    d.mkdir()
    (d / "paper.tex").write_text("x")
    assert main(["prepare", "--config", str(TOY), f"data.prepared_dir={d}"]) == 1
    err = capsys.readouterr().err
    assert f"{d}: exists and was not written by mt" in err and "Traceback" not in err
    assert (d / "paper.tex").read_text() == "x"


def test_beam_alpha_and_n_best_are_bounded_before_anything_loads(toy_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a cat runs\n")
    for opts, message in (
        (["--beam", "100000"], "--beam must be between 1 and 32, got 100000"),
        (["--beam", "33"], "--beam must be between 1 and 32"),
        (["--alpha", "2000", "--beam", "5"], "--alpha must be between 0 and 10.0, got 2000.0"),
        (["--alpha", "nan"], "--alpha must be between 0 and 10.0, got nan"),
        (["--alpha", "-0.5"], "--alpha must be between 0 and 10.0"),
        (["--n-best", "6"], "--n-best must be between 1 and --beam (5)"),
    ):
        assert main(["translate", "--model", str(toy_run), "-i", str(src), *opts]) == 1, opts
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (opts, err)
    assert main(["translate", "--model", str(toy_run), "-i", str(src), "--beam", "32", "--alpha", "10"]) == 0
    assert capsys.readouterr().out.strip()


def test_evaluate_on_an_empty_test_set_names_the_file(toy_run, tmp_path, capsys):
    empty = tmp_path / "empty.en"
    empty.write_text("")
    ref = tmp_path / "empty.de"
    ref.write_text("")
    assert main(["evaluate", "--model", str(toy_run), "--src", str(empty), "--ref", str(ref)]) == 1
    err = capsys.readouterr().err
    assert f"{empty}: no lines: an empty test set has no score" in err and "Traceback" not in err


def test_the_same_input_gets_the_same_translation_however_it_arrives(toy_run, tmp_path):
    """A byte-order mark (files saved on Windows) is dropped from the first line, on
    standard input as from a file; -i - is standard input."""
    text = "the big dog sees a red bird\na cat runs\n"
    plain, marked = tmp_path / "plain.txt", tmp_path / "bom.txt"
    plain.write_text(text, encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + text.encode())
    base = mt_cmd("translate", "--model", str(toy_run), "--beam", "1")
    want = run_command([*base, "-i", str(plain)], check=True).stdout
    assert len(want.splitlines()) == 2 and want.splitlines()[0]
    for args, given in (
        (["-i", str(marked)], None),
        ([], marked.read_bytes().decode()),
        (["-i", "-", "-o", "-"], marked.read_bytes().decode()),
    ):
        assert run_command([*base, *args], input=given, check=True).stdout == want, args


def test_attention_refuses_what_would_fail_before_it_writes_anything(toy_run, tmp_path, capsys):
    png = tmp_path / "a.png"
    for opts, message in (
        (["--explain", "--temperature", "1e-300"], "--temperature must be between 0.01 and 100, got 1e-300"),
        (["--explain", "--temperature", "1", "1e300"], "--temperature must be between 0.01 and 100"),
        (["--out", str(png), "--html", str(tmp_path / "no" / "a.html")], "no/a.html: cannot write, "),
        (["--explain", "--out", str(tmp_path / "no" / "a.png")], "no/a.png: cannot write, "),
        (["--explain", "--npz", str(tmp_path / "no" / "a.npz")], "no/a.npz: cannot write, "),
    ):
        assert main(["attention", "--model", str(toy_run), "--src", "a cat runs", *opts]) == 1, opts
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (opts, err)
        assert not png.exists(), opts  # checked before the image was drawn
    assert (
        main(["attention", "--model", str(toy_run), "--src", "a cat runs", "--explain", "--temperature", "0.01"]) == 0
    )


def test_a_broken_run_directory_is_named_for_what_it_is(toy_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    (run / "spm.model").unlink()
    assert main(["translate", "--model", str(run), "-i", str(run / "model.json")]) == 1
    err = capsys.readouterr().err
    assert f"{run / 'spm.model'}: tokenizer model missing" in err and "spm.src.model:" not in err
    weights = toy_run / "model.safetensors"
    assert main(["translate", "--model", str(weights), "-i", str(toy_run / "model.json")]) == 1
    assert f"{weights}: a file, not a model directory" in capsys.readouterr().err
