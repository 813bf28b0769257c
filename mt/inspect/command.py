"""``mt attention``: capture, draw, tabulate and align a trained model's attention."""

from __future__ import annotations

from pathlib import Path

from mt.decode.inference import load
from mt.errors import MTError
from mt.inspect.capture import (
    KINDS,
    AttentionMaps,
    alignment,
    force_decode,
    format_table,
    head_table,
    pharaoh,
    translate_with_attention,
)
from mt.inspect.plotting import attention_html, heatmap_grid, save_figure, step_inputs

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


#: the temperatures mt attention takes: far below 0.01 the scores / (sqrt(d_k) * T) leave
#: float32's range (1e-300 makes them inf, and the weights NaN); far above 100 every row is flat
TEMPERATURES = (0.01, 100.0)


def _temperatures(values: list[float]) -> list[float]:
    low, high = TEMPERATURES
    for t in values:
        if not low <= t <= high:  # NaN fails this too
            raise MTError(f"--temperature must be between {low:g} and {high:g}, got {t:g}")
    return values


def _check_outputs(*paths: Path | str | None) -> None:
    """Every file the command will write, checked before it writes any: its directory exists."""
    for path in paths:
        if path is None:
            continue
        parent = Path(path).parent
        if not parent.is_dir():
            missing = "does not exist" if not parent.exists() else "is not a directory"
            raise MTError(f"{path}: cannot write, {parent} {missing}")


def run(args) -> None:
    if args.explain:
        return explain(args)
    for option in ("npz",):
        if getattr(args, option):
            raise MTError(f"--{option} goes with --explain")
    if args.out and Path(args.out).suffix.lower() not in SUFFIXES:
        raise MTError(f"--out {args.out}: use a .png, .svg or .pdf file name")
    if not (args.out or args.stats or args.align or args.html):
        raise MTError("nothing to do: give --out FILE.png, --stats, --align and/or --html FILE")
    if len(_temperatures(args.temperature)) > 1:
        raise MTError("several --temperature values go with --explain; give one")
    args.temperature = args.temperature[0]
    _check_outputs(args.out, args.html)
    model, tok, _ = load(args.model, fast=False)  # the textbook modules, as training ran them
    if args.src_file:
        from mt.data.corpus import read_lines

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
            steps = explorer_steps(model, tok, src_ids, tgt_ids, args.temperature)
            kinds_data = {k: (*maps.axes(k), maps.layers(k)) for k in KINDS}
            stats = {k: head_table(maps, k) for k in KINDS}
            attention_html(kinds_data, path, f"attention: {text}", steps, stats)
            print(f"wrote {path}")


def explorer_steps(model, tok, src_ids: list[int], tgt_ids: list[int], temperature: float) -> dict[str, dict]:
    """Every head's Q, K, V (as the model computed them) for the explorer page's step view."""
    from mt.inspect.lesson import capture

    captured = capture(model, tok, src_ids, tgt_ids, temperature)
    source, target_in = tok.src_pieces(src_ids), tok.tgt_pieces([tok.bos_id, *tgt_ids])
    labels = {"encoder": (source, source), "decoder": (target_in, target_in), "cross": (target_in, source)}
    d_k, n_heads = model.cfg.d_model // model.cfg.n_heads, model.cfg.n_heads
    steps = {}
    for kind, (rows, cols) in labels.items():
        layers = [captured[kind, i] for i in range(len(model.encoder if kind == "encoder" else model.decoder))]
        heads = [
            [tuple(m[:, h * d_k : (h + 1) * d_k].numpy() for m in (c.q, c.k, c.v)) for h in range(n_heads)]
            for c in layers
        ]
        steps[kind] = step_inputs(rows, cols, layers[0].mask.numpy(), temperature, heads)
    return steps


EXPLAIN_SUFFIXES = (".png", ".svg", ".pdf", ".html")


def _source_ids(tok, text: str, limit: int) -> list[int]:
    src_ids = tok.encode_src([text])[0][: limit - 1]
    if not src_ids:
        raise MTError("--src is empty")
    if src_ids[-1] != tok.eos_id:
        src_ids.append(tok.eos_id)
    return src_ids


def explain(args) -> None:
    """``mt attention --explain``: one head's computation, step by step, checked against the model."""
    from mt.inspect.lesson import capture, format_lesson, format_temperatures, head_steps, save_npz
    from mt.inspect.plotting import flow_figure, flow_html

    if args.src_file:
        raise MTError("--explain follows one sentence: give --src, not --src-file")
    for option in ("stats", "align", "html"):
        if getattr(args, option):
            raise MTError(f"--{option} does not go with --explain (run them separately)")
    if args.kind == "all":
        raise MTError("--explain follows one kind: --kind encoder, decoder or cross")
    if args.out and Path(args.out).suffix.lower() not in EXPLAIN_SUFFIXES:
        raise MTError(f"--out {args.out}: with --explain use a .png, .svg, .pdf or .html file name")
    if args.npz and Path(args.npz).suffix.lower() != ".npz":
        raise MTError(f"--npz {args.npz}: use a .npz file name")
    temperatures = _temperatures(args.temperature)
    if args.query < 0:
        raise MTError(f"--query {args.query} out of range: positions start at 0")
    _check_outputs(args.out, args.npz)
    model, tok, _ = load(args.model, fast=False)  # the textbook modules, as training ran them
    n_layers = model.cfg.enc_layers if args.kind == "encoder" else model.cfg.dec_layers
    layer = 0 if args.layer == "all" else _select(args.layer, n_layers, "layer")[0]
    head = 0 if args.head == "all" else _select(args.head, model.cfg.n_heads, "head")[0]
    limit = model.cfg.max_positions
    src_ids = _source_ids(tok, args.src, limit)
    if args.kind == "encoder" and args.query >= len(src_ids):
        n = len(src_ids)
        raise MTError(f"--query {args.query} out of range: the source has {n} pieces (0..{n - 1})")
    if args.tgt is not None:
        tgt_ids = tok.encode_tgt([args.tgt])[0][: limit - 2]
    else:
        tgt_ids, _ = translate_with_attention(model, tok, src_ids, min(2 * len(src_ids) + 10, limit - 1))
    source = tok.src_pieces(src_ids)
    target_in = tok.tgt_pieces([tok.bos_id, *tgt_ids])
    rows, cols = {"encoder": (source, source), "decoder": (target_in, target_in), "cross": (target_in, source)}[
        args.kind
    ]
    if args.query >= len(rows):
        raise MTError(
            f"--query {args.query} out of range: {args.kind} attention here has {len(rows)} query positions "
            f"(0..{len(rows) - 1}: {' '.join(rows)})"
        )
    lessons = []
    for t in temperatures:
        captured = capture(model, tok, src_ids, tgt_ids, t)
        lessons.append(head_steps(model, captured, args.kind, layer, head, rows, cols, t))
    target = tok.tgt_pieces([*tgt_ids, tok.eos_id]) if args.kind != "encoder" else None
    print(format_lesson(lessons[0], args.query, source, target))
    if len(lessons) > 1:
        print()
        print(format_temperatures(lessons, args.query))
    for lesson in lessons:
        bad = lesson.failures()
        if bad:
            raise MTError(
                f"step {bad[0]!r} differs from the model's forward pass by {lesson.diffs[bad[0]]:.2e} "
                f"(allowed {lesson.allowed(bad[0]):.0e}) at temperature {lesson.temperature:g}"
            )
    print("every step of every temperature within the tolerance of the model's own values")
    if args.npz:
        save_npz(lessons[0], args.npz)
        print(f"wrote {args.npz}")
    if args.out:
        if Path(args.out).suffix.lower() == ".html":
            flow_html(lessons[0], args.query, args.out)
        else:
            save_figure(flow_figure(lessons[0], args.query), args.out)
        print(f"wrote {args.out}")
