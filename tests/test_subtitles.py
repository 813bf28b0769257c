"""SubRip subtitles: a .srt file comes back a .srt file, numbers and timings as they
were, each cue's text translated (its lines joined) and wrapped again."""

import os

import pytest
from conftest import ROOT, mt_cmd, run_command

from mt.cli.main import main
from mt.decode.inference import load
from mt.decode.subtitles import LINE_WIDTH, parse_srt, wrap, write_srt
from mt.decode.translator import Translator
from mt.errors import DataError

SRT = (
    "\ufeff1\r\n00:00:01,000 --> 00:00:03,500\r\nthe big dog\r\nsees a red bird\r\n\r\n"
    "2\r\n00:00:04,000 --> 00:00:06,000 X1:100 X2:600\r\na cat runs\r\n\r\n\r\n"
    "3\r\n00:01:07,250 --> 00:01:09,000\r\nthe small bird sees the big cat\r\n"
)


def test_cues_keep_their_numbers_and_timings_and_join_their_lines():
    cues = parse_srt(SRT, "x.srt")
    assert [c.number for c in cues] == ["1", "2", "3"]
    assert [c.timing for c in cues] == [
        "00:00:01,000 --> 00:00:03,500",
        "00:00:04,000 --> 00:00:06,000 X1:100 X2:600",
        "00:01:07,250 --> 00:01:09,000",
    ]
    assert [c.text for c in cues] == ["the big dog sees a red bird", "a cat runs", "the small bird sees the big cat"]
    again = parse_srt(write_srt(cues, ["uno", "dos", "tres"], "\r\n"), "y.srt")
    assert [(c.number, c.timing, c.lines) for c in again] == [
        (c.number, c.timing, [t]) for c, t in zip(cues, ["uno", "dos", "tres"])
    ]


@pytest.mark.parametrize(
    "text, line",
    [
        ("1\nnot a timing\nhello\n", 2),
        ("1\n00:00:01,000 --> 00:00:02,000\nhello\n\nhello again\n", 5),
        ("1\n", 2),
    ],
)
def test_a_malformed_file_is_named_with_its_line(text, line):
    with pytest.raises(DataError, match=rf"^x\.srt, line {line}: expected"):
        parse_srt(text, "x.srt")


def test_wrapping_keeps_every_word_and_balances_the_lines():
    short = "Ein Hund rennt."
    assert wrap(short) == [short] and wrap("") == []
    long = "Ein Mann in einem roten Hemd fährt mit dem Fahrrad die lange Straße entlang."
    lines = wrap(long)
    assert len(lines) == 2 and all(len(x) <= LINE_WIDTH for x in lines)
    assert " ".join(lines) == long and abs(len(lines[0]) - len(lines[1])) < 12
    very = " ".join([long] * 3)
    assert " ".join(wrap(very)) == very and all(len(x) <= LINE_WIDTH for x in wrap(very))


def test_translate_a_subtitle_file(toy_run, tmp_path, capsys):
    model, tok, _ = load(toy_run)
    (tmp_path / "in.srt").write_bytes(SRT.encode())
    args = ["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.srt"), "-o", str(tmp_path / "out.srt")]
    assert main(args) == 0
    written = (tmp_path / "out.srt").read_bytes().decode()
    assert "\r\n" in written and "\n" not in written.replace("\r\n", "")  # the input's line endings
    cues, out = parse_srt(SRT, "in.srt"), parse_srt(written, "out.srt")
    want = Translator(model, tok, beam=5).translate([c.text for c in cues])
    assert [(c.number, c.timing) for c in out] == [(c.number, c.timing) for c in cues]
    assert [" ".join(c.lines) for c in out] == want

    # --format srt reads standard input; --format text takes the file as lines
    piped = run_command(mt_cmd("translate", "--model", str(toy_run), "--format", "srt"), input=SRT, timeout=600,
                        env=os.environ | {"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert piped.returncode == 0 and [" ".join(c.lines) for c in parse_srt(piped.stdout, "-")] == want
    as_text = ["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.srt"), "--format", "text"]
    assert main(as_text) == 0 and len(capsys.readouterr().out.splitlines()) == len(SRT.splitlines())


def test_a_bad_subtitle_file_is_an_error_with_no_output(toy_run, tmp_path, capsys):
    (tmp_path / "bad.srt").write_text("1\n00:00:01 --> 00:00:02\nhello\n")
    args = ["translate", "--model", str(toy_run), "-i", str(tmp_path / "bad.srt"), "-o", str(tmp_path / "out.srt")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "bad.srt, line 2: expected a timing" in err and "Traceback" not in err
    assert not (tmp_path / "out.srt").exists()
    assert main([*args[:-2], "--n-best", "2"]) == 1
    assert "--n-best" in capsys.readouterr().err
