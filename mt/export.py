"""``mt export --to ct2``: a trained model as a CTranslate2 model directory.

The converter fills CTranslate2's own specification (``ctranslate2.specs``)
from ``mt``'s modules, the way CTranslate2's converters for OpenNMT-py or
Marian do, and lets CTranslate2 validate, quantize and write it. Every part
of the architecture has its place in the specification:

====================================  =========================================
mt                                    CTranslate2
====================================  =========================================
``norm_first`` (pre-/post-LN)         ``pre_norm``; the final norms with pre-LN
``activation`` relu / gelu (erf)      ``Activation.RELU`` / ``Activation.GELU``
embeddings × √d_model                 ``scale_embeddings`` (√d_model)
position table, sinusoidal/learned    ``position_encodings``: ``mt``'s own table
``share_embeddings``, ``tie_output``  the same array for the embeddings and the
                                      output projection (no output bias)
Q, K, V and output projections        fused QKV (self), Q + fused KV (cross)
LayerNorm ε 1e-5                      ``layer_norm_epsilon``
EOS after each source sentence        ``add_source_eos``
====================================  =========================================

A model that the specification could not express is refused with the option
named (``unsupported``), never exported as a different model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from torch import Tensor, nn

from mt.errors import MTError
from mt.model import Transformer
from mt.tokenizer import Tokenizer

QUANTIZATIONS = ("none", "int8", "int8_float32", "int16", "float16", "bfloat16")

# Sentences the export translates with both engines to check the copy (English,
# as Multi30k's sources; for another source language the pieces still test the
# arithmetic, which is what the check is for).
CHECK_SENTENCES = [
    "A man rides a bike.",
    "Two dogs are playing in the snow.",
    "A woman in a red dress is walking down the street with her child.",
    "People are sitting on a bench in front of a large building.",
    "A little girl climbs into a wooden playhouse.",
    "The boy jumps off the diving board into the pool.",
]

README = """# {name}: an `mt` model for CTranslate2

Exported by `mt export --model {run} --to ct2 {out} --quantization {quantization}`
from `{run}` ({src} → {tgt}, {params:,} parameters).

```python
import ctranslate2, sentencepiece as spm

translator = ctranslate2.Translator("{out}", device="cpu")
sp_src, sp_tgt = spm.SentencePieceProcessor("{out}/{src_spm}"), spm.SentencePieceProcessor("{out}/{tgt_spm}")
result = translator.translate_batch([sp_src.encode("A man rides a bike.", out_type=str)], beam_size=5)
print(sp_tgt.decode(result[0].hypotheses[0]))
```

The model adds `</s>` to each source sentence itself. {text_note}`mt translate --model {out}`
and `mt evaluate --model {out}` decode this directory with CTranslate2.
"""


def unsupported(model: Transformer) -> list[str]:
    """The model's options that a CTranslate2 Transformer cannot express, each
    with the reason; empty when the export is exact."""
    cfg, problems = model.cfg, []
    if cfg.activation not in ("relu", "gelu"):
        problems.append(f"model.activation={cfg.activation!r}: CTranslate2 has relu and gelu here")
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    if any(m.eps != norms[0].eps or not m.elementwise_affine for m in norms):
        problems.append("layer norms with different epsilons or without weights")
    if model.output is not None and getattr(model.output, "bias", None) is not None:
        problems.append("an output projection with a bias")
    return problems


def _array(t: Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()


def _linear(spec, weight: Tensor, bias: Tensor | None) -> None:
    spec.weight = _array(weight)
    if bias is not None:
        spec.bias = _array(bias)


def _fused(spec, projections: list[nn.Linear]) -> None:
    _linear(spec, _cat([p.weight for p in projections]), _cat([p.bias for p in projections]))


def _cat(tensors: list[Tensor | None]) -> Tensor | None:
    import torch

    return None if any(t is None for t in tensors) else torch.cat(tensors, 0)


def _norm(spec, norm: nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _attention(spec, attn, norm: nn.LayerNorm, self_attention: bool) -> None:
    if self_attention:
        _fused(spec.linear[0], [attn.w_q, attn.w_k, attn.w_v])
    else:
        _linear(spec.linear[0], attn.w_q.weight, attn.w_q.bias)
        _fused(spec.linear[1], [attn.w_k, attn.w_v])
    _linear(spec.linear[-1], attn.w_o.weight, attn.w_o.bias)
    _norm(spec.layer_norm, norm)


def _ffn(spec, ffn, norm: nn.LayerNorm) -> None:
    _linear(spec.linear_0, ffn.w_1.weight, ffn.w_1.bias)
    _linear(spec.linear_1, ffn.w_2.weight, ffn.w_2.bias)
    _norm(spec.layer_norm, norm)


def ct2_spec(model: Transformer, tok: Tokenizer):
    """The CTranslate2 ``TransformerSpec`` of a textbook ``mt`` model (``load(fast=False)``)."""
    from ctranslate2.specs import common_spec, transformer_spec

    problems = unsupported(model)
    if problems:
        raise MTError("cannot export to CTranslate2 exactly: " + "; ".join(problems))
    cfg = model.cfg
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[cfg.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.enc_layers, cfg.dec_layers), cfg.n_heads, pre_norm=cfg.norm_first, activation=activation
    )
    positions_src = _array(model.src_pos.table[: cfg.max_positions])
    positions_tgt = _array(model.tgt_pos.table[: cfg.max_positions])
    for side, embed, positions in ((spec.encoder, model.src_embed, positions_src),
                                   (spec.decoder, model.tgt_embed, positions_tgt)):  # fmt: skip
        embeddings = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings  # one source
        embeddings.weight = _array(embed.weight)
        side.scale_embeddings = True  # CTranslate2 scales by sqrt(d_model), as mt does
        side.position_encodings.encodings = positions
        if cfg.norm_first:
            _norm(side.layer_norm, model.enc_norm if side is spec.encoder else model.dec_norm)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder):
        _attention(layer_spec.self_attention, layer.self_attn, layer.attn_sub.norm, self_attention=True)
        _ffn(layer_spec.ffn, layer.ffn, layer.ffn_sub.norm)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder):
        _attention(layer_spec.self_attention, layer.self_attn, layer.self_sub.norm, self_attention=True)
        _attention(layer_spec.attention, layer.cross_attn, layer.cross_sub.norm, self_attention=False)
        _ffn(layer_spec.ffn, layer.ffn, layer.ffn_sub.norm)
    spec.decoder.projection.weight = _array(model.output_weight)

    spec.config.layer_norm_epsilon = next(m.eps for m in model.modules() if isinstance(m, nn.LayerNorm))
    spec.config.unk_token = tok.src.id_to_piece(tok.unk_id)
    spec.config.bos_token = spec.config.decoder_start_token = tok.tgt.id_to_piece(tok.bos_id)
    spec.config.eos_token = tok.tgt.id_to_piece(tok.eos_id)
    spec.config.add_source_eos = True  # mt's sources end with EOS (Tokenizer.encode_src)
    spec.register_source_vocabulary([tok.src.id_to_piece(i) for i in range(len(tok.src))])
    spec.register_target_vocabulary([tok.tgt.id_to_piece(i) for i in range(len(tok.tgt))])
    return spec


def export_ct2(run_dir: Path, out: Path, quantization: str = "none", force: bool = False) -> dict:
    """Write ``out`` (a CTranslate2 model directory with the tokenizer and a
    README), then translate ``CHECK_SENTENCES`` greedily with both engines.
    Returns the check: how many translations are the same, and the first that is not."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise MTError("mt export --to ct2 needs CTranslate2: pip install -e '.[export]'") from None
    from mt.inference import Translator, load

    if quantization not in QUANTIZATIONS:
        raise MTError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and not (force and (out / "model.bin").exists()):
        what = "a CTranslate2 model: add --force to replace it" if (out / "model.bin").exists() else "not one of ours"
        raise MTError(f"{out}: already exists ({what})")
    model, tok, meta = load(run_dir, fast=False)
    spec = ct2_spec(model, tok)
    spec.validate()
    spec.optimize(quantization=None if quantization == "none" else quantization)

    partial = out.with_name(out.name + ".partial")  # never a half-written model at `out`
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        spec.save(str(partial))
        for f in [*Tokenizer.files(run_dir), run_dir / "config.yaml"]:  # the config: mt evaluate --split
            if f.exists():
                shutil.copyfile(f, partial / f.name)
        files = [f.name for f in Tokenizer.files(run_dir) if f.suffix == ".model"]
        src_spm, tgt_spm = (files[0], files[0]) if len(files) == 1 else (files[0], files[1])
        info = {"exported_from": str(run_dir), "quantization": quantization, "model": meta["model"],
                "source": meta.get("source"), "src_spm": src_spm, "tgt_spm": tgt_spm}  # fmt: skip
        (partial / "mt_export.json").write_text(json.dumps(info, indent=2) + "\n")
        text_note = (
            "This model was trained on paper-style text (lowercased, Moses-tokenized): `mt translate` prepares "
            "the input and restores the output the same way; the snippet above does not. "
            if tok.src_text.mode != "raw"
            else ""
        )
        (partial / "README.md").write_text(README.format(
            name=out.name, run=run_dir, out=out, quantization=quantization, src=_lang(run_dir, "src"),
            tgt=_lang(run_dir, "tgt"), params=sum(p.numel() for p in model.parameters()), src_spm=src_spm,
            tgt_spm=tgt_spm, text_note=text_note,
        ))  # fmt: skip
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise

    ours = Translator(model, tok, beam=1, workers=1).translate(CHECK_SENTENCES)
    theirs = CT2Translator(out, beam=1).translate(CHECK_SENTENCES)
    same = sum(a == b for a, b in zip(ours, theirs))
    first = next(((s, a, b) for s, a, b in zip(CHECK_SENTENCES, ours, theirs) if a != b), None)
    return {"sentences": len(CHECK_SENTENCES), "same": same, "first_difference": first}


def _lang(run_dir: Path, side: str) -> str:
    from mt.evaluate import run_config

    return run_config(run_dir).get("data", {}).get(f"{side}_lang", "?")


def is_ct2_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by ``mt export --to ct2``."""
    return (Path(path) / "model.bin").exists() and (Path(path) / "mt_export.json").exists()


class CT2Translator:
    """A CTranslate2 export decoded with CTranslate2, with ``mt``'s tokenizer on
    both sides: the same text in and out, and the same methods ``mt translate``
    and ``mt evaluate`` use, as ``mt.inference.Translator``. CTranslate2 limits
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
        from mt.config import DECODING
        from mt.search import SearchSettings

        directory = Path(directory)
        try:
            self.info = json.loads((directory / "mt_export.json").read_text())
            self.max_positions = int(self.info["model"]["max_positions"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MTError(f"{directory / 'mt_export.json'}: unreadable ({e})") from None
        self.tok = Tokenizer.load(directory)
        self.beam, self.alpha, self.batch_size, self.workers = beam, alpha, batch_size, 1
        a = DECODING.max_len_a if max_len_a is None else max_len_a
        b = DECODING.max_len_b if max_len_b is None else max_len_b
        self.settings = SearchSettings(self.tok.bos_id, self.tok.eos_id, self.tok.pad_id, a, b)
        self.warn = warn or (lambda msg: None)
        try:
            self.translator = ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type)
        except (RuntimeError, ValueError) as e:
            raise MTError(f"{directory}: CTranslate2 cannot load it ({e})") from None
        self.dtype_name = f"ct2-{self.translator.compute_type}"

    def translate(self, lines: list[str], first_line: int = 1) -> list[str]:
        return [n_best[0][0] for n_best in self.translate_nbest(lines, first_line)]

    def translate_nbest(
        self, lines: list[str], first_line: int = 1, n_best: int = 1, prefixes: list[str] | None = None
    ) -> list[list[tuple[str, float]]]:
        """Per line, its ``n_best`` (translation, score), best first; an empty line, ``n_best`` empty ones."""
        if prefixes is not None and any(prefixes):
            raise MTError("prefixes (--prefix-file) need an mt run directory, not a CTranslate2 export")
        ids = self.tok.encode_src(lines)
        limit = self.max_positions
        for n, x in enumerate(ids):  # as Translator.encode: at most max_positions - 1 pieces, then EOS
            if len(x) > limit:
                self.warn(f"line {first_line + n}: {len(x) - 1} subword tokens, truncated to {limit - 1}")
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
        included (``mt.search.max_lengths``; CTranslate2 adds the source's EOS)."""
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
                hypotheses[k] = ([h], [sum(result.log_probs) / len(result.log_probs) ** self.alpha])
        return hypotheses

    def stream(self, lines, chunk: int = 1000, n_best: int = 1, prefixes=None):
        from mt.inference import Translator

        return Translator.stream(self, lines, chunk, n_best, prefixes)

    def _run(self, pairs, first: int, n_best: int):
        from mt.inference import Translator

        return Translator._run(self, pairs, first, n_best)
