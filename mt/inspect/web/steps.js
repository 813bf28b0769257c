// One attention head, step by step: Q, K, V -> scores -> scaled -> masked -> weights -> output.
// renderSteps(element, head, query) draws the steps of `head` =
//   {title, rows, cols, dk, temperature, mask (T_q x T_k of 0/1), q, k, v (each {shape, b64}: float32)}
// computing scores, scaling, mask, softmax and weights·V here, as the textbook does.
// Hovering a cell shows its value and outlines the cells it came from; clicking a row follows that query.
"use strict";

function decodeMatrix(m) {
  const bytes = Uint8Array.from(atob(m.b64), c => c.charCodeAt(0));
  const flat = new Float32Array(bytes.buffer);
  const [r, c] = m.shape;
  return Array.from({length: r}, (_, i) => Array.from(flat.subarray(i * c, (i + 1) * c)));
}

function headSteps(head) {
  const q = decodeMatrix(head.q), k = decodeMatrix(head.k), v = decodeMatrix(head.v);
  const denominator = Math.sqrt(head.dk) * head.temperature;
  const scores = q.map(qi => k.map(kj => qi.reduce((s, x, c) => s + x * kj[c], 0)));
  const scaled = scores.map(row => row.map(x => x / denominator));
  const masked = scaled.map((row, i) => row.map((x, j) => head.mask[i][j] ? x : -Infinity));
  const weights = masked.map(row => {
    const top = Math.max(...row);
    if (top === -Infinity) return row.map(() => 0);  // no key to attend to: zeros
    const e = row.map(x => Math.exp(x - top));       // the stable softmax
    const total = e.reduce((a, b) => a + b, 0);
    return e.map(x => x / total);
  });
  const output = weights.map(w => v[0].map((_, c) => w.reduce((s, wj, j) => s + wj * v[j][c], 0)));
  return {q, k, v, scores, scaled, masked, weights, output, denominator};
}

function fmt(x) { return x === -Infinity ? "−∞" : x.toFixed(4); }

function cellColour(x, scale, kind) {
  if (x === -Infinity) return "#d9d9d9";
  if (kind === "weights") return `rgba(30,60,200,${x.toFixed(3)})`;
  const a = Math.min(1, Math.abs(x) / scale).toFixed(3);
  return x >= 0 ? `rgba(200,40,40,${a})` : `rgba(30,80,200,${a})`;
}

function renderSteps(el, head, query) {
  const S = headSteps(head);
  const esc = s => { const d = document.createElement("span"); d.textContent = s; return d.innerHTML; };
  const nq = head.rows.length, nk = head.cols.length, dk = head.dk;
  // name: [matrix, row labels, column labels, colour kind, caption]
  const panels = {
    q: [S.q, head.rows, null, "value", `Q = x_q·W_Q + b_Q (${nq} × ${dk})`],
    k: [S.k, head.cols, null, "value", `K = x_kv·W_K + b_K (${nk} × ${dk})`],
    v: [S.v, head.cols, null, "value", `V = x_kv·W_V + b_V (${nk} × ${dk})`],
    scores: [S.scores, head.rows, head.cols, "value", `scores = Q·Kᵀ (${nq} × ${nk})`],
    scaled: [S.scaled, head.rows, head.cols, "value", `scaled = scores / (√${dk}·${head.temperature})`],
    masked: [S.masked, head.rows, head.cols, "value", "masked: −∞ where not allowed"],
    weights: [S.weights, head.rows, head.cols, "weights", "weights = softmax(masked), rows sum to 1"],
    output: [S.output, head.rows, null, "value", `output = weights·V (${nq} × ${dk})`],
  };
  const table = name => {
    const [m, rows, cols, kind, caption] = panels[name];
    const scale = Math.max(1e-9, ...m.flat().filter(Number.isFinite).map(Math.abs));
    const narrow = cols === null;
    let h = `<div class="panel"><div class="caption">${esc(caption)}</div><table class="${narrow ? "narrow" : ""}">`;
    if (!narrow) h += "<tr><th></th>" + cols.map(c => `<th class="col">${esc(c)}</th>`).join("") + "</tr>";
    m.forEach((row, i) => {
      const cls = (name !== "k" && name !== "v" && i === query) ? ' class="query"' : "";
      h += `<tr${cls}><th data-row="${i}">${esc(rows[i])}</th>` + row.map((x, j) =>
        `<td data-m="${name}" data-i="${i}" data-j="${j}" style="background:${cellColour(x, scale, kind)}"></td>`
      ).join("") + "</tr>";
    });
    return h + "</table></div>";
  };
  const arrow = label => `<div class="arrow">${esc(label)}<br>→</div>`;
  el.innerHTML = `<div class="steps-title">${esc(head.title)} — query ${query} (${esc(head.rows[query])})</div>` +
    `<div class="flow">${table("q")}${table("k")}${table("v")}</div>` +
    `<div class="flow">${arrow("Q·Kᵀ")}${table("scores")}${arrow("/ √d_k·T")}${table("scaled")}` +
    `${arrow("mask")}${table("masked")}</div>` +
    `<div class="flow">${arrow("softmax")}${table("weights")}${arrow("· V")}${table("output")}</div>` +
    `<div class="steps-tip">hover a cell: its value and where it came from; click a row to follow that query</div>`;
  const tip = el.querySelector(".steps-tip");
  const mark = (name, pick) => el.querySelectorAll(`td[data-m="${name}"]`).forEach(td => {
    if (pick(+td.dataset.i, +td.dataset.j)) td.classList.add("source");
  });
  el.onmouseover = e => {
    const d = e.target.dataset;
    if (d.m === undefined) return;
    el.querySelectorAll("td.source").forEach(td => td.classList.remove("source"));
    const i = +d.i, j = +d.j, x = panels[d.m][0][i][j], r = head.rows[i], c = head.cols[j];
    let why = "";
    if (d.m === "q") why = `x_q[${i}] (${r}) · W_Q[:, ${j}] + b_Q[${j}]`;
    if (d.m === "k") why = `x_kv[${i}] (${head.cols[i]}) · W_K[:, ${j}] + b_K[${j}]`;
    if (d.m === "v") why = `x_kv[${i}] (${head.cols[i]}) · W_V[:, ${j}] + b_V[${j}]`;
    if (d.m === "scores") { why = `Q[${i}] · K[${j}]: how well ${r} matches ${c}`;
      mark("q", a => a === i); mark("k", a => a === j); }
    if (d.m === "scaled") { why = `scores[${i}][${j}] / ${S.denominator.toFixed(4)}`;
      mark("scores", (a, b) => a === i && b === j); }
    if (d.m === "masked") { why = head.mask[i][j] ? `scaled[${i}][${j}] (${c} is allowed)` : `−∞: ${c} is masked for ${r}`;
      mark("scaled", (a, b) => a === i && b === j); }
    if (d.m === "weights") { why = `exp(masked[${i}][${j}] − row max) / Σ over the row: ${r} → ${c}`;
      mark("masked", a => a === i); }
    if (d.m === "output") { why = `Σ_j weights[${i}][j] · V[j][${j}]`;
      mark("weights", a => a === i); mark("v", (a, b) => b === j); }
    tip.textContent = `${d.m}[${i}][${j}] = ${fmt(x)}   = ${why}`;
  };
  el.onclick = e => {
    const row = e.target.dataset.row ?? e.target.dataset.i;
    const m = e.target.dataset.m;
    if (row !== undefined && m !== "k" && m !== "v" && e.target.closest("table")) renderSteps(el, head, +row);
  };
}
