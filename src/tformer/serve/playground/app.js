// The tformer playground: stream a completion from /v1/completions (SSE), then explain any token
// with /v1/inspect (attention per layer and head, input x gradient attribution, the logit lens, and
// the prediction again with the heads clicked in the attention table zero-ablated).
"use strict";

const $ = (id) => document.getElementById(id);
let model = null;          // served model id
let promptText = "";       // the prompt of the last generation
let tokenIds = [];         // generated token ids, in order
let controller = null;     // aborts the running stream
let selected = null;       // the token span being explained
const ablated = new Set(); // "layer,head" of the heads clicked for ablation

async function loadModel() {
  const r = await fetch("/v1/models");
  const data = await r.json();
  model = data.data[0].id;
  $("model").textContent = model;
}

function show(text) { return text.replace(/\n/g, "\u21b5").replace(/ /g, "\u2423"); }   // ↵ and ␣ in headers

function number(id, parse) {
  const v = $(id).value.trim();
  return v === "" ? null : parse(v);
}

async function generate() {
  if (!model) await loadModel();
  promptText = $("prompt").value;
  tokenIds = [];
  ablated.clear();
  $("prompt-echo").textContent = promptText;
  $("tokens").textContent = "";
  $("explain").hidden = true;
  $("status").textContent = "generating…";
  $("generate").disabled = true;
  $("stop").disabled = false;
  controller = new AbortController();
  const body = {model, prompt: promptText, stream: true, logprobs: 0, return_tokens_as_token_ids: true,
                max_tokens: number("max_tokens", parseInt), temperature: number("temperature", parseFloat),
                top_p: number("top_p", parseFloat)};
  const seed = number("seed", parseInt);
  if (seed !== null) body.seed = seed;
  try {
    const r = await fetch("/v1/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                              body: JSON.stringify(body), signal: controller.signal});
    if (!r.ok) {
      const err = await r.json();
      throw new Error(err.error ? err.error.message : r.statusText);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", finish = null;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const payload = event.slice(6);
        if (payload === "[DONE]") break;
        const chunk = JSON.parse(payload);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices) {
          addToken(choice);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    $("status").textContent = `${tokenIds.length} tokens, finish_reason: ${finish}. Click a token.`;
  } catch (e) {
    $("status").textContent = e.name === "AbortError" ? `stopped after ${tokenIds.length} tokens` : `error: ${e.message}`;
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

function addToken(choice) {
  const lp = choice.logprobs;
  if (!lp || !lp.tokens.length) {            // text without a new token (held back for a stop string)
    if (choice.text) $("tokens").append(document.createTextNode(choice.text));
    return;
  }
  const id = parseInt(lp.tokens[0].slice("token_id:".length), 10);
  const span = document.createElement("span");
  span.className = "tok";
  span.dataset.index = tokenIds.length;
  span.dataset.logprob = lp.token_logprobs[0];
  span.textContent = choice.text;
  span.title = `token ${id}, log p = ${lp.token_logprobs[0].toFixed(3)}`;
  span.addEventListener("click", () => explain(span));
  tokenIds.push(id);
  $("tokens").append(span);
}

async function explain(span) {
  document.querySelectorAll(".tok.selected").forEach((s) => s.classList.remove("selected"));
  span.classList.add("selected");
  selected = span;
  const index = parseInt(span.dataset.index, 10);
  const ablate = [...ablated].map((k) => k.split(",").map(Number));
  const r = await fetch("/v1/inspect", {method: "POST", headers: {"Content-Type": "application/json"},
                                        body: JSON.stringify({prompt: promptText, token_ids: tokenIds, index, ablate})});
  const data = await r.json();
  if (!r.ok) { $("status").textContent = `error: ${data.error.message}`; return; }
  $("target").textContent = JSON.stringify(data.target);
  $("target-info").textContent = `token ${index + 1} of the output; log p = ${data.logprob.toFixed(3)}; ` +
    `${data.n_layers} layers × ${data.n_heads} heads over ${data.tokens.length} context tokens`;
  drawAttention(data);
  drawAttribution(data);
  drawLens(data);
  drawAblation(data);
  $("explain").hidden = false;
}

function heat(value, max) {                    // white -> deep blue
  const t = max > 0 ? Math.min(1, value / max) : 0;
  const c = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${c(255, 8)}, ${c(255, 48)}, ${c(255, 140)})`;
}

function keyHeader(tokens, label) {
  const tr = document.createElement("tr");
  tr.append(Object.assign(document.createElement("th"), {textContent: label}));
  for (const t of tokens) tr.append(Object.assign(document.createElement("th"), {className: "key", textContent: show(t) || " "}));
  return tr;
}

function drawAttention(data) {
  const table = $("attention");
  table.replaceChildren(keyHeader(data.tokens, ""));
  data.attention.forEach((layer, l) => {
    layer.forEach((row, h) => {
      const tr = document.createElement("tr");
      tr.className = "head-row" + (h === 0 ? " layer-start" : "");
      tr.dataset.layer = l;
      tr.dataset.head = h;
      if (ablated.has(`${l},${h}`)) tr.classList.add("ablated");
      tr.title = "click to ablate this head (zero its output) and predict again";
      tr.addEventListener("click", () => toggleHead(l, h));
      tr.append(Object.assign(document.createElement("th"), {textContent: `L${l} H${h}`}));
      const max = Math.max(...row);
      row.forEach((w, j) => {
        const td = document.createElement("td");
        td.className = "cell";
        td.style.background = heat(w, max);
        td.title = `layer ${l}, head ${h} -> ${JSON.stringify(data.tokens[j])}: ${w.toFixed(3)}`;
        tr.append(td);
      });
      table.append(tr);
    });
  });
}

function drawAttribution(data) {
  const table = $("attribution");
  const tr = document.createElement("tr");
  tr.className = "attribution-row";
  tr.append(Object.assign(document.createElement("th"), {textContent: "x·∇"}));
  const max = Math.max(...data.attribution);
  data.attribution.forEach((a, j) => {
    const td = document.createElement("td");
    td.className = "cell";
    td.style.background = heat(a, max);
    td.title = `${JSON.stringify(data.tokens[j])}: ${a.toFixed(3)}`;
    tr.append(td);
  });
  table.replaceChildren(keyHeader(data.tokens, ""), tr);
  const order = data.attribution.map((a, j) => [a, j]).sort((x, y) => y[0] - x[0]).slice(0, 5);
  $("top-attribution").replaceChildren(...order.map(([a, j]) =>
    Object.assign(document.createElement("li"), {textContent: `${JSON.stringify(data.tokens[j])} at ${j}: ${a.toFixed(3)}`})));
}

function toggleHead(l, h) {
  const key = `${l},${h}`;
  if (ablated.has(key)) ablated.delete(key); else ablated.add(key);
  if (selected) explain(selected);
}

function drawLens(data) {
  const table = $("lens");
  const head = document.createElement("tr");
  for (const t of ["layer", "top token", "p(top)", `p(${show(data.target)})`, "rank"])
    head.append(Object.assign(document.createElement("th"), {textContent: t}));
  table.replaceChildren(head);
  data.logit_lens.forEach((row, l) => {
    const tr = document.createElement("tr");
    tr.className = "lens-row";
    const cells = [l === data.logit_lens.length - 1 ? `${l} (out)` : `${l}`, show(row.top) || " ",
                   row.p_top.toFixed(3), row.p_target.toFixed(3), `${row.rank}`];
    cells.forEach((text, j) => {
      const td = Object.assign(document.createElement("td"), {textContent: text});
      if (j === 3) td.style.background = heat(row.p_target, 1);
      if (j === 3 && row.p_target > 0.5) td.style.color = "#fff";
      tr.append(td);
    });
    table.append(tr);
  });
}

function drawAblation(data) {
  const el = $("ablation");
  if (!data.ablation) {
    el.textContent = "Click a head's row in the attention table to ablate it (zero its output) and see the prediction change.";
    return;
  }
  const names = data.ablation.heads.map(([l, h]) => `L${l} H${h}`).join(", ");
  const delta = data.ablation.logprob - data.logprob;
  el.textContent = `with ${names} ablated: log p = ${data.ablation.logprob.toFixed(3)} ` +
    `(${delta >= 0 ? "+" : ""}${delta.toFixed(3)} against ${data.logprob.toFixed(3)})`;
}

$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
loadModel().catch((e) => { $("model").textContent = `cannot reach the server: ${e.message}`; });
