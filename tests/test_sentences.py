"""Sentence splitting: the splitter on real English, German and French text, and
``--split-sentences``: every sentence translated, in place, with the line's spacing."""

import shutil
from pathlib import Path

import pytest
from conftest import ROOT

from mt.cli.main import main
from mt.decode.inference import load
from mt.decode.sentences import SplitLine, cut_long, per_line, split_line, split_lines
from mt.decode.translator import Translator

GOLD = ROOT / "tests" / "data" / "sentences"

# Paragraphs of the gold files that sentencex splits wrongly: the test fails if one of
# them starts to split right (then drop it here), or if any other goes wrong.
KNOWN_MISSES = {
    ("de", "Das Treffen ist im 2. Stock, Zimmer Nr. 12."),  # an ordinal before a noun it does not know
    ("fr", "M. Dupont est arrivé à 10 h."),  # "M." (Monsieur) is not among its French abbreviations
}


def gold(lang: str) -> list[list[str]]:
    """The paragraphs of ``tests/data/sentences/LANG.txt``, each a list of its sentences."""
    paragraphs, current = [], []
    for line in (GOLD / f"{lang}.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            continue
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append(current)
            current = []
    return paragraphs + ([current] if current else [])


@pytest.mark.parametrize("lang", ["en", "de", "fr"])
def test_the_splitter_finds_the_sentences_of_real_text(lang):
    """Abbreviations, numbers, ordinals, quotes, ellipses, URLs, times: each paragraph
    (its sentences joined by a space) splits back into its sentences."""
    paragraphs = gold(lang)
    assert len(paragraphs) >= 11
    for sentences in paragraphs:
        got = split_line(" ".join(sentences), lang).sentences
        missed = (lang, sentences[0]) in KNOWN_MISSES
        assert (got != sentences) == missed, (sentences, got)


@pytest.mark.parametrize(
    "line",
    [
        "",
        "   ",
        "One sentence",
        "  Leading space. Two  spaces between.\tA tab. ",
        "Trailing spaces.   ",
        "Wait... what? Yes!  No.",
        "Ünïcödé “quotes.” 😀 Next one.",
    ],
)
def test_a_split_line_joins_back_to_itself(line):
    split = split_line(line, "en")
    assert split.join(split.sentences) == line  # the spacing is kept exactly
    assert all(s and s == s.strip() for s in split.sentences)
    assert not line.strip() or split.sentences


def test_each_line_gets_its_own_sentences_back():
    splits = split_lines(["It rains. We stay.", "", "Go home."], "en")
    assert [s for split in splits for s in split.sentences] == ["It rains.", "We stay.", "Go home."]
    whole = split_lines(["It rains. We stay.", ""], None)  # no language: each line is its one sentence
    assert [split.sentences for split in whole] == [["It rains. We stay."], [""]]
    assert [split.join(line) for split, line in zip(splits, per_line(["1", "2", "3"], splits))] == ["1 2", "", "3"]
    with pytest.raises(ValueError, match="2 translations for 3 sentences"):
        per_line(["1", "2"], splits)
    with pytest.raises(ValueError):
        SplitLine("", ["a"], [""]).join([])


def test_split_sentences_translates_every_sentence_in_place(toy_run, tmp_path: Path, capsys):
    """Each sentence translated as it would be alone, joined with the line's own spacing;
    one output line per input line; blank lines kept; without the option, the line is one sentence."""
    model, tok, _ = load(toy_run)
    first, second, third = "the big dog sees a red bird.", "a cat runs!", "the small bird sees the big cat."
    lines = [f"{first} {second}  {third}", "", f"  {second}", first]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    args = ["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt")]
    assert main([*args, "--split-sentences"]) == 0
    out = capsys.readouterr().out.split("\n")[:-1]
    alone = dict(zip([first, second, third], Translator(model, tok, beam=5).translate([first, second, third])))
    assert out == [f"{alone[first]} {alone[second]}  {alone[third]}", "", f"  {alone[second]}", alone[first]]

    assert main(args) == 0
    whole = capsys.readouterr().out.split("\n")[:-1]
    assert whole[0] == Translator(model, tok, beam=5).translate([lines[0]])[0] != out[0]


def test_split_sentences_refuses_what_a_split_line_cannot_have(toy_run, tmp_path: Path, capsys):
    (tmp_path / "in.txt").write_text("a cat runs. a dog runs.\n")
    (tmp_path / "prefix.txt").write_text("x\n")
    args = ["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "--split-sentences"]
    for extra in (["--n-best", "2"], ["--prefix-file", str(tmp_path / "prefix.txt")]):
        assert main([*args, *extra]) == 1
        named = extra[0]
        err = capsys.readouterr().err
        assert "--split-sentences" in err and named in err and "Traceback" not in err


def piece_count(tok):
    """text -> how many subword pieces the model reads of it (EOS aside)."""
    return lambda text: len(tok.encode_src([text])[0]) - 1


def too_long_clauses(tok, lines: list[str], most: int) -> list[str]:
    """Lines that, joined with ", ", make a line of more than 3x ``most`` pieces."""
    clauses = []
    while piece_count(tok)(", ".join(clauses)) <= 3 * most:
        clauses.append(lines[len(clauses) % len(lines)])
    return clauses


def test_a_line_three_times_too_long_is_translated_in_parts(toy_run, toy_test_lines, tmp_path: Path, capsys):
    """A line of 3x the model's positions: cut at punctuation into parts that fit, each part
    translated as alone and every part's translation kept, in order, with the line's spacing."""
    model, tok, _ = load(toy_run)
    translator = Translator(model, tok, beam=1)
    most = translator.max_source_pieces
    pieces, clauses = piece_count(tok), too_long_clauses(tok, toy_test_lines, most)
    line = ", ".join(clauses)
    parts, gaps, how = cut_long(line, pieces, most)
    assert "".join(p + g for p, g in zip(parts, gaps)) == line and how == "punctuation"
    assert len(parts) == 4 and all(pieces(p) <= most for p in parts)
    (tmp_path / "in.txt").write_text(f"{line}\n{clauses[0]}\n")
    assert main(["translate", "--model", str(toy_run), "-i", str(tmp_path / "in.txt"), "--beam", "1"]) == 0
    captured = capsys.readouterr()
    each = translator.translate(parts)
    assert all(each)
    assert captured.out.split("\n")[:-1] == [
        "".join(t + g for t, g in zip(each, gaps)),
        translator.translate(clauses[:1])[0],
    ]
    assert f"line 1: {pieces(line)} subword pieces" in captured.err and "4 parts, cut at punctuation" in captured.err


def test_a_text_with_nowhere_to_cut_is_cut_between_characters():
    parts, gaps, how = cut_long("abcdefghij", len, 3)
    assert parts == ["abc", "def", "ghi", "j"] and set(gaps) == {""} and how == "characters"
    parts, gaps, how = cut_long("a b c, d e f; g h i j", lambda t: len(t.split()), 4)
    assert parts == ["a b c,", "d e f;", "g h i j"] and how == "punctuation"
    assert cut_long("short", len, 10) == (["short"], [""], "")


def test_mt_evaluate_translates_a_too_long_line_in_parts(toy_run, toy_test_lines, tmp_path: Path, capsys):
    """mt evaluate scores what mt translate writes: a line past the model's positions in parts."""
    run = tmp_path / "run"  # evaluate writes into the run's eval/
    shutil.copytree(toy_run, run, ignore=shutil.ignore_patterns("checkpoints", "logs", "eval"))
    model, tok, _ = load(run)
    line = ", ".join(too_long_clauses(tok, toy_test_lines, Translator(model, tok).max_source_pieces))
    (tmp_path / "src").write_text(f"{line}\n{toy_test_lines[0]}\n")
    (tmp_path / "ref").write_text("eins\nzwei\n")
    assert main(["translate", "--model", str(run), "-i", str(tmp_path / "src"), "--beam", "1"]) == 0
    want = capsys.readouterr().out
    args = ["evaluate", "--model", str(run), "--src", str(tmp_path / "src"), "--ref", str(tmp_path / "ref")]
    assert main([*args, "--beam", "1"]) == 0
    err = capsys.readouterr().err
    assert "4 parts, cut at punctuation" in err and "truncated" not in err
    (hyp,) = (run / "eval").glob("*.hyp")
    assert hyp.read_text() == want
