"""``mt export --to hf``: a trained model as a Hugging Face transformers model
directory, in an existing architecture that holds it exactly.

=======================  =================================  ==================================
mt                       pre-LN (``norm_first``)            post-LN
=======================  =================================  ==================================
architecture             Blenderbot: pre-LN layers, final   Marian: post-LN layers, no final
                         norms, positions read from the     norms, sinusoidal positions that
                         weights (sinusoidal or learned)    it computes itself
embeddings × √d_model    ``scale_embedding``                ``scale_embedding``
position table           ``embed_positions`` = mt's table  mt's sinusoidal table, with the
                                                            model's width permuted (below);
                                                            learned positions are refused
shared / tied            ``tie_word_embeddings``; untied,   ``share_encoder_decoder_embeddings``,
                         each matrix is written (copies)    ``tie_word_embeddings``
=======================  =================================  ==================================

Marian's sinusoidal table holds the sines in the first half of the width and the
cosines in the second; mt's interleaves them. A permutation of the model's width
(the residual stream) changes nothing a Transformer computes if it is applied to
everything that reads or writes that stream: embeddings, layer norms, the inputs of
Q/K/V and of the first FFN layer, the outputs of the attention's output projection
and of the second FFN layer, and the output projection's input. The export applies
it, so Marian's own table meets mt's positions exactly.

The tokenizer is ``tokenizer.json`` made from the run's sentencepiece model by
transformers' own converter, which encodes as sentencepiece does (checked on
every Multi30k sentence), with ``</s>`` appended to each input, as mt does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor, nn

from mt import __version__
from mt.data.tokenizer import Tokenizer
from mt.decode.ct2 import EXPORT_JSON
from mt.decode.inference import default_alpha
from mt.errors import MTError
from mt.export.ct2 import check_export_sentences, load_textbook, run_language
from mt.model.transformer import Transformer
from mt.textio import abandon_directory, begin_directory, finish_directory

README = """# {name}: an `mt` model for Hugging Face transformers

{src} → {tgt}, {params:,} parameters, exported by `mt export --model {run} --to hf {out}`
as a {arch} model ({layout}).

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{out}")
model = AutoModelForSeq2SeqLM.from_pretrained("{out}")
batch = tokenizer(["A man rides a bike."], return_tensors="pt", padding=True)
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))
```

`model.generate()` starts from `<s>` and stops at `</s>`; beam search with
`num_beams=5, length_penalty={alpha:g}, early_stopping=True` (this directory's
generation config) is `mt translate`'s. transformers 4's
`pipeline("translation", model="{out}")` translates with it too (transformers 5
removed that pipeline); give it `num_beams=5`, as its own default of 4 wins over
the generation config. {text_note}
"""


def unsupported(model: Transformer, tok: Tokenizer) -> list[str]:
    """The model's options that no transformers architecture here holds exactly, each with
    the reason; empty when the export is exact."""
    cfg, problems = model.cfg, []
    if len(tok.src) != len(tok.tgt) or any(
        tok.src.id_to_piece(i) != tok.tgt.id_to_piece(i) for i in range(min(len(tok.src), len(tok.tgt)))
    ):
        problems.append("separate source and target vocabularies (data.joint_vocab=false): a transformers "
                        "tokenizer encodes both sides with one vocabulary")  # fmt: skip
    if cfg.activation not in ("relu", "gelu"):
        problems.append(f"model.activation={cfg.activation!r}: transformers has relu and gelu here")
    if not cfg.norm_first and cfg.positional != "sinusoidal":
        problems.append("model.positional=learned with model.norm_first=false: Marian (post-LN) computes its "
                        "positions and cannot load learned ones")  # fmt: skip
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    if any(m.eps != 1e-5 or not m.elementwise_affine for m in norms):
        problems.append("layer norms with an epsilon other than 1e-5 or without weights")
    if model.output is not None and getattr(model.output, "bias", None) is not None:
        problems.append("an output projection with a bias")
    return problems


def hf_model(model: Transformer, tok: Tokenizer):
    """The transformers model (Blenderbot for pre-LN, Marian for post-LN) that computes
    what ``model`` does, with its weights."""
    problems = unsupported(model, tok)
    if problems:
        raise MTError("cannot export to transformers exactly: " + "; ".join(problems))
    from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration, MarianConfig, MarianMTModel

    cfg = model.cfg
    shared = cfg.share_embeddings and cfg.tie_output
    common = dict(
        vocab_size=cfg.tgt_vocab_size, d_model=cfg.d_model, encoder_layers=cfg.enc_layers,
        decoder_layers=cfg.dec_layers, encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, max_position_embeddings=cfg.max_positions,
        activation_function=cfg.activation, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        scale_embedding=True, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
        decoder_start_token_id=tok.bos_id, forced_eos_token_id=None, tie_word_embeddings=shared,
        encoder_no_repeat_ngram_size=0, no_repeat_ngram_size=0,  # Blenderbot's defaults would change the search
    )  # fmt: skip
    if cfg.norm_first:
        hf = BlenderbotForConditionalGeneration(BlenderbotConfig(**common)).eval()
        order = None
    else:
        hf = MarianMTModel(MarianConfig(
            **(common | {"tie_word_embeddings": cfg.tie_output}), decoder_vocab_size=cfg.tgt_vocab_size,
            share_encoder_decoder_embeddings=cfg.share_embeddings,
        )).eval()  # fmt: skip
        order = _marian_order(model, hf)
    weights = _weights(model, order, cfg.norm_first)
    if hasattr(hf.model, "shared"):  # Marian without shared embeddings has none
        weights["model.shared.weight"] = weights["model.encoder.embed_tokens.weight"]
    with torch.no_grad():
        for name, value in weights.items():
            hf.get_parameter(name).copy_(value)
    return hf


def _marian_order(model: Transformer, hf) -> Tensor:
    """The permutation of the width that turns mt's sinusoidal table into Marian's:
    Marian's column j is mt's column ``order[j]``."""
    ours = model.src_pos.table[: model.cfg.max_positions].float()
    theirs = hf.model.encoder.embed_positions.weight.detach().float()
    order = torch.tensor([int((ours - col[:, None]).abs().amax(0).argmin()) for col in theirs.T])
    if sorted(order.tolist()) != list(range(ours.size(1))) or (ours[:, order] - theirs).abs().max() > 1e-4:
        raise MTError("cannot export to transformers exactly: mt's sinusoidal positions are not a permutation "
                      "of Marian's")  # fmt: skip
    return order


def _weights(model: Transformer, order: Tensor | None, pre_norm: bool) -> dict[str, Tensor]:
    """transformers' parameter names -> mt's weights (width permuted by ``order`` if given)."""
    cfg = model.cfg

    def reads(w: Tensor) -> Tensor:  # a matrix whose input is the residual stream: (out, D)
        return w if order is None else w[:, order]

    def writes(w: Tensor) -> Tensor:  # a matrix or bias whose output is the residual stream: (D, in) or (D,)
        return w if order is None else w[order]

    def bias(linear: nn.Linear) -> Tensor:
        return linear.bias if linear.bias is not None else torch.zeros(linear.out_features)

    out: dict[str, Tensor] = {}

    def norm(prefix: str, ln: nn.LayerNorm) -> None:
        out[f"{prefix}.weight"], out[f"{prefix}.bias"] = writes(ln.weight), writes(ln.bias)

    def attention(prefix: str, attn) -> None:
        for ours, theirs in ((attn.w_q, "q_proj"), (attn.w_k, "k_proj"), (attn.w_v, "v_proj")):
            out[f"{prefix}.{theirs}.weight"], out[f"{prefix}.{theirs}.bias"] = reads(ours.weight), bias(ours)
        out[f"{prefix}.out_proj.weight"] = writes(attn.w_o.weight)
        out[f"{prefix}.out_proj.bias"] = writes(bias(attn.w_o))

    def ffn(prefix: str, f) -> None:
        out[f"{prefix}.fc1.weight"], out[f"{prefix}.fc1.bias"] = reads(f.w_1.weight), bias(f.w_1)
        out[f"{prefix}.fc2.weight"], out[f"{prefix}.fc2.bias"] = writes(f.w_2.weight), writes(bias(f.w_2))

    out["model.encoder.embed_tokens.weight"] = reads(model.src_embed.weight)
    out["model.decoder.embed_tokens.weight"] = reads(model.tgt_embed.weight)
    out["lm_head.weight"] = reads(model.output_weight)
    if pre_norm:  # Blenderbot reads the position table from the weights; Marian computes its own
        out["model.encoder.embed_positions.weight"] = model.src_pos.table[: cfg.max_positions]
        out["model.decoder.embed_positions.weight"] = model.tgt_pos.table[: cfg.max_positions]
        norm("model.encoder.layer_norm", model.enc_norm)
        norm("model.decoder.layer_norm", model.dec_norm)
    for i, layer in enumerate(model.encoder):
        p = f"model.encoder.layers.{i}"
        attention(f"{p}.self_attn", layer.self_attn)
        norm(f"{p}.self_attn_layer_norm", layer.attn_sub.norm)
        ffn(p, layer.ffn)
        norm(f"{p}.final_layer_norm", layer.ffn_sub.norm)
    for i, layer in enumerate(model.decoder):
        p = f"model.decoder.layers.{i}"
        attention(f"{p}.self_attn", layer.self_attn)
        norm(f"{p}.self_attn_layer_norm", layer.self_sub.norm)
        attention(f"{p}.encoder_attn", layer.cross_attn)
        norm(f"{p}.encoder_attn_layer_norm", layer.cross_sub.norm)
        ffn(p, layer.ffn)
        norm(f"{p}.final_layer_norm", layer.ffn_sub.norm)
    return out


def hf_tokenizer(run_dir: Path, tok: Tokenizer, max_positions: int):
    """A fast tokenizer that encodes as the run's sentencepiece model does and appends ``</s>``."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(next(f for f in Tokenizer.files(run_dir) if f.suffix == ".model").read_bytes())
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, {p.piece: i for i, p in enumerate(proto.pieces)})
    piece = tok.src.id_to_piece
    eos = piece(tok.eos_id)
    backend.post_processor = TemplateProcessing(single=f"$A {eos}", pair=f"$A $B {eos}",
                                                special_tokens=[(eos, tok.eos_id)])  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=piece(tok.bos_id), eos_token=eos, unk_token=piece(tok.unk_id),
        pad_token=piece(tok.pad_id), model_max_length=max_positions,
    )  # fmt: skip


def _portable_tokenizer_config(path: Path) -> None:
    """Name the tokenizer class that transformers 4 and 5 both load from ``tokenizer.json``
    (transformers 5 writes its own name for it, which 4 does not know), and the inputs it
    gives the model (else transformers 4's generic class adds ``token_type_ids``, which
    ``generate()`` refuses)."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_input_names"] = ["input_ids", "attention_mask"]
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def export_hf(run_dir: Path, out: Path, force: bool = False) -> dict:
    """Write ``out`` (config, safetensors weights, tokenizer, generation config, README),
    complete or not at all; returns the check of ``check_export_sentences``."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise MTError("mt export --to hf needs transformers: pip install -e '.[hf]'") from None
    from transformers import GenerationConfig

    run_dir, out = Path(run_dir), Path(out)
    if (out / EXPORT_JSON).is_file() and not force:
        raise MTError(f"{out}: already exists (an earlier mt export: add --force to replace it)")
    model, tok, meta = load_textbook(run_dir)
    hf = hf_model(model, tok)
    alpha = default_alpha([run_dir])  # the length penalty mt translate decodes the run with
    partial = begin_directory(out, EXPORT_JSON, "choose another OUT")
    try:
        hf.generation_config = GenerationConfig(
            decoder_start_token_id=tok.bos_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id, num_beams=5, length_penalty=alpha, early_stopping=True,
            max_length=model.cfg.max_positions, forced_eos_token_id=None,
        )  # fmt: skip
        hf.save_pretrained(partial)
        hf_tokenizer(run_dir, tok, model.cfg.max_positions).save_pretrained(partial)
        _portable_tokenizer_config(partial / "tokenizer_config.json")
        if (run_dir / "config.yaml").exists():
            shutil.copyfile(run_dir / "config.yaml", partial / "mt_config.yaml")
        info = {"exported_from": str(run_dir), "format": "hf", "architecture": type(hf).__name__,
                "mt_version": __version__, "model": meta["model"]}  # fmt: skip
        (partial / EXPORT_JSON).write_text(json.dumps(info, indent=2) + "\n")
        text_note = (
            "This model was trained on paper-style text (lowercased, Moses-tokenized): give it text prepared "
            "that way (`mt translate` does it itself)."
            if tok.src_text.mode != "raw"
            else ""
        )
        (partial / "README.md").write_text(README.format(
            name=out.name, src=run_language(run_dir, "src"), tgt=run_language(run_dir, "tgt"), run=run_dir,
            out=out, arch=type(hf).__name__, params=sum(p.numel() for p in model.parameters()),
            layout="pre-LN" if model.cfg.norm_first else "post-LN", text_note=text_note, alpha=alpha,
        ))  # fmt: skip
        finish_directory(partial, out)
    except BaseException:
        abandon_directory(partial)
        raise
    return check_export_sentences(model, tok, lambda lines: translate_hf(out, lines, beam=1))


def translate_hf(directory: Path, lines: list[str], beam: int = 5, batch_size: int = 32) -> list[str]:
    """``lines`` translated by the export in ``directory`` with transformers' ``generate()``,
    in batches of similar lengths (as mt batches them), in the order given."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    hf = AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    order = sorted(range(len(lines)), key=lambda i: len(lines[i]))
    outputs: list[str] = [""] * len(lines)
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        batch = tokenizer([lines[i] for i in chosen], return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = hf.generate(**batch, num_beams=beam, do_sample=False)
        for i, text in zip(chosen, tokenizer.batch_decode(ids, skip_special_tokens=True)):
            outputs[i] = text
    return outputs
