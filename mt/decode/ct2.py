"""Decoding a CTranslate2 export (``mt export --to ct2``) with CTranslate2 itself,
behind the same interface as ``mt.decode.translator.Translator``.
"""

from __future__ import annotations

import json
from pathlib import Path

from mt.config import DECODING
from mt.data.tokenizer import Tokenizer
from mt.decode.search import SearchSettings, normalized
from mt.decode.translator import LineTranslator
from mt.errors import MTError

EXPORT_JSON = "mt_export.json"  # in every directory mt export writes: what it was made from


def is_ct2_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by ``mt export --to ct2``."""
    return (Path(path) / "model.bin").exists() and (Path(path) / EXPORT_JSON).exists()


class CT2Translator(LineTranslator):
    """A CTranslate2 export decoded with CTranslate2, with ``mt``'s tokenizer on
    both sides: the same text in and out, and the same methods ``mt translate``
    and ``mt evaluate`` use, as ``mt.decode.translator.Translator``. CTranslate2 limits
    the output length per batch, by its longest source: greedy outputs are cut
    to their own sentence's limit, beam search's keep the batch's. Prefixes
    (``mt translate --prefix-file``) are not supported here."""

    def __init__(
        self,
        directory: str | Path,
        beam: int = 5,
        alpha: float = 1.0,
        batch_size: int = 64,
        max_len_a: float | None = None,
        max_len_b: int | None = None,
        compute_type: str = "default",
        warn=None,
    ):
        try:
            import ctranslate2
        except ImportError:
            needs = "decoding it needs pip install -e '.[export]'"
            raise MTError(f"{directory} is a CTranslate2 export: {needs}") from None
        directory = Path(directory)
        try:
            self.info = json.loads((directory / EXPORT_JSON).read_text())
            self.max_positions = int(self.info["model"]["max_positions"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MTError(f"{directory / EXPORT_JSON}: unreadable ({e})") from None
        self.tok = Tokenizer.load(directory)
        self.beam, self.alpha, self.batch_size, self.workers = beam, alpha, batch_size, 1
        a = DECODING.max_len_a if max_len_a is None else max_len_a
        b = DECODING.max_len_b if max_len_b is None else max_len_b
        # CTranslate2 has no loop guard like mt's (its no_repeat_ngram_size forbids every repeated n-gram)
        self.settings = SearchSettings(self.tok.bos_id, self.tok.eos_id, self.tok.pad_id, a, b, loop_margin=None)
        self.warn = warn or (lambda msg: None)
        try:
            self.translator = ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type)
        except (RuntimeError, ValueError) as e:
            raise MTError(f"{directory}: CTranslate2 cannot load it ({e})") from None
        self.dtype_name = f"ct2-{self.translator.compute_type}"

    @property
    def max_source_pieces(self) -> int:
        """The most source pieces the model reads (its positions, less the EOS)."""
        return self.max_positions - 1

    def translate(self, lines: list[str], first_line: int = 1) -> list[str]:
        return [n_best[0][0] for n_best in self.translate_nbest(lines, first_line)]

    def translate_nbest(
        self, lines: list[str], first_line: int = 1, n_best: int = 1, prefixes: list[str] | None = None,
        labels: list[str] | None = None,
    ) -> list[list[tuple[str, float]]]:  # fmt: skip
        """Per line, its ``n_best`` (translation, score), best first; an empty line, ``n_best`` empty ones
        (``labels``: as ``LineTranslator.translate_nbest``)."""
        if prefixes is not None and any(prefixes):
            raise MTError("prefixes (--prefix-file) need an mt run directory, not a CTranslate2 export")
        ids = self.tok.encode_src(lines)
        limit = self.max_positions
        for n, x in enumerate(ids):  # as Translator.encode: at most max_positions - 1 pieces, then EOS
            if len(x) > limit:
                where = labels[n] if labels else f"line {first_line + n}"
                self.warn(f"{where}: {len(x) - 1} subword tokens, truncated to {limit - 1}")
        todo = sorted((i for i, x in enumerate(ids) if x), key=lambda i: len(ids[i]))
        out: list[list[tuple[str, float]]] = [[("", 0.0)] * n_best for _ in lines]  # as Translator
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start : start + self.batch_size]
            pieces = [self.tok.src_pieces(ids[i][:-1][: limit - 1]) for i in batch]  # CTranslate2 adds the EOS
            results = self.translator.translate_batch(
                pieces, beam_size=self.beam, length_penalty=self.alpha, num_hypotheses=n_best, return_scores=True,
                max_decoding_length=max(self._most_tokens(p) for p in pieces), max_input_length=0,
            )  # fmt: skip
            hypotheses = [(r.hypotheses, r.scores) for r in results]
            if self.beam == 1:
                hypotheses = self._cut_to_own_limits(pieces, hypotheses)
            for i, (hyps, scores) in zip(batch, hypotheses):
                ids_out = [[self.tok.tgt.piece_to_id(p) for p in h] for h in hyps]
                out[i] = list(zip(self.tok.decode_tgt(ids_out), scores))
        return out

    def _most_tokens(self, src: list[str]) -> int:
        """The most tokens mt's search generates for a source of these pieces, EOS
        included (``mt.decode.search.max_lengths``; CTranslate2 adds the source's EOS)."""
        own = int(self.settings.max_len_a * (len(src) + 1) + self.settings.max_len_b)
        return max(1, min(self.max_positions - 1, own))

    def _cut_to_own_limits(self, pieces: list[list[str]], hypotheses: list[tuple[list, list]]) -> list[tuple]:
        """Greedy outputs cut to each sentence's own length limit, as mt's search has
        it (CTranslate2's is the batch's). Greedy search picks each token whatever
        the limit, so the cut output is what the sentence's own limit gives; mt ends
        it there with a forced EOS, and the cut output is scored that way."""
        cut = []
        for k, (src, (hyps, _)) in enumerate(zip(pieces, hypotheses)):
            most = self._most_tokens(src) - 1  # tokens before the EOS
            if len(hyps[0]) > most:
                cut.append((k, hyps[0][:most]))
        if cut:
            scored = self.translator.score_batch([pieces[k] for k, _ in cut], [h for _, h in cut])
            for (k, h), result in zip(cut, scored):  # log-probabilities of h's tokens and the EOS
                hypotheses[k] = ([h], [normalized(sum(result.log_probs), float(len(result.log_probs)), self.alpha)])
        return hypotheses
