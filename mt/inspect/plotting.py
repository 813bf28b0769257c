"""Pure plotting functions: weights and tokens in, a file out."""

from __future__ import annotations

import base64
import html
import json
import math
from importlib import resources
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from torch import Tensor  # noqa: E402

from mt.inspect.capture import KIND_NAMES  # noqa: E402
from mt.textio import atomic_output  # noqa: E402

CELL = 0.17  # inches per token: 40-token axes stay legible at 7 pt


def heatmap_grid(
    panels: list[list[tuple[str, Tensor]]],
    row_labels: list[str],
    col_labels: list[str],
    title: str = "",
) -> plt.Figure:
    """Draw a grid of attention heatmaps (save it with ``save_figure``).

    panels[r][c] = (panel title, weights (T_q, T_k)); rows of each heatmap are
    ``row_labels`` (queries), columns ``col_labels`` (keys). One colour bar,
    weights from 0 to 1.
    """
    n_rows, n_cols = len(panels), max(len(r) for r in panels)
    panel_w = max(2.5, CELL * len(col_labels) + 1.4)
    panel_h = max(2.5, CELL * len(row_labels) + 1.4)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(panel_w * n_cols + 1.0, panel_h * n_rows + 0.6), squeeze=False)
    image = None
    for r, row in enumerate(panels):
        for c in range(n_cols):
            ax = axes[r][c]
            if c >= len(row):
                ax.axis("off")
                continue
            name, weights = row[c]
            image = ax.imshow(weights.float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(name, fontsize=9)
            ax.set_xticks(range(len(col_labels)), col_labels, rotation=90, fontsize=7)
            ax.set_yticks(range(len(row_labels)), row_labels, fontsize=7)
            ax.tick_params(length=0)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 0.6 / fig.get_figwidth(), 1))
    fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.02, pad=0.01, label="attention weight")
    return fig


def save_figure(fig: plt.Figure, path: str | Path) -> None:
    """Save as .png, .svg or .pdf (by suffix), atomically, and free the figure."""
    try:  # SVG text as text, not outlines: searchable, selectable and smaller
        with atomic_output(path, binary=True) as f, plt.rc_context({"svg.fonttype": "none"}):
            fig.savefig(f, format=Path(path).suffix.lstrip(".").lower() or None, dpi=110)  # None: png
    finally:
        plt.close(fig)


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px sans-serif; margin: 1em; }}
{css}
</style></head><body>
<h3>{title}</h3>
<div id="explorer"></div>
<script>
{steps_js}
{explorer_js}
renderExplorer(document.getElementById("explorer"), {data});
</script></body></html>
"""


def attention_html(
    kinds: dict[str, tuple[list[str], list[str], list[Tensor]]],
    path: str | Path,
    title: str,
    steps: dict[str, dict] | None = None,
    stats: dict[str, list[dict]] | None = None,
) -> None:
    """One self-contained page (no network) to browse every kind, layer and
    head; hovering a cell shows its weight. kinds[name] = (row labels,
    column labels, per layer (H, T_q, T_k) weights). With ``steps[name]`` (see
    ``step_inputs``), clicking a cell shows how its head computed that query's row;
    with ``stats[name]`` (``mt.inspect.capture.head_table``), the layer's per-head statistics show beside it."""
    page = _PAGE.format(title=html.escape(title), css=web_asset("attention.css"), steps_js=web_asset("steps.js"),
                        explorer_js=web_asset("explorer.js"),
                        data=_json(explorer_data(kinds, steps, stats)))  # fmt: skip
    with atomic_output(path) as f:
        f.write(page)


def explorer_data(
    kinds: dict[str, tuple[list[str], list[str], list[Tensor]]],
    steps: dict[str, dict] | None = None,
    stats: dict[str, list[dict]] | None = None,
) -> dict:
    """What the explorer (mt/inspect/web/explorer.js) draws, as JSON-ready data: see ``attention_html``."""
    return {
        name: {
            "rows": rows,
            "cols": cols,
            "layers": [[[[round(float(v), 4) for v in r] for r in h] for h in w] for w in layers],
            **({"steps": steps[name]} if steps and name in steps else {}),
            **({"stats": stats[name]} if stats and name in stats else {}),
        }
        for name, (rows, cols, layers) in kinds.items()
    }


def web_asset(name: str) -> str:
    """A file of the page parts shipped in the package (mt/inspect/web)."""
    return resources.files("mt.inspect").joinpath("web", name).read_text(encoding="utf-8")


def _json(data) -> str:
    """JSON safe inside a <script> element."""
    return json.dumps(data, ensure_ascii=False).replace("</", "<\\/")


def _matrix(a) -> dict:
    """A matrix as little-endian float32, base64: compact, and exact to the model's precision."""
    a = np.ascontiguousarray(np.asarray(a, dtype="<f4"))
    return {"shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def step_inputs(rows: list[str], cols: list[str], mask, temperature: float, per_layer: list[list[tuple]]) -> dict:
    """What the page's step view needs for one kind: labels, the (T_q, T_k) mask, and
    per layer, per head, that head's (Q, K, V)."""
    return {
        "rows": rows,
        "cols": cols,
        "mask": np.asarray(mask).astype(int).tolist(),
        "temperature": temperature,
        "dk": int(per_layer[0][0][0].shape[-1]),
        "layers": [[{"q": _matrix(q), "k": _matrix(k), "v": _matrix(v)} for q, k, v in heads] for heads in per_layer],
    }


_FLOW_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px sans-serif; margin: 1em; }}
{css}
</style></head><body>
<h3>{title}</h3>
<div id="steps"></div>
<script>
{steps_js}
renderSteps(document.getElementById("steps"), {head}, {query});
</script></body></html>
"""


def flow_html(lesson, query: int, path: str | Path) -> None:
    """One head's steps as a self-contained page (``mt.inspect.lesson.HeadSteps``): hovering
    a cell shows its value and outlines the cells it came from."""
    s = lesson.steps
    title = f"{KIND_NAMES[lesson.kind]}, layer {lesson.layer}, head {lesson.head}"
    head = {
        "title": title, "rows": lesson.rows, "cols": lesson.cols, "dk": lesson.d_k,
        "temperature": lesson.temperature, "mask": lesson.mask.astype(int).tolist(),
        "q": _matrix(s["q"]), "k": _matrix(s["k"]), "v": _matrix(s["v"]),
    }  # fmt: skip
    page = _FLOW_PAGE.format(
        title=html.escape(f"{title}: d_k = {lesson.d_k}, temperature {lesson.temperature:g}"),
        css=web_asset("attention.css"), steps_js=web_asset("steps.js"), head=_json(head), query=query,
    )  # fmt: skip
    with atomic_output(path) as f:
        f.write(page)


def _window(n: int, size: int, focus: int) -> tuple[int, int]:
    """[start, end) of at most ``size`` positions out of ``n`` that contains ``focus``."""
    start = min(max(0, focus - size + 1), max(0, n - size))
    return start, min(n, start + size)


def flow_figure(lesson, query: int, max_tokens: int = 20) -> plt.Figure:
    """One head's attention as a textbook figure (save it with ``save_figure``):
    Q, K, V, the scores, scaled, masked, the weights and the output, connected by
    arrows labelled with the operation and the shapes; the query's row outlined.
    ``lesson`` is an ``mt.inspect.lesson.HeadSteps``. Queries and keys beyond ``max_tokens``
    are cut, with a marker on the axis that says how many."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    s, d_k = lesson.steps, lesson.d_k
    q0, q1 = _window(len(lesson.rows), max_tokens, query)
    k0, k1 = _window(len(lesson.cols), max_tokens, 0)
    tq, tk = q1 - q0, k1 - k0
    row_labels = _cut_labels(lesson.rows, q0, q1)
    col_labels = _cut_labels(lesson.cols, k0, k1)
    cell, feat = 0.24, 0.045  # inches per token, per head dimension
    w_tok, w_feat = max(tk * cell, 1.6), d_k * feat
    h_q, h_k = tq * cell, tk * cell
    gap_x, gap_y, left, label_h = 1.25, 1.0, 1.1, 0.9
    col_w = max(w_tok, w_feat)
    xs = [left + i * (col_w + gap_x) for i in range(4)]  # columns: 3 of (T_q, T_k) panels, then V and the output
    h1 = max(h_q, h_k)
    y3 = 0.5 + label_h * 0.3
    y2 = y3 + h_q + label_h + gap_y
    y1 = y2 + h_q + label_h + gap_y
    width, height = xs[3] + w_feat + 0.6, y1 + h1 + 1.2
    fig = plt.figure(figsize=(width, height))

    def panel(x, y, w, h, data, title, rows, cols=None, kind="value"):
        ax = fig.add_axes((x / width, y / height, w / width, h / height))
        data = np.asarray(data, dtype=float)
        if kind == "weights":
            ax.imshow(data, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        else:
            finite = data[np.isfinite(data)]
            vmax = float(np.abs(finite).max(initial=1e-9))
            cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#d9d9d9")
            ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=-vmax, vmax=vmax, aspect="auto")
            if kind == "masked" and cell >= 0.2:
                for i, j in zip(*np.nonzero(np.isneginf(data))):
                    ax.text(j, i, "−∞", ha="center", va="center", fontsize=6, color="#555555")
        ax.set_title(title, fontsize=9)
        if rows:
            ax.set_yticks(range(len(rows)), rows, fontsize=7)
        else:
            ax.set_yticks([])
        if cols is None:
            ax.set_xticks([])
        else:
            ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
        ax.tick_params(length=0)
        return ax

    def outline(ax, n_cols):
        ax.add_patch(Rectangle((-0.5, focus - 0.5), n_cols, 1, fill=False, edgecolor="#e8590c", lw=1.6))

    def arrow(a, b, label, **kw):
        fig.add_artist(
            FancyArrowPatch(
                (a[0] / width, a[1] / height), (b[0] / width, b[1] / height), transform=fig.transFigure,
                arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#333333", **kw,
            )
        )  # fmt: skip
        vertical = abs(b[0] - a[0]) < abs(b[1] - a[1])
        x, y = (a[0] + b[0]) / 2 + (0.12 if vertical else 0), (a[1] + b[1]) / 2 + (0 if vertical else 0.06)
        fig.text(x / width, y / height, label, ha="left" if vertical else "center",
                 va="center" if vertical else "bottom", fontsize=10, color="#1c3f94")  # fmt: skip

    def pad(m, rows=True, cols=False):
        """Blank cells where the labels carry a 'cut' marker."""
        m = np.asarray(m, dtype=float)
        if rows:
            m = np.vstack(
                [
                    np.full((int(q0 > 0), m.shape[1]), np.nan),
                    m,
                    np.full((int(q1 < len(lesson.rows)), m.shape[1]), np.nan),
                ]
            )
        if cols:
            m = np.hstack([m, np.full((m.shape[0], int(k1 < len(lesson.cols))), np.nan)])
        return m

    def pad_keys(m):
        m = np.asarray(m, dtype=float)
        return np.vstack([m, np.full((int(k1 < len(lesson.cols)), m.shape[1]), np.nan)])

    qs, ks = slice(q0, q1), slice(k0, k1)
    focus = query - q0 + int(q0 > 0)  # the query's row in the drawn panels
    ax_q = panel(xs[0], y1 + h1 - h_q, w_feat, h_q, pad(s["q"][qs]),
                 f"Q = x_q·W_Q + b_Q\n({len(lesson.rows)} × {d_k})", row_labels)  # fmt: skip
    outline(ax_q, d_k)
    panel(xs[1], y1 + h1 - h_k, w_feat, h_k, pad_keys(s["k"][ks]),
          f"K = x_kv·W_K + b_K\n({len(lesson.cols)} × {d_k})", col_labels)  # fmt: skip
    panel(xs[3], y1 + h1 - h_k, w_feat, h_k, pad_keys(s["v"][ks]),
          f"V = x_kv·W_V + b_V\n({len(lesson.cols)} × {d_k})", [])  # fmt: skip
    shape = f"({len(lesson.rows)} × {len(lesson.cols)})"
    denominator = math.sqrt(d_k) * lesson.temperature
    titles = ("scores = Q·Kᵀ", f"scaled = scores / {denominator:g}", "masked: −∞ where not allowed")
    axes2 = []
    for i, (name, title) in enumerate(zip(("scores", "scaled", "masked"), titles)):
        ax = panel(xs[i], y2, w_tok, h_q, pad(s[name][qs, ks], cols=True), f"{title}\n{shape}",
                   row_labels if i == 0 else [], col_labels, "masked" if name == "masked" else "value")  # fmt: skip
        outline(ax, len(col_labels))
        axes2.append(ax)
    ax_w = panel(xs[2], y3, w_tok, h_q, pad(s["weights"][qs, ks], cols=True),
                 f"weights = softmax(masked)\n{shape}, rows sum to 1", row_labels, col_labels, "weights")  # fmt: skip
    outline(ax_w, len(col_labels))
    ax_o = panel(xs[3], y3, w_feat, h_q, pad(s["output"][qs]),
                 f"output = weights·V\n({len(lesson.rows)} × {d_k})", [])  # fmt: skip
    outline(ax_o, d_k)

    bar = fig.add_axes((xs[0] / width, y3 / height, (xs[1] + col_w - xs[0]) / width, h_q / height))
    w = s["weights"][query, ks]
    bar.bar(range(tk), w, color="#e8590c")
    bar.set_xticks(range(tk), lesson.cols[k0:k1], rotation=90, fontsize=7)
    bar.set_ylim(0, 1)
    bar.tick_params(labelsize=7, length=0)
    bar.set_title(f"query {query} ({lesson.rows[query]!r}): its row of weights", fontsize=9)

    top2 = y2 + h_q + 0.45  # above the row-2 titles
    arrow((xs[0] + w_feat / 2, y1 + h1 - h_q - 0.1), (xs[0] + w_tok / 2, top2), "Q·Kᵀ")
    arrow((xs[1] + w_feat / 2, y1 + h1 - h_k - 0.1), (xs[0] + w_tok * 0.75, top2), "")
    for i, label in enumerate(("/ √d_k·T", "mask")):
        arrow((xs[i] + w_tok + 0.1, y2 + h_q / 2), (xs[i + 1] - 0.35, y2 + h_q / 2), label)
    arrow((xs[2] + w_tok / 2, y2 - label_h + 0.1), (xs[2] + w_tok / 2, y3 + h_q + 0.45), "softmax")
    arrow((xs[2] + w_tok + 0.1, y3 + h_q / 2), (xs[3] - 0.1, y3 + h_q / 2), "· V")
    arrow((xs[3] + w_feat / 2, y1 + h1 - h_k - 0.1), (xs[3] + w_feat / 2, y3 + h_q + 0.45), "")
    d_model = lesson.x_q.shape[1]
    note = (
        f"x_q: {len(lesson.rows)} query tokens × {d_model}\n"
        f"x_kv: {len(lesson.cols)} key tokens × {d_model}\n"
        f"(the layer's input, after its pre-layer norm)\n\n"
        f"head {lesson.head} of {lesson.n_heads}: columns {lesson.head * d_k}..{(lesson.head + 1) * d_k - 1}\n"
        f"of W_Q, W_K, W_V ({d_model} × {d_model})\n\n"
        f"output = softmax(Q·Kᵀ / (√d_k·T), masked)·V"
    )
    fig.text(xs[2] / width, (y1 + h1) / height, note, ha="left", va="top", fontsize=8.5, linespacing=1.4)
    title = (
        f"{KIND_NAMES[lesson.kind]}, layer {lesson.layer}, head {lesson.head}: "
        f"d_k = {d_k}, temperature T = {lesson.temperature:g}"
    )
    fig.suptitle(title, fontsize=11, y=1 - 0.25 / height)
    return fig


def _cut_labels(labels: list[str], start: int, end: int) -> list[str]:
    """labels[start:end], with markers before and after them that say how many were cut."""
    before = [f"… {start} cut"] if start else []
    after = [f"… {len(labels) - end} cut"] if end < len(labels) else []
    return before + labels[start:end] + after
