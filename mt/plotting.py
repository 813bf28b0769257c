"""Pure plotting functions: weights and tokens in, a file out."""

from __future__ import annotations

import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from torch import Tensor  # noqa: E402

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
    try:
        with atomic_output(path, binary=True) as f:
            fig.savefig(f, format=Path(path).suffix.lstrip(".").lower() or None, dpi=110)  # None: png
    finally:
        plt.close(fig)


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px sans-serif; margin: 1em; }}
table {{ border-collapse: collapse; }}
td {{ width: 18px; height: 18px; padding: 0; }}
th {{ font-weight: normal; font-size: 11px; padding: 0 3px; white-space: nowrap; }}
th.col {{ writing-mode: vertical-rl; transform: rotate(180deg); text-align: left; }}
#tip {{ margin: .5em 0; min-height: 1.2em; font-family: monospace; }}
</style></head><body>
<h3>{title}</h3>
<label>kind <select id="kind"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<div id="tip">hover a cell</div>
<div id="map"></div>
<script>
const DATA = {data};
const $ = id => document.getElementById(id);
function options(sel, values) {{ sel.innerHTML = values.map(v => `<option>${{v}}</option>`).join(""); }}
function esc(s) {{ const d = document.createElement("span"); d.textContent = s; return d.innerHTML; }}
function draw() {{
  const k = DATA[$("kind").value], layer = +$("layer").value, head = $("head").value;
  const heads = k.layers[layer];
  const w = head === "mean" ? heads[0].map((row, i) => row.map((_, j) =>
      heads.reduce((s, h) => s + h[i][j], 0) / heads.length)) : heads[+head];
  let h = "<table><tr><th></th>" + k.cols.map(c => `<th class="col">${{esc(c)}}</th>`).join("") + "</tr>";
  w.forEach((row, i) => {{
    h += `<tr><th>${{esc(k.rows[i])}}</th>` + row.map((v, j) =>
      `<td style="background: rgba(30,60,200,${{v.toFixed(3)}})"` +
      ` data-i="${{i}}" data-j="${{j}}" data-v="${{v.toFixed(4)}}"></td>`
    ).join("") + "</tr>";
  }});
  $("map").innerHTML = h + "</table>";
}}
$("map").addEventListener("mouseover", e => {{
  const d = e.target.dataset; if (d.v === undefined) return;
  const k = DATA[$("kind").value];
  $("tip").textContent = `${{k.rows[d.i]}} -> ${{k.cols[d.j]}}: ${{d.v}}`;
}});
function setKind() {{
  const k = DATA[$("kind").value];
  options($("layer"), k.layers.map((_, i) => i));
  options($("head"), [...k.layers[0].map((_, i) => i), "mean"]);
  draw();
}}
options($("kind"), Object.keys(DATA));
$("kind").onchange = setKind; $("layer").onchange = draw; $("head").onchange = draw;
setKind();
</script></body></html>
"""


def attention_html(kinds: dict[str, tuple[list[str], list[str], list[Tensor]]], path: str | Path, title: str) -> None:
    """One self-contained page (no network) to browse every kind, layer and
    head; hovering a cell shows its weight. kinds[name] = (row labels,
    column labels, per layer (H, T_q, T_k) weights)."""
    data = {
        name: {
            "rows": rows,
            "cols": cols,
            "layers": [[[[round(float(v), 4) for v in r] for r in h] for h in w] for w in layers],
        }
        for name, (rows, cols, layers) in kinds.items()
    }
    page = _PAGE.format(title=html.escape(title), data=json.dumps(data, ensure_ascii=False).replace("</", "<\\/"))
    with atomic_output(path) as f:
        f.write(page)
