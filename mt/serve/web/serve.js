// The page of `mt serve`: translate, complete a translation from its edited beginning,
// and explore the attention of the sentence (explorer.js, the same code as `mt attention --html`).
"use strict";

const $ = id => document.getElementById(id);

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  return data;
}

function say(text, error = false) { $("status").textContent = text; $("status").className = error ? "error" : ""; }

function busy(on) { for (const id of ["translate", "complete"]) $(id).disabled = on; }

async function showModel() {
  const m = await api("/v1/model");
  const pair = m.src_lang && m.tgt_lang ? `${m.src_lang} → ${m.tgt_lang}` : "";
  const test = m.test_scores.find(s => s.bleu !== null);
  $("model-info").textContent = [m.run, pair, `${(m.parameters / 1e6).toFixed(1)}M parameters`,
    test ? `${test.test_set}: BLEU ${test.bleu}` : ""].filter(Boolean).join(" · ");
  if (m.src_lang) $("source-label").textContent = `Source (${m.src_lang})`;
  if (m.tgt_lang) $("target-label").textContent = `Translation (${m.tgt_lang})`;
  const beams = Array.from({length: m.limits.max_beam}, (_, i) => i + 1);
  $("beam").innerHTML = beams.map(b => `<option ${b === m.beam ? "selected" : ""}>${b}</option>`).join("");
  fillNbest();
}

function fillNbest() {
  const beam = +$("beam").value, keep = Math.min(+$("nbest").value || 1, beam);
  $("nbest").innerHTML = Array.from({length: beam}, (_, i) => i + 1)
    .map(k => `<option ${k === keep ? "selected" : ""}>${k}</option>`).join("");
}

async function translate(prefix) {
  const text = $("source").value.trim();
  if (!text) { say("type a sentence first", true); return; }
  if ($("split").checked && !prefix && +$("nbest").value === 1) return translateParagraphs(text);
  const body = {text, beam: +$("beam").value, n_best: +$("nbest").value, scores: true};
  if (prefix) body.prefix = prefix;
  busy(true); say(prefix ? "completing…" : "translating…");
  const started = performance.now();
  try {
    const result = (await api("/v1/translate", body)).translations[0];
    $("target").value = result.text;
    const list = result.n_best || [];
    $("nbest-list").innerHTML = list.length > 1 ? list.map(h =>
      `<li>${escapeHtml(h.text)}<span class="score">${h.score.toFixed(3)}</span></li>`).join("") : "";
    if (!result.text) {  // as mt translate: a text of characters the tokenizer drops has an empty translation
      $("attention-section").hidden = true;
      say("nothing to translate: the model keeps no piece of this text");
      return;
    }
    say(`${((performance.now() - started) / 1000).toFixed(2)} s`);
    await showAttention(text, result.text);
  } catch (e) {
    say(e.message, true);
  } finally {
    busy(false);
  }
}

// Split mode: each line of the source is a text that the server cuts into sentences and
// joins back; blank lines stay where they were. The attention shown is the first sentence's.
async function translateParagraphs(text) {
  const lines = text.split("\n");
  const filled = lines.map((line, i) => [line, i]).filter(([line]) => line.trim());
  busy(true); say("translating…");
  const started = performance.now();
  try {
    const body = {text: filled.map(([line]) => line), beam: +$("beam").value, split: true};
    const results = (await api("/v1/translate", body)).translations;
    const out = lines.slice();
    filled.forEach(([, i], k) => { out[i] = results[k].text; });
    $("target").value = out.join("\n");
    $("nbest-list").innerHTML = "";
    const sentences = results.flatMap(r => r.sentences);
    const first = sentences.find(s => s.text);
    if (!first) {  // as mt translate: a text of characters the tokenizer drops has an empty translation
      $("attention-section").hidden = true;
      say("nothing to translate: the model keeps no piece of this text");
      return;
    }
    const count = sentences.length === 1 ? "1 sentence" : `${sentences.length} sentences`;
    say(`${((performance.now() - started) / 1000).toFixed(2)} s · ${count}`);
    await showAttention(first.source, first.text, sentences.length > 1 ? `sentence 1 of ${sentences.length}` : "");
  } catch (e) {
    say(e.message, true);
  } finally {
    busy(false);
  }
}

function escapeHtml(s) { const d = document.createElement("span"); d.textContent = s; return d.innerHTML; }

async function showAttention(text, target, note = "") {
  try {
    const a = await api("/v1/attention", {text, target});
    $("attention-section").hidden = false;
    $("attention-pair").textContent = `${note ? note + ": " : ""}${text} → ${a.target}`;
    renderExplorer($("explorer"), a.kinds);
  } catch (e) {
    say(`attention: ${e.message}`, true);
  }
}

$("translate").onclick = () => translate();
$("complete").onclick = () => {
  const target = $("target");
  const prefix = target.value.slice(0, target.selectionStart ?? target.value.length);
  translate(prefix.trim() ? prefix : undefined);
};
$("source").addEventListener("keydown", e => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate(); });
$("beam").onchange = fillNbest;
$("nbest-list").onclick = e => {
  const li = e.target.closest("li"); if (!li) return;
  $("target").value = li.firstChild.textContent;
  showAttention($("source").value.trim(), $("target").value);
};
showModel().catch(e => say(`model: ${e.message}`, true));
