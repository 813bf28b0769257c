// The attention explorer: every kind, layer and head of one sentence's attention.
// renderExplorer(root, DATA) draws kind/layer/head selectors, the heatmap (the weight on hover),
// the per-head statistics of the layer, and, on a click, the step view of that head for that
// query (steps.js). DATA[kind] = {rows, cols, layers: [layer][head][query][key],
// stats: [{layer, head, entropy, ...}] (optional), steps: {...} (optional, see step_inputs)}.
"use strict";

const KIND_NAMES = {encoder: "encoder self-attention", decoder: "decoder self-attention", cross: "cross-attention"};

function renderExplorer(root, DATA) {
  const esc = s => { const d = document.createElement("span"); d.textContent = s; return d.innerHTML; };
  root.innerHTML = `<div class="controls">
      <label>kind <select id="kind"></select></label>
      <label>layer <select id="layer"></select></label>
      <label>head <select id="head"></select></label></div>
    <div id="tip">hover a cell for its weight; click it to see how the head computed that row, step by step</div>
    <div class="explorer-body"><div id="map"></div><div id="stats"></div></div>
    <div id="steps"></div>`;
  const $ = id => root.querySelector("#" + id);
  const options = (sel, values) => { sel.innerHTML = values.map(v => `<option>${v}</option>`).join(""); };
  const current = () => ({kind: $("kind").value, k: DATA[$("kind").value], layer: +$("layer").value,
                          head: $("head").value});
  function draw() {
    const {k, layer, head} = current();
    const heads = k.layers[layer];
    const w = head === "mean" ? heads[0].map((row, i) => row.map((_, j) =>
        heads.reduce((s, h) => s + h[i][j], 0) / heads.length)) : heads[+head];
    let h = "<table class='heatmap'><tr><th></th>" + k.cols.map(c => `<th class="col">${esc(c)}</th>`).join("") + "</tr>";
    w.forEach((row, i) => {
      h += `<tr><th>${esc(k.rows[i])}</th>` + row.map((v, j) =>
        `<td style="background: rgba(30,60,200,${v.toFixed(3)})" data-i="${i}" data-j="${j}" data-v="${v.toFixed(4)}"></td>`
      ).join("") + "</tr>";
    });
    $("map").innerHTML = h + "</table>";
    drawStats();
  }
  function drawStats() {
    const {k, layer, head} = current();
    if (!k.stats) { $("stats").innerHTML = ""; return; }
    const f = x => x === null || x === undefined ? "–" : x.toFixed(2);
    const rows = k.stats.filter(r => r.layer === layer);
    $("stats").innerHTML = `<table class="stats"><tr><th>head</th><th>entropy</th><th>norm.</th><th>max</th>` +
      `<th>same</th><th>prev.</th><th>&lt;/s&gt;</th><th>flag</th></tr>` + rows.map(r =>
        `<tr class="${String(r.head) === head ? "chosen" : ""}"><td>${r.head}</td><td>${f(r.entropy)}</td>` +
        `<td>${f(r.norm_entropy)}</td><td>${f(r.max_weight)}</td><td>${f(r.same)}</td><td>${f(r.previous)}</td>` +
        `<td>${f(r.eos)}</td><td>${esc(r.flag)}</td></tr>`).join("") + "</table>";
  }
  $("map").addEventListener("mouseover", e => {
    const d = e.target.dataset; if (d.v === undefined) return;
    const {k} = current();
    $("tip").textContent = `${k.rows[d.i]} → ${k.cols[d.j]}: ${d.v}`;
  });
  $("map").addEventListener("click", e => {
    const d = e.target.dataset; if (d.i === undefined) return;
    const {kind, k, layer, head} = current();
    if (!k.steps || typeof renderSteps === "undefined") return;
    if (head === "mean") { $("steps").textContent = "choose one head to see its steps"; return; }
    const s = k.steps, h = s.layers[layer][+head];
    renderSteps($("steps"), {title: `${KIND_NAMES[kind]}, layer ${layer}, head ${head}`, rows: s.rows, cols: s.cols,
      dk: s.dk, temperature: s.temperature, mask: s.mask, q: h.q, k: h.k, v: h.v}, +d.i);
  });
  function setKind() {
    const {k} = current();
    options($("layer"), k.layers.map((_, i) => i));
    options($("head"), [...k.layers[0].map((_, i) => i), "mean"]);
    draw();
  }
  options($("kind"), Object.keys(DATA));
  $("kind").onchange = setKind; $("layer").onchange = draw; $("head").onchange = draw;
  setKind();
}
