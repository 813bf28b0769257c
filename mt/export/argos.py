"""``mt export --to argos``: a trained model as an Argos Translate package, the
format LibreTranslate installs.

A package is a zip file (``.argosmodel``) holding one directory::

    NAME/
      metadata.json        languages, versions, the name (Argos Translate reads it)
      model/               the CTranslate2 export (``mt.export.ct2``, exact), which
                           ``mt translate --model`` also decodes
      sentencepiece.model  the joint sentencepiece model: Argos encodes the source and
                           decodes the output with this one file
      spacy/               a blank spaCy pipeline for the source language: with
                           ARGOS_CHUNK_TYPE=SPACY, Argos splits sentences with spaCy's
                           rule-based sentencizer on it, offline (its default splitter,
                           MiniSBD, downloads a model on first use)
      README.md            how to install and run it
      mt_export.json       where it came from (also how mt knows the file is its own)

What Argos cannot express is refused by name: separate source and target
vocabularies (Argos has one tokenizer), and a model trained on paper-style text
(Argos gives sentencepiece the raw text).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zipfile
from pathlib import Path

from mt import __version__
from mt.decode.ct2 import EXPORT_JSON
from mt.errors import MTError
from mt.export.ct2 import (
    check_export,
    check_quantization,
    load_textbook,
    require_ctranslate2,
    run_language,
    write_model_directory,
)
from mt.textio import atomic_output

# The names Argos Translate and LibreTranslate show for a language code; a code
# not here is shown as itself.
LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "de": "German", "en": "English", "es": "Spanish", "fr": "French",
    "hi": "Hindi", "it": "Italian", "ja": "Japanese", "ko": "Korean", "nl": "Dutch", "pl": "Polish",
    "pt": "Portuguese", "ru": "Russian", "sv": "Swedish", "tr": "Turkish", "uk": "Ukrainian", "zh": "Chinese",
}  # fmt: skip

README = """# {name}: an `mt` model for Argos Translate and LibreTranslate

{src_name} → {tgt_name}, {params:,} parameters, exported by
`mt export --model {run} --to argos {out} --quantization {quantization}`.

Install it into Argos Translate (and so LibreTranslate, which uses Argos's
package directory) and translate offline:

```bash
export ARGOS_CHUNK_TYPE=SPACY   # split sentences with the spaCy pipeline in this package, offline
python -c "import argostranslate.package as p; p.install_from_path('{out}')"
argos-translate -f {src} -t {tgt} "A man rides a bike."
```

Sentence splitting needs `pip install spacy`. Without ARGOS_CHUNK_TYPE=SPACY,
Argos splits with MiniSBD, which downloads its model for `{src}` on first use.
Argos decodes with beam 4 (ARGOS_BEAM_SIZE) and a length penalty of 0.2:
`mt translate --beam 4 --alpha 0.2` gives the same output (but where Argos
replaces an unknown piece with a source piece). LibreTranslate then gives each
answer the source's case (all lowercase for a lowercase source) and its final
punctuation mark.
"""


def unsupported(tok, run_dir: Path) -> list[str]:
    """What an Argos package cannot hold of this run, each with the reason; empty when it can."""
    problems = []
    if len(_spm_files(run_dir)) != 1:
        problems.append("separate source and target vocabularies (data.joint_vocab=false): Argos Translate has "
                        "one sentencepiece model for both sides")  # fmt: skip
    if tok.src_text.mode != "raw" or tok.tgt_text.mode != "raw":
        problems.append(f"data.text={tok.src_text.mode}: Argos Translate gives sentencepiece the raw text, "
                        "not lowercased and Moses-tokenized")  # fmt: skip
    return problems


def _spm_files(run_dir: Path) -> list[Path]:
    from mt.data.tokenizer import Tokenizer

    return [f for f in Tokenizer.files(run_dir) if f.suffix == ".model"]


def export_argos(
    run_dir: Path, out: Path, quantization: str = "none", name: str | None = None,
    package_version: str = "1.0", force: bool = False,
) -> dict:  # fmt: skip
    """Write the package ``out`` (a zip file, complete or not at all), then translate
    ``CHECK_SENTENCES`` greedily with ``mt`` and with the package's CTranslate2 model."""
    require_ctranslate2("argos")
    check_quantization(quantization)
    try:
        import spacy
    except ImportError:
        raise MTError("mt export --to argos needs spaCy (the package's sentence splitter): "
                      "pip install -e '.[export]'") from None  # fmt: skip
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        if not _ours(out):
            raise MTError(f"{out}: exists and is not an Argos package mt wrote; it is left as it is: "
                          "choose another OUT")  # fmt: skip
        if not force:
            raise MTError(f"{out}: already exists (an earlier mt export: add --force to replace it)")
    model, tok, meta = load_textbook(run_dir)
    problems = unsupported(tok, run_dir)
    if problems:
        raise MTError("cannot export to Argos Translate: " + "; ".join(problems))
    src, tgt = run_language(run_dir, "src"), run_language(run_dir, "tgt")
    name = name or f"mt-{src}_{tgt}"
    if not name or "/" in name or name in (".", ".."):
        raise MTError(f"--name {name!r}: must be a plain file name (it names the package's directory)")
    with tempfile.TemporaryDirectory(prefix="mt-argos-") as tmp:
        package = Path(tmp) / name
        (package / "model").mkdir(parents=True)
        write_model_directory(run_dir, model, tok, meta, package / "model", quantization, readme_path=out)
        shutil.copyfile(_spm_files(run_dir)[0], package / "sentencepiece.model")
        _blank_pipeline(spacy, src).to_disk(package / "spacy")
        metadata = {
            "name": name, "package_version": package_version, "argos_version": "1.9",
            "from_code": src, "from_name": LANGUAGE_NAMES.get(src, src),
            "to_code": tgt, "to_name": LANGUAGE_NAMES.get(tgt, tgt), "type": "translate",
        }  # fmt: skip
        (package / "metadata.json").write_text(json.dumps(metadata, indent=2, ensure_ascii=False) + "\n")
        info = {"exported_from": str(run_dir), "quantization": quantization, "mt_version": __version__}
        (package / EXPORT_JSON).write_text(json.dumps(info, indent=2) + "\n")
        (package / "README.md").write_text(README.format(
            name=name, src_name=metadata["from_name"], tgt_name=metadata["to_name"], src=src, tgt=tgt, out=out,
            run=run_dir, quantization=quantization, params=sum(p.numel() for p in model.parameters()),
        ))  # fmt: skip
        check = check_export(model, tok, package / "model")
        with atomic_output(out, binary=True) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
            for path in sorted(package.rglob("*")):
                z.write(path, path.relative_to(package.parent))
    return check


def _blank_pipeline(spacy, lang: str):
    """spaCy's tokenizer for ``lang`` with no trained component (Argos adds the rule-based
    sentencizer when it loads it); the multi-language one for a code spaCy does not know."""
    try:
        return spacy.blank(lang)
    except (ImportError, KeyError, ValueError):  # spaCy: "[E002] Can't find factory for 'xyz'"
        return spacy.blank("xx")


def _ours(path: Path) -> bool:
    """A zip file with ``EXPORT_JSON`` in its one directory: a package mt wrote."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.count("/") == 1 and n.endswith("/" + EXPORT_JSON) for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False
