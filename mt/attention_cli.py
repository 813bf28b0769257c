"""``mt attention``: capture, draw, tabulate and align a trained model's attention."""

from __future__ import annotations

import math
from pathlib import Path

from mt.errors import MTError
from mt.inference import load
from mt.inspection import (
    KINDS,
    AttentionMaps,
    alignment,
    force_decode,
    format_table,
    head_table,
    pharaoh,
    translate_with_attention,
)
from mt.plotting import attention_html, heatmap_grid, save_figure

SUFFIXES = (".png", ".svg", ".pdf")


def _select(value: str, n: int, what: str, allow_mean: bool = False) -> list[int] | str:
    if value == "all":
        return list(range(n))
    if allow_mean and value == "mean":
        return "mean"
    try:
        i = int(value)
    except ValueError:
        choices = "an index, 'all' or 'mean'" if allow_mean else "an index or 'all'"
        raise MTError(f"--{what} must be {choices}; got {value!r}") from None
    if not 0 <= i < n:
        raise MTError(f"--{what} {i} out of range: the model has {n} ({what} 0..{n - 1})")
    return [i]


def panels(maps: AttentionMaps, kind: str, layer_sel: str, head_sel: str) -> list[list[tuple[str, object]]]:
    layers = maps.layers(kind)
    grid = []
    for layer in _select(layer_sel, len(layers), "layer"):
        w = layers[layer]  # (H, T_q, T_k)
        heads = _select(head_sel, w.size(0), "head", allow_mean=True)
        if heads == "mean":
            grid.append([(f"{kind} layer {layer}, heads averaged", w.float().mean(0))])
        else:
            grid.append([(f"{kind} layer {layer}, head {h}", w[h]) for h in heads])
    return grid


def _outputs(out: Path, kinds: list[str], index: int | None) -> dict[str, Path]:
    paths = {}
    for kind in kinds:
        stem = out.stem + (f"-{index}" if index is not None else "") + (f"-{kind}" if len(kinds) > 1 else "")
        paths[kind] = out.with_name(stem + out.suffix)
    return paths


def run(args) -> None:
    if args.out and Path(args.out).suffix.lower() not in SUFFIXES:
        raise MTError(f"--out {args.out}: use a .png, .svg or .pdf file name")
    if not (args.out or args.stats or args.align or args.html):
        raise MTError("nothing to do: give --out FILE.png, --stats, --align and/or --html FILE")
    if not 0 < args.temperature < math.inf:  # NaN fails this too
        raise MTError(f"--temperature must be a positive number, got {args.temperature}")
    model, tok, _ = load(args.model)
    if args.src_file:
        from mt.corpus import read_lines

        sources = read_lines(Path(args.src_file))
        if args.tgt:
            raise MTError("--tgt goes with --src, not --src-file")
    else:
        sources = [args.src]
    kinds = list(KINDS) if args.kind == "all" else [args.kind]
    for kind in kinds:  # a bad --layer or --head is found before any decoding
        _select(args.layer, model.cfg.enc_layers if kind == "encoder" else model.cfg.dec_layers, "layer")
    _select(args.head, model.cfg.n_heads, "head", allow_mean=True)
    align_layer = args.align_layer if args.align_layer is not None else max(model.cfg.dec_layers - 2, 0)
    if args.align:
        _select(str(align_layer), model.cfg.dec_layers, "align-layer")
    limit = model.cfg.max_positions
    for n, text in enumerate(sources):
        src_ids = tok.encode_src([text])[0][: limit - 1]
        if not src_ids:
            raise MTError(f"source {n + 1} is empty")
        if src_ids[-1] != tok.eos_id:
            src_ids.append(tok.eos_id)
        if args.tgt is not None:
            tgt_ids = tok.encode_tgt([args.tgt])[0][: limit - 2]
        else:
            tgt_ids, _ = translate_with_attention(
                model, tok, src_ids, min(2 * len(src_ids) + 10, limit - 1), args.temperature
            )
        maps = force_decode(model, tok, src_ids, tgt_ids, args.temperature)
        index = n if args.src_file else None
        print(f"source: {text}")
        print(f"target: {tok.decode_tgt([tgt_ids])[0]}")
        if args.out:
            for kind, path in _outputs(Path(args.out), kinds, index).items():
                rows, cols = maps.axes(kind)
                title = f"{kind} attention (temperature {args.temperature:g})"
                save_figure(heatmap_grid(panels(maps, kind, args.layer, args.head), rows, cols, title), path)
                print(f"wrote {path}")
        if args.stats:
            print(format_table([r for kind in kinds for r in head_table(maps, kind)]))
        if args.align:
            print(f"alignment (cross-attention layer {align_layer}, heads averaged; source-target piece indices):")
            print(pharaoh(alignment(maps, align_layer)))
        if args.html:
            path = Path(args.html)
            if index is not None:
                path = path.with_name(f"{path.stem}-{index}{path.suffix}")
            attention_html({k: (*maps.axes(k), maps.layers(k)) for k in KINDS}, path, f"attention: {text}")
            print(f"wrote {path}")
