"""``mt evaluate``: translate a test set and score it with sacreBLEU (BLEU,
chrF, signatures) and, with ``--paper``, the Multi30k papers' tokenized BLEU."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from mt.config import DECODING, DataConfig
from mt.data.corpus import ENV_DATA_DIR, read_lines
from mt.decode.inference import default_alpha
from mt.decode.translator import Translator
from mt.errors import DataError, MTError
from mt.evaluate.metrics import paper_bleu, sacrebleu_scores
from mt.textio import atomic_output


def run_config(run_dir: Path) -> dict:
    """The run's resolved ``config.yaml`` as a dict; {} when there is none."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable run config ({e})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def split_texts(run_dir: Path, split: str) -> tuple[list[str], list[str], dict]:
    """Source and reference lines of a split, from the raw corpus the run was prepared from."""
    data = run_config(run_dir).get("data", {})
    local = data.get("local_dir") or os.environ.get(ENV_DATA_DIR)
    where = run_dir / "config.yaml"
    if not data:
        raise DataError(f"{where}: missing or without a data section; give --src FILE --ref FILE")
    try:
        prepared = DataConfig(**data).prepared_path()
    except (TypeError, ValueError) as e:  # a config this version cannot read
        raise DataError(f"{where}: unusable data section ({e}); give --src FILE --ref FILE") from None
    if (prepared / split).is_dir():
        from mt.data.batches import Split

        s = Split(prepared / split)
        return s.src_text, s.tgt_text, data
    if local:
        from mt.data.corpus import read_local

        splits, _ = read_local(Path(local), data["src_lang"], data["tgt_lang"])
        if split in splits:
            return *splits[split].lines(), data
    raise DataError(
        f"split {split!r} not found in {prepared} or a local corpus directory; "
        f"run `mt prepare` or give --src FILE --ref FILE"
    )


def find_paper_reference(data: dict, split: str) -> Path | None:
    """Multi30k's tokenized references, tok/<split>.lc.norm.tok.<lang>: beside a local
    corpus's raw/ directory, or where ``mt prepare`` downloaded them (data/raw/<corpus>/tok/)."""
    name = f"{split}.lc.norm.tok.{data.get('tgt_lang')}"
    local = data.get("local_dir") or os.environ.get(ENV_DATA_DIR)
    candidates = [Path(local).parent / "tok" / name] if local else []
    candidates.append(Path("data/raw") / str(data.get("corpus")) / "tok" / name)
    return next((c for c in candidates if c.is_file()), None)


def variant_suffix(
    alpha: float | None,
    dtype: str,
    max_len_a: float,
    max_len_b: int,
    also: Sequence[str] = (),
    loop_margin: int | None = DECODING.loop_margin,
    default_alpha: float = DECODING.alpha,
) -> str:
    """The decoding options that differ from the defaults, for file names:
    ``.alpha0.6.bfloat16`` for ``--alpha 0.6 --dtype bfloat16``; empty for
    the defaults. ``alpha``: None or ``default_alpha`` (the model's own) is the
    default. ``also``: an ensemble's other members, ``.with-NAME`` each."""
    parts = [f"with-{Path(d).name}" for d in also]
    parts += [f"alpha{alpha:g}"] if alpha is not None and alpha != default_alpha else []
    parts += [dtype] if dtype != DECODING.dtype else []
    default_len = (DECODING.max_len_a, DECODING.max_len_b)
    parts += [f"len{max_len_a:g}x+{max_len_b}"] if (max_len_a, max_len_b) != default_len else []
    parts += [f"loop{'off' if loop_margin is None else loop_margin}"] if loop_margin != DECODING.loop_margin else []
    return "".join(f".{p}" for p in parts)


def evaluate(
    translator: Translator,
    run_dir: Path,
    sources: list[str],
    refs: list[str],
    name: str,
    tgt_lang: str,
    paper_ref: Path | None = None,
    variant: str = "",
    ensemble: Sequence[str] = (),
) -> dict:
    """Translate ``sources``, score them and write ``eval/NAME.beamK[VARIANT].hyp`` and ``.json``
    into ``run_dir``; ``variant`` (see :func:`variant_suffix`) keeps runs with other settings apart.
    ``ensemble``: the run directories of all members, when the translator decodes with several models."""
    if len(sources) != len(refs):
        raise DataError(f"{name}: {len(sources)} source lines but {len(refs)} references")
    tok_refs = None
    if paper_ref is not None:  # checked before decoding, which can take minutes
        tok_refs = read_lines(paper_ref)
        if len(tok_refs) != len(sources):
            raise DataError(f"{paper_ref}: {len(tok_refs)} lines, expected {len(sources)}")
    start = time.perf_counter()
    # as mt translate has it: a line longer than the model's positions is translated in parts
    hyps = [n_best[0][0] for n_best in translator.stream(sources, chunk=len(sources))]
    seconds = time.perf_counter() - start
    dtype = translator.dtype_name
    scores = {"test_set": name, "sentences": len(hyps), "beam": translator.beam, "alpha": translator.alpha}
    # the speed of this run (tokenizing and decoding, on whatever else the machine was doing)
    scores |= {"workers": translator.workers, "decode_seconds": round(seconds, 3)}
    scores |= {"sentences_per_s": round(len(hyps) / max(seconds, 1e-9), 1)}
    settings = translator.settings
    scores |= {"max_len": f"{settings.max_len_a:g}*src+{settings.max_len_b}", "loop_margin": settings.loop_margin}
    scores |= {"dtype": dtype}
    scores |= {"ensemble": [str(d) for d in ensemble]} if ensemble else {}
    scores |= sacrebleu_scores(hyps, refs, lowercase=translator.tok.lowercase)
    if tok_refs is not None:
        p = paper_bleu(hyps, tok_refs, tgt_lang)
        scores["paper_bleu"] = round(p.score, 2)
        scores["paper_bleu_detail"] = f"{p} (lowercased, Moses-normalised and -tokenized vs {paper_ref.name})"
    out = run_dir / "eval"
    try:
        out.mkdir(exist_ok=True)
    except OSError as e:
        raise DataError(f"{out}: cannot make the directory for the scores ({e.strerror})") from None
    stem = f"{name}.beam{translator.beam}{variant}"
    with atomic_output(out / f"{stem}.hyp") as f:
        f.writelines(h + "\n" for h in hyps)
    with atomic_output(out / f"{stem}.json") as f:
        json.dump(scores, f, indent=2)
    return scores


def run(args, translator: Translator) -> None:
    """``mt evaluate``: the test set named by ``--split`` or ``--src``/``--ref``, scored and reported."""
    run_dir = Path(args.model[0])  # an ensemble's scores go with its first member
    if args.split and not args.src:
        sources, refs, data = split_texts(run_dir, args.split)
        name = args.split
    elif args.src and args.ref and not args.split:
        sources, refs = read_lines(Path(args.src)), read_lines(Path(args.ref))
        if len(sources) != len(refs):
            raise MTError(f"{args.src} has {len(sources)} lines but {args.ref} has {len(refs)}")
        data, name = run_config(run_dir).get("data", {}), Path(args.src).stem
    else:
        raise MTError("give either --split NAME or --src FILE --ref FILE")
    if not sources:
        where = args.src if args.src else f"split {args.split!r}"
        raise MTError(f"{where}: no lines: an empty test set has no score")
    paper_ref = None
    if args.paper:
        paper_ref = Path(args.paper_ref) if args.paper_ref else find_paper_reference(data, name)
        if paper_ref is None:
            raise MTError(f"--paper: no tokenized reference found for {name}; give --paper-ref FILE")
    options = (args.alpha, args.dtype, args.max_len_a, args.max_len_b, args.model[1:], args.loop_margin)
    variant = variant_suffix(*options, default_alpha=default_alpha(args.model))
    members = args.model if len(args.model) > 1 else []
    scores = evaluate(translator, run_dir, sources, refs, name, data.get("tgt_lang", "de"), paper_ref, variant, members)
    print(json.dumps(scores, indent=2) if args.json else report(scores, len(members), run_dir / "eval"))


def report(scores: dict, members: int, where: Path) -> str:
    """``evaluate``'s scores as ``mt evaluate`` prints them."""
    ensemble = f", ensemble of {members} models" if members else ""
    workers = scores["workers"]
    lines = [
        f"{scores['test_set']}: BLEU {scores['bleu']}  chrF {scores['chrf']}  "
        f"(beam {scores['beam']}, {scores['sentences']} sentences, {scores['dtype']}{ensemble})",
        f"  decoded in {scores['decode_seconds']} s, {scores['sentences_per_s']} sentences/s, "
        f"{workers} worker{'s' if workers > 1 else ''}",
        f"  {scores['bleu_detail']}",
        f"  BLEU signature: {scores['bleu_signature']}",
        f"  chrF signature: {scores['chrf_signature']}",
    ]
    if "paper_bleu" in scores:
        lines.append(f"  paper-style BLEU: {scores['paper_bleu']}  ({scores['paper_bleu_detail']})")
    lines.append(f"  hypotheses and scores written to {where}")
    return "\n".join(lines)
