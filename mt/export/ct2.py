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
from collections.abc import Callable
from pathlib import Path

import numpy as np
from torch import Tensor, nn

from mt.data.tokenizer import Tokenizer
from mt.decode.ct2 import EXPORT_JSON
from mt.errors import MTError
from mt.model.transformer import Transformer
from mt.textio import abandon_directory, begin_directory, finish_directory

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
    require_ctranslate2("ct2")
    check_quantization(quantization)
    run_dir, out = Path(run_dir), Path(out)
    if (out / EXPORT_JSON).is_file() and not force:
        raise MTError(f"{out}: already exists (an earlier mt export: add --force to replace it)")
    model, tok, meta = load_textbook(run_dir)
    partial = begin_directory(out, EXPORT_JSON, "choose another OUT")  # never a half-written model at `out`
    try:
        write_model_directory(run_dir, model, tok, meta, partial, quantization, readme_path=out)
        finish_directory(partial, out)
    except BaseException:
        abandon_directory(partial)
        raise
    return check_export(model, tok, out)


def require_ctranslate2(to: str) -> None:
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise MTError(f"mt export --to {to} needs CTranslate2: pip install -e '.[export]'") from None


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise MTError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def load_textbook(run_dir: Path) -> tuple[Transformer, Tokenizer, dict]:
    """The run's model as training ran it (the textbook modules), which the converters read."""
    from mt.decode.inference import load

    return load(run_dir, fast=False)


def write_model_directory(
    run_dir: Path, model: Transformer, tok: Tokenizer, meta: dict, directory: Path, quantization: str,
    readme_path: Path,
) -> None:  # fmt: skip
    """Fill the existing ``directory`` with the CTranslate2 model, the run's tokenizer and
    config, ``EXPORT_JSON`` and a README whose snippet loads it from ``readme_path``."""
    spec = ct2_spec(model, tok)
    spec.validate()
    spec.optimize(quantization=None if quantization == "none" else quantization)
    spec.save(str(directory))
    for f in [*Tokenizer.files(run_dir), run_dir / "config.yaml"]:  # the config: mt evaluate --split
        if f.exists():
            shutil.copyfile(f, directory / f.name)
    files = [f.name for f in Tokenizer.files(run_dir) if f.suffix == ".model"]
    src_spm, tgt_spm = (files[0], files[0]) if len(files) == 1 else (files[0], files[1])
    info = {"exported_from": str(run_dir), "quantization": quantization, "model": meta["model"],
            "source": meta.get("source"), "src_spm": src_spm, "tgt_spm": tgt_spm}  # fmt: skip
    if "decoding" in meta:  # the length penalty chosen for the run on validation: mt decodes the export with it
        info["decoding"] = meta["decoding"]
    (directory / EXPORT_JSON).write_text(json.dumps(info, indent=2) + "\n")
    text_note = (
        "This model was trained on paper-style text (lowercased, Moses-tokenized): `mt translate` prepares "
        "the input and restores the output the same way; the snippet above does not. "
        if tok.src_text.mode != "raw"
        else ""
    )
    (directory / "README.md").write_text(README.format(
        name=readme_path.name, run=run_dir, out=readme_path, quantization=quantization,
        src=run_language(run_dir, "src"), tgt=run_language(run_dir, "tgt"),
        params=sum(p.numel() for p in model.parameters()), src_spm=src_spm, tgt_spm=tgt_spm, text_note=text_note,
    ))  # fmt: skip


def check_export(model: Transformer, tok: Tokenizer, directory: Path) -> dict:
    """``check_export_sentences`` for the CTranslate2 model in ``directory``."""
    from mt.decode.ct2 import CT2Translator

    return check_export_sentences(model, tok, CT2Translator(directory, beam=1).translate)


def check_export_sentences(model: Transformer, tok: Tokenizer, theirs: Callable[[list[str]], list[str]]) -> dict:
    """``CHECK_SENTENCES`` translated greedily by ``mt`` and by ``theirs`` (the export):
    how many are the same, and the first that is not."""
    from mt.decode.translator import Translator

    ours = Translator(model, tok, beam=1, workers=1).translate(CHECK_SENTENCES)
    other = theirs(CHECK_SENTENCES)
    same = sum(a == b for a, b in zip(ours, other))
    first = next(((s, a, b) for s, a, b in zip(CHECK_SENTENCES, ours, other) if a != b), None)
    return {"sentences": len(CHECK_SENTENCES), "same": same, "first_difference": first}


def run_language(run_dir: Path, side: str) -> str:
    from mt.evaluate.scoring import run_config

    return run_config(run_dir).get("data", {}).get(f"{side}_lang", "?")
