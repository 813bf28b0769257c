"""BLEU and chrF with sacreBLEU, and the Multi30k papers' tokenized BLEU."""

from __future__ import annotations

import sacrebleu


def bleu(hyps: list[str], refs: list[str]) -> sacrebleu.metrics.bleu.BLEUScore:
    """Cased, detokenized corpus BLEU (sacreBLEU's 13a tokenizer)."""
    return sacrebleu.corpus_bleu(hyps, [refs])


def chrf(hyps: list[str], refs: list[str]) -> sacrebleu.metrics.chrf.CHRFScore:
    return sacrebleu.corpus_chrf(hyps, [refs])


def signature(metric: str) -> str:
    """sacreBLEU's signature string for the default BLEU or chrF settings."""
    m = sacrebleu.BLEU() if metric == "bleu" else sacrebleu.CHRF()
    return str(m.get_signature())


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
