"""mt export --to argos: the package installs into Argos Translate offline and
translates as mt does with Argos's own search; what Argos cannot hold is refused."""

import json
import os
import shutil
import sys
import textwrap
import zipfile

import pytest

try:
    import argostranslate  # noqa: F401
    import ctranslate2  # noqa: F401
    import spacy  # noqa: F401
except ImportError:
    if os.environ.get("MT_REQUIRE_EXTRAS") == "1":  # CI: the dev extras are installed, so this must run
        raise
    pytest.skip("the export extra and argos-translate-lt: pip install -e '.[dev]'", allow_module_level=True)

from conftest import mt_cmd, run_command  # noqa: E402

from mt.decode.inference import load  # noqa: E402
from mt.decode.translator import Translator  # noqa: E402
from mt.errors import MTError  # noqa: E402
from mt.export.argos import export_argos  # noqa: E402

# Argos Translate decodes with beam ARGOS_BEAM_SIZE and a fixed length penalty of 0.2
# (argostranslate.translate.apply_packaged_translation); mt is given the same search.
ARGOS_BEAM, ARGOS_ALPHA = 5, 0.2

# Run in a child: argostranslate reads its directories and settings from the environment
# when imported. Installs the package into a fresh packages directory and translates
# stdin's lines, one result per line (JSON strings, so that a line break shows).
ARGOS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import argostranslate.package as package, argostranslate.translate as translate
    package.install_from_path(Path(sys.argv[1]))
    installed = package.get_installed_packages()
    print(json.dumps([[p.from_code, p.to_code] for p in installed]), flush=True)
    for line in sys.stdin:
        print(json.dumps(translate.translate(json.loads(line), sys.argv[2], sys.argv[3])), flush=True)
""")


def argos_translate(package, lines, tmp_path, src="src", tgt="tgt"):
    """(installed language pairs, translations) from argostranslate, offline, in a child process."""
    home = tmp_path / "argos-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARGOS_", "XDG_"))}
    env |= {f"XDG_{d}_HOME": str(home / d) for d in ("DATA", "CACHE", "CONFIG")}
    env |= {"ARGOS_CHUNK_TYPE": "SPACY", "ARGOS_BEAM_SIZE": str(ARGOS_BEAM), "HOME": str(home)}
    # With SPACY, importing argostranslate caches spaCy's multi-language model unless this
    # directory exists (a download, which cannot happen offline); the package brings its own.
    (home / "CACHE/argos-translate/spacy/senter/model").mkdir(parents=True)
    stdin = "".join(json.dumps(line) + "\n" for line in lines)
    result = run_command([sys.executable, "-c", ARGOS, str(package), src, tgt], timeout=600, input=stdin, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    first, *rest = result.stdout.splitlines()
    return json.loads(first), [json.loads(r) for r in rest]


@pytest.fixture(scope="module")
def package(toy_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("argos") / "toy.argosmodel"
    check = export_argos(toy_run, out)
    return out, check


def test_the_package_installed_in_argos_translates_as_mt_does(toy_run, package, toy_test_lines, tmp_path):
    out, check = package
    assert check["same"] == check["sentences"]
    pairs, theirs = argos_translate(out, toy_test_lines, tmp_path)
    assert pairs == [["src", "tgt"]]
    model, tok, _ = load(toy_run)
    ours = Translator(model, tok, beam=ARGOS_BEAM, alpha=ARGOS_ALPHA, workers=1, loop_margin=None).translate(
        toy_test_lines
    )
    assert theirs == ours, [(s, a, b) for s, a, b in zip(toy_test_lines, ours, theirs) if a != b][:3]
    assert sum(a != b for a, b in zip(ours, Translator(model, tok, beam=1, workers=1).translate(toy_test_lines))) > 0


def test_argos_splits_a_paragraph_into_sentences_with_the_packaged_splitter(package, tmp_path):
    """Two sentences in one line come back as the two sentences translated one at a time,
    joined by a space (spaCy's rule-based sentencizer, from the package, split at the full
    stop, offline); two paragraphs keep their line break."""
    first, second = "the big dog sees a red bird", "a cat runs"
    lines = [f"{first}. {second}.", f"{first}.", f"{second}.", f"{first}\n{second}", first, second]
    _, (paragraph, one, two, paragraphs, three, four) = argos_translate(package[0], lines, tmp_path)
    assert paragraph == f"{one} {two}" and one and two
    assert paragraphs == f"{three}\n{four}"


def test_the_package_holds_what_argos_reads(package):
    with zipfile.ZipFile(package[0]) as z:
        names = set(z.namelist())
        metadata = json.loads(z.read("mt-src_tgt/metadata.json"))
    for name in ("metadata.json", "sentencepiece.model", "model/model.bin", "spacy/config.cfg", "README.md"):
        assert f"mt-src_tgt/{name}" in names, name
    assert {n.split("/")[0] for n in names} == {"mt-src_tgt"}  # one directory: install_from_path unzips it as is
    assert (metadata["from_code"], metadata["to_code"], metadata["type"]) == ("src", "tgt", "translate")


def test_export_argos_command_name_version_and_what_it_replaces(toy_run, tmp_path):
    out = tmp_path / "p.argosmodel"
    args = ["export", "--model", str(toy_run), "--to", "argos", str(out), "--name", "toy-pair"]
    result = run_command(mt_cmd(*args, "--package-version", "2.1"), timeout=600)
    assert result.returncode == 0, result.stderr
    assert "check: 6 of 6" in result.stdout and "install_from_path" in result.stdout
    with zipfile.ZipFile(out) as z:
        assert json.loads(z.read("toy-pair/metadata.json"))["package_version"] == "2.1"
    again = run_command(mt_cmd(*args), timeout=600)
    assert again.returncode != 0 and "--force" in again.stderr
    assert run_command(mt_cmd(*args, "--force"), timeout=600).returncode == 0

    other = tmp_path / "other.argosmodel"
    other.write_text("not a package\n")
    refused = run_command(mt_cmd(*args[:-3], str(other), "--force"), timeout=600)
    assert refused.returncode != 0 and f"{other}: exists and is not an Argos package mt wrote" in refused.stderr
    assert other.read_text() == "not a package\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.argosmodel", "p.argosmodel"]  # no partial file


def test_separate_vocabularies_are_refused_by_name(toy_run, tmp_path):
    run = tmp_path / "separate"
    shutil.copytree(toy_run, run)
    (run / "spm.model").rename(run / "spm.src.model")
    shutil.copyfile(run / "spm.src.model", run / "spm.tgt.model")
    with pytest.raises(MTError, match=r"data.joint_vocab=false.*one sentencepiece model"):
        export_argos(run, tmp_path / "x.argosmodel")
    assert not (tmp_path / "x.argosmodel").exists()
