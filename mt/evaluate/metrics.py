"""BLEU and chrF with sacreBLEU, and the Multi30k papers' tokenized BLEU."""

from __future__ import annotations

import sacrebleu


def bleu(hyps: list[str], refs: list[str], lowercase: bool = False) -> sacrebleu.metrics.bleu.BLEUScore:
    """Detokenized corpus BLEU (sacreBLEU's 13a tokenizer), cased unless ``lowercase``."""
    return sacrebleu.corpus_bleu(hyps, [refs], lowercase=lowercase)


def sacrebleu_scores(hyps: list[str], refs: list[str], lowercase: bool = False) -> dict:
    """BLEU and chrF with sacreBLEU's default settings, and their signatures.
    ``lowercase`` (for models that only write lowercase) shows as ``case:lc``."""
    out = {}
    for name, metric in (("bleu", sacrebleu.BLEU(lowercase=lowercase)), ("chrf", sacrebleu.CHRF(lowercase=lowercase))):
        score = metric.corpus_score(hyps, [refs])
        out[name] = round(score.score, 2)
        out[f"{name}_signature"] = str(metric.get_signature())
        out[f"{name}_detail"] = str(score)
    return out


def paper_tokenize(lines: list[str], lang: str) -> list[str]:
    """Multi30k papers' text: lowercased, punctuation-normalised, Moses-tokenized
    (with Moses' XML escaping, as in the dataset's tok/ references)."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    norm, tok = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [tok.tokenize(norm.normalize(line.lower()), return_str=True, escape=True) for line in lines]


def paper_bleu(hyps: list[str], tok_refs: list[str], lang: str) -> sacrebleu.metrics.bleu.BLEUScore:
    """BLEU as Multi30k papers report it (multi-bleu style): the hypotheses
    tokenized like the references, then no further tokenization."""
    return sacrebleu.corpus_bleu(paper_tokenize(hyps, lang), [tok_refs], tokenize="none", force=True)
