"""A model's length penalty, chosen on validation: ``mt choose-alpha`` and
``train.choose_alpha`` at the end of training.

Beam search ranks finished hypotheses by log-probability / length**alpha, so a
larger alpha favours longer output. How long a model's translations come out
at a given alpha depends on the model (its training, label smoothing, how far
it got), so no single default suits every model: the Multi30k hour's model,
for one, ends its translations early at alpha 1 (5% shorter than the
references on ``val``, which BLEU's brevity penalty punishes). Each alpha of a
grid decodes the validation split with beam search; the one of highest BLEU is
written into the run's ``model.json`` as ``"decoding": {"alpha": ...}``, with
every alpha's score, and becomes the model's default wherever it decodes
(``mt.decode.inference.default_alpha``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mt.config import DECODING
from mt.decode.inference import MODEL_JSON, DecodingOptions, open_translator
from mt.errors import MTError
from mt.evaluate.metrics import bleu
from mt.evaluate.scoring import split_texts
from mt.textio import publish


def choose_alpha(run_dir: Path, alphas: Sequence[float], split: str = "val", beam: int = DECODING.beam) -> float:
    """The alpha of ``alphas`` whose beam search scores the highest BLEU on ``split``
    (ties: the smallest), written into ``run_dir``'s model.json with every alpha's BLEU."""
    if not alphas:
        raise MTError("no length penalties to choose from")
    for alpha in alphas:
        if not 0 <= alpha <= DECODING.max_alpha:
            raise MTError(f"length penalty {alpha}: must be between 0 and {DECODING.max_alpha:g}")
    run_dir = Path(run_dir)
    sources, refs, _ = split_texts(run_dir, split)
    if not sources:
        raise MTError(f"split {split!r}: no lines to choose a length penalty on")
    translator, meta = open_translator([run_dir], DecodingOptions(beam=beam), warn=lambda msg: None)
    scores: dict[float, float] = {}
    for alpha in sorted(set(alphas)):
        translator.alpha = alpha
        hyps = [n_best[0][0] for n_best in translator.stream(sources, chunk=len(sources))]
        scores[alpha] = round(bleu(hyps, refs, lowercase=translator.tok.lowercase).score, 2)
        print(f"alpha {alpha:g}: BLEU {scores[alpha]:.2f} on {split} (beam {beam})")
    best = max(scores, key=lambda a: (scores[a], -a))
    tried = {f"{a:g}": score for a, score in scores.items()}
    meta["decoding"] = {"alpha": best, "chosen_on": split, "beam": beam, "bleu": tried}
    tmp = run_dir / (MODEL_JSON + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    publish(tmp, run_dir / MODEL_JSON)
    return best
