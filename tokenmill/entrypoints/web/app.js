// tokenmill's web page: a chat playground and a live view of the engine. Plain JS, no libraries.
// It talks to the server's own endpoints by URLs relative to the page (a proxy's path prefix in
// front of the server works): v1/models, v1/chat/completions (streamed) and stats/stream
// (server-sent events of the engine's state, read only while the engine view is open).
"use strict";

const $ = (id) => document.getElementById(id);
const CHAT_STORE = "tokenmill.chat";  // localStorage: the conversation and the sampling settings
const KEY_STORE = "tokenmill.apiKey";  // sessionStorage: the API key, for this tab only
const STEPS_SHOWN = 240;  // bars in the batch chart
const RATE_HISTORY_S = 60;  // seconds of output tok/s in its chart
const SETTINGS = {  // element id -> request field
  "temperature": "temperature", "top-p": "top_p", "max-tokens": "max_tokens", "seed": "seed",
};

const page = {
  model: null,
  messages: [],  // {role, content, stats?}, as stored
  chatRequest: null,  // the AbortController of the streaming answer
  statsRequest: null,  // the AbortController of the stats stream
  watching: null,  // the loop reading it, while the engine view is open
  steps: [],  // [step, prefill, generated, ms] of the last STEPS_SHOWN steps
  rates: [],  // [seconds since the page loaded, output tok/s]
  keyPrompt: null,  // the pending promise while the key dialog is open
};

// -- HTTP ----------------------------------------------------------------------------------------

function authHeaders(extra = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// fetch with the API key; a 401 asks for the key (once per call) and tries again.
async function call(url, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const response = await fetch(url, { ...options, headers: authHeaders(options.headers) });
    if (response.status !== 401 || attempt > 0) return response;
    const refused = Boolean(sessionStorage.getItem(KEY_STORE));
    await askForKey(refused ? "The API key was refused. Try another:" : "This server needs an API key.");
  }
}

async function errorText(response) {
  const text = await response.text();
  try { return JSON.parse(text).error.message; } catch { return `${response.status} ${text.slice(0, 200)}`; }
}

// The `data:` payloads of a server-sent-events body, as they arrive.
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

function askForKey(message) {
  if (page.keyPrompt) return page.keyPrompt;
  $("key-message").textContent = message;
  $("key-input").value = "";
  page.keyPrompt = new Promise((resolve) => {
    $("key-dialog").addEventListener("close", () => {
      sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
      page.keyPrompt = null;
      resolve();
    }, { once: true });
  });
  $("key-dialog").showModal();
  $("key-input").focus();
  return page.keyPrompt;
}

function setStatus(text, ok) {
  const status = $("server-status");
  status.textContent = text;
  status.className = `status ${ok ? "ok" : "bad"}`;
}

async function loadModel() {
  for (;;) {
    try {
      const response = await call("v1/models");
      if (response.ok) {
        page.model = (await response.json()).data[0].id;
        $("model-name").textContent = page.model;
        setStatus("ready", true);
        return;
      }
      setStatus(response.status === 503 ? "loading…" : await errorText(response), false);
    } catch {
      setStatus("server unreachable", false);
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}

// -- chat ----------------------------------------------------------------------------------------

function saveChat() {
  const settings = { system: $("system-prompt").value };
  for (const id of Object.keys(SETTINGS)) settings[id] = $(id).value;
  localStorage.setItem(CHAT_STORE, JSON.stringify({ messages: page.messages, settings }));
}

function restoreChat() {
  let saved;
  try { saved = JSON.parse(localStorage.getItem(CHAT_STORE)); } catch { saved = null; }
  if (!saved) return;
  page.messages = Array.isArray(saved.messages) ? saved.messages : [];
  const settings = saved.settings || {};
  if (typeof settings.system === "string") $("system-prompt").value = settings.system;
  for (const id of Object.keys(SETTINGS)) if (typeof settings[id] === "string") $(id).value = settings[id];
  for (const message of page.messages) addMessage(message);
}

// A message's element; its text node and meta line are updated in place while it streams.
function addMessage(message) {
  $("empty-chat").hidden = true;
  const div = document.createElement("div");
  div.className = `msg ${message.role}`;
  const text = document.createElement("div");
  text.className = message.role === "assistant" ? "text md" : "text";
  showText(text, message);
  const meta = document.createElement("div");
  meta.className = "meta";
  div.append(text, meta);
  $("messages").append(div);
  showStats(div, message.stats);
  return div;
}

function showStats(div, stats) {
  const meta = div.querySelector(".meta");
  if (!stats) { meta.hidden = true; return; }
  const parts = [];
  if (stats.stopped) parts.push("stopped");
  if (stats.ttft_ms != null) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats.tokens_per_s != null) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (stats.tokens != null) parts.push(`${stats.exact ? "" : "~"}${stats.tokens} tokens`);
  if (stats.finish_reason) parts.push(`finish: ${stats.finish_reason}`);
  if (stats.error) parts.push(`error: ${stats.error}`);
  meta.textContent = parts.join(" · ");
  meta.classList.toggle("error", Boolean(stats.error));
  meta.hidden = false;
}

function requestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of page.messages.slice(0, -1)) messages.push({ role: m.role, content: m.content });
  const body = { model: page.model, messages, stream: true, stream_options: { include_usage: true } };
  for (const [id, field] of Object.entries(SETTINGS)) {
    const value = $(id).value.trim();
    if (value !== "") body[field] = Number(value);
  }
  return body;
}

async function sendMessage(text) {
  if (!page.model) await loadModel();
  page.messages.push({ role: "user", content: text });
  addMessage(page.messages[page.messages.length - 1]);
  const answer = { role: "assistant", content: "" };
  page.messages.push(answer);
  const div = addMessage(answer);
  div.classList.add("streaming");
  const textNode = div.querySelector(".text");
  const scroll = () => { $("messages").scrollTop = $("messages").scrollHeight; };
  scroll();
  saveChat();
  setStreaming(true);

  const controller = new AbortController();
  page.chatRequest = controller;
  const sent = performance.now();
  let first = null, last = null, chunks = 0, usage = null, finish = null, error = null, stopped = false;
  let shown = true;  // the answer's element shows answer.content (re-rendered at most once a frame)
  const show = () => {
    if (!shown) { shown = true; showText(textNode, answer); scroll(); }
  };
  try {
    const response = await call("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      if (choice.finish_reason) finish = choice.finish_reason;
      const delta = choice.delta && choice.delta.content;
      if (delta) {
        last = performance.now();
        if (first === null) first = last;
        chunks += 1;
        answer.content += delta;
        if (shown) { shown = false; requestAnimationFrame(show); }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else error = e.message;
  }
  page.chatRequest = null;
  show();
  const tokens = usage ? usage.completion_tokens : chunks;
  answer.stats = {
    ttft_ms: first === null ? null : first - sent,
    tokens, exact: Boolean(usage),
    tokens_per_s: first !== null && last > first && tokens > 1 ? (tokens - 1) / ((last - first) / 1000) : null,
    finish_reason: finish, stopped, error,
  };
  div.classList.remove("streaming");
  showStats(div, answer.stats);
  saveChat();
  setStreaming(false);
}

function setStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
}

function newChat() {
  if (page.chatRequest) page.chatRequest.abort();
  page.messages = [];
  for (const div of [...$("messages").querySelectorAll(".msg")]) div.remove();
  $("empty-chat").hidden = false;
  saveChat();
}

// -- Markdown ------------------------------------------------------------------------------------
// Answers are shown as a subset of Markdown: paragraphs (a newline is a line break), headings,
// **bold**, *italic*, `code`, fenced code blocks, ordered and unordered lists (nested by
// indentation), rules, and links to absolute http(s) addresses. Safe by construction: the model's
// text only ever becomes text nodes inside elements made here, never parsed as HTML, and the only
// attributes set are a checked link's href, rel and target, a list's start and a code block's
// language class; any other markup shows as the characters it is.

const LINK_TARGET = /^https?:\/\/[^\s<>"]+$/i;
const FENCE_OPEN = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const INLINE = [  // earliest match first; at the same place, the first listed
  ["code", /(`+)(.*?[^`])\1(?!`)/],
  ["link", /\[([^[\]]+)\]\(\s*<?([^\s()<>]+)>?\s*\)/],
  ["strong", /\*\*(?=\S)(.*?\S)\*\*|(?<!\w)__(?=\S)(.*?\S)__(?!\w)/],
  ["em", /\*(?=[^\s*])(.*?[^\s*])\*|(?<!\w)_(?=[^\s_])(.*?[^\s_])_(?!\w)/],
];

// The Markdown of `text` as a DocumentFragment.
function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  fragment.append(...markdownBlocks(text.replace(/\r\n?/g, "\n").split("\n")));
  return fragment;
}

const leadingSpaces = (line) => line.length - line.trimStart().length;
const startsBlock = (line) => FENCE_OPEN.test(line) || HEADING.test(line) || RULE.test(line) || LIST_ITEM.test(line);

function element(tag, ...children) {
  const node = document.createElement(tag);
  node.append(...children);  // strings become text nodes
  return node;
}

function markdownBlocks(lines) {
  const nodes = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      i += 1;
    } else if ((match = line.match(FENCE_OPEN))) {
      const fence = match[1];
      const closes = (l) => l.trim().startsWith(fence) && /^ {0,3}(`+|~+)\s*$/.test(l) && l.trim()[0] === fence[0];
      const code = [];
      for (i += 1; i < lines.length && !closes(lines[i]); i += 1) code.push(lines[i]);
      i += 1;  // the closing fence (none yet while the answer streams)
      nodes.push(codeBlock(code.join("\n"), match[2]));
    } else if ((match = line.match(HEADING))) {
      nodes.push(inline(match[2], element(`h${match[1].length}`)));
      i += 1;
    } else if (RULE.test(line)) {
      nodes.push(element("hr"));
      i += 1;
    } else if (LIST_ITEM.test(line)) {
      i = list(lines, i, nodes);
    } else {
      const paragraph = element("p");
      do {
        if (paragraph.firstChild) paragraph.append(element("br"));
        inline(lines[i].trim(), paragraph);
        i += 1;
      } while (i < lines.length && lines[i].trim() && !startsBlock(lines[i]));
      nodes.push(paragraph);
    }
  }
  return nodes;
}

function codeBlock(text, language) {
  const code = element("code", text);
  if (/^[\w+#.-]+$/.test(language)) code.className = `language-${language}`;
  return element("pre", code);
}

// The list starting at lines[start] appended to `nodes`; returns the index of the line after it.
function list(lines, start, nodes) {
  const [, indent, marker] = lines[start].match(LIST_ITEM);
  const ordered = /\d/.test(marker);
  const listNode = element(ordered ? "ol" : "ul");
  if (ordered && parseInt(marker, 10) !== 1) listNode.start = parseInt(marker, 10);
  let i = start;
  for (;;) {
    const item = lines[i].match(LIST_ITEM);
    const contentIndent = item[1].length + item[2].length + 1;
    const body = [item[3]];
    for (i += 1; i < lines.length; i += 1) {
      const line = lines[i];
      let next = i;
      while (next < lines.length && !lines[next].trim()) next += 1;
      if (next > i) {  // blank lines: the item goes on if what follows is indented under it
        if (next === lines.length || leadingSpaces(lines[next]) <= indent.length) break;
        body.push(...lines.slice(i, next).map(() => ""));
        i = next - 1;
      } else if (leadingSpaces(line) > indent.length) {
        body.push(line.slice(Math.min(leadingSpaces(line), contentIndent)));
      } else if (!startsBlock(line) && body[body.length - 1].trim()) {
        body.push(line.trim());  // a paragraph's lazy continuation
      } else {
        break;
      }
    }
    const blocks = markdownBlocks(body);
    const li = element("li");
    if (blocks[0] && blocks[0].tagName === "P") li.append(...blocks.shift().childNodes);  // a tight item
    li.append(...blocks);
    listNode.append(li);
    let next = i;
    while (next < lines.length && !lines[next].trim()) next += 1;
    const following = next < lines.length && lines[next].match(LIST_ITEM);
    if (!following || following[1].length !== indent.length || /\d/.test(following[2]) !== ordered) break;
    i = next;
  }
  nodes.push(listNode);
  return i;
}

// The inline Markdown of one line appended to `parent`, which is returned.
function inline(text, parent) {
  while (text) {
    let best = null;
    for (const [kind, pattern] of INLINE) {
      const match = pattern.exec(text);
      if (match && (!best || match.index < best.match.index)) best = { kind, match };
    }
    if (!best) { parent.append(text); break; }
    const { kind, match } = best;
    parent.append(text.slice(0, match.index), inlineNode(kind, match));
    text = text.slice(match.index + match[0].length);
  }
  return parent;
}

function inlineNode(kind, match) {
  if (kind === "code") return element("code", match[2].replace(/^ (.*) $/, "$1"));
  if (kind === "link") {
    const href = linkTarget(match[2]);
    if (href === null) return match[0];
    const link = inline(match[1], element("a"));
    link.href = href;
    link.rel = "noopener noreferrer";
    link.target = "_blank";
    return link;
  }
  return inline(match[1] || match[2], element(kind));
}

// An absolute http(s) address as the href to set, else null (relative, javascript:, data: ...).
const linkTarget = (text) => (LINK_TARGET.test(text) ? text : null);

// A message's text into its element: an answer's as Markdown, the user's as it was typed.
function showText(node, message) {
  if (message.role === "assistant") node.replaceChildren(renderMarkdown(message.content));
  else node.textContent = message.content;
}

// -- engine view ---------------------------------------------------------------------------------

const pageStart = performance.now();

async function watchStats() {
  while (!$("view-engine").hidden) {
    const controller = new AbortController();
    page.statsRequest = controller;
    try {
      const response = await call("stats/stream?interval=0.5", { signal: controller.signal });
      if (!response.ok) throw new Error(await errorText(response));
      const replica = response.headers.get("x-tokenmill-replica");
      $("replica-note").hidden = !replica;
      if (replica) $("replica-note").textContent = `Data parallel: this view shows replica ${replica}.`;
      setStatus("live", true);
      for await (const data of sseData(response.body)) showEngine(JSON.parse(data));
      setStatus("stream ended", false);
    } catch (e) {
      if (e.name === "AbortError") return;
      setStatus(`stats: ${e.message}`, false);
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}

const fmt = (x, digits = 0) => (x == null ? "–"
  : x.toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits }));
const ms = (x) => (x == null ? "–" : `${x < 10 ? x.toFixed(1) : Math.round(x)} ms`);

function showEngine(s) {
  $("stat-running").textContent = fmt(s.num_running);
  $("stat-waiting").textContent = fmt(s.num_waiting);
  $("stat-output-tps").textContent = fmt(s.output_tokens_per_s, 1);
  $("stat-prompt-tps").textContent = fmt(s.prompt_tokens_per_s, 1);
  $("stat-kv").textContent = `${fmt(100 * s.kv_cache_usage, 1)}%`;
  $("stat-kv-bar").style.width = `${100 * s.kv_cache_usage}%`;
  $("stat-kv-blocks").textContent = `${fmt(s.num_blocks - s.num_free_blocks)} of ${fmt(s.num_blocks)} blocks`;
  $("stat-prefix").textContent = s.prefix_cache_hit_rate == null ? "–" : `${fmt(100 * s.prefix_cache_hit_rate, 1)}%`;
  $("stat-prefix-tokens").textContent =
    `${fmt(s.prefix_cache_hits)} of ${fmt(s.prefix_cache_queries)} prompt tokens since start`;
  $("stat-preemptions").textContent = fmt(s.num_preemptions);
  $("stat-swaps").textContent = `${fmt(s.num_swapped_out_blocks)} / ${fmt(s.num_swapped_in_blocks)}`;
  $("stat-host-blocks").textContent = s.num_host_blocks
    ? `host pool: ${fmt(s.num_host_blocks - s.num_free_host_blocks)} of ${fmt(s.num_host_blocks)} used` : "no host pool";
  $("stat-steps").textContent = fmt(s.num_steps);
  for (const [name, summary] of [["ttft", s.ttft], ["itl", s.itl]]) {
    for (const p of ["p50", "p90", "p99"]) $(`${name}-${p}`).textContent = ms(summary && summary[`${p}_ms`]);
    $(`${name}-count`).textContent = fmt(summary ? summary.count : 0);
  }
  showTiers(s.tiers);
  if (!s.ready) setStatus("loading…", false);

  page.steps.push(...s.steps);
  page.steps.splice(0, page.steps.length - STEPS_SHOWN);
  const now = (performance.now() - pageStart) / 1000;
  page.rates.push([now, s.output_tokens_per_s]);
  while (page.rates.length && page.rates[0][0] < now - RATE_HISTORY_S) page.rates.shift();
  drawSteps();
  drawRates(now);
}

const mib = (bytes) => `${fmt(bytes / 2 ** 20, bytes < 10 * 2 ** 20 ? 1 : 0)} MiB`;

// The prefix cache's tiers: a row per tier (a tier of no capacity is off), then what moved between them.
function showTiers(t) {
  for (const name of ["device", "host", "disk"]) {
    const tier = t[name];
    const on = tier.capacity_bytes > 0;
    const looked = tier.hits + tier.misses;
    $(`tier-${name}-hits`).textContent = on ? fmt(tier.hits) : "off";
    $(`tier-${name}-misses`).textContent = on ? fmt(tier.misses) : "–";
    $(`tier-${name}-rate`).textContent = on && looked ? `${fmt(100 * tier.hits / looked, 1)}%` : "–";
    $(`tier-${name}-blocks`).textContent = on ? fmt(tier.blocks) : "–";
    $(`tier-${name}-bytes`).textContent = on ? mib(tier.bytes) : "–";
    $(`tier-${name}-capacity`).textContent = on ? mib(tier.capacity_bytes) : "–";
  }
  const perBlock = (x) => (x == null ? "" : `, ${x < 10 ? x.toFixed(2) : Math.round(x)} ms a block`);
  $("tier-moves").textContent = `Blocks demoted to host memory ${fmt(t.demoted_blocks)}, promoted back ${fmt(t.promoted_blocks)}; `
    + `written to disk ${fmt(t.disk_written_blocks)}${perBlock(t.disk_write_ms)}, `
    + `read from disk ${fmt(t.disk_read_blocks)}${perBlock(t.disk_read_ms)}, corrupt files ${fmt(t.disk_corrupt_blocks)}.`;
}

// A canvas sized to its element in device pixels; drawing happens in CSS pixels.
function canvasContext(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

// 1, 2 or 5 times a power of ten, at least `x`.
function niceCeil(x) {
  if (x <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 5, 10].map((m) => m * p).find((v) => v >= x);
}

function drawAxes(ctx, left, top, width, height, max, unit) {
  ctx.strokeStyle = "#d8dee4";
  ctx.fillStyle = "#656d76";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const f of [0, 0.5, 1]) {
    const y = top + height * (1 - f);
    ctx.beginPath();
    ctx.moveTo(left, y + 0.5);
    ctx.lineTo(left + width, y + 0.5);
    ctx.stroke();
    ctx.fillText(`${fmt(max * f)}${f === 1 ? unit : ""}`, left - 6, y);
  }
}

// The batch chart's scale: the tallest bar, unless a few prefill steps dwarf the rest (then 1.5x
// the 90th percentile, and taller bars are cut at the top, marked by a dark cap).
function stepsScale(totals) {
  const sorted = [...totals].sort((a, b) => a - b);
  const tallest = sorted.length ? sorted[sorted.length - 1] : 1;
  const p90 = sorted.length ? sorted[Math.floor(0.9 * (sorted.length - 1))] : 1;
  return niceCeil(Math.max(1, Math.min(tallest, 1.5 * p90)));
}

function drawSteps() {
  const { ctx, width, height } = canvasContext($("steps-chart"));
  const left = 70, top = 8, plotW = width - left - 8, plotH = height - top - 8;
  const steps = page.steps;
  const totals = steps.map((s) => s[1] + s[2]);
  const max = stepsScale(totals);
  drawAxes(ctx, left, top, plotW, plotH, max, " tok");
  const barW = plotW / STEPS_SHOWN;
  const x0 = left + plotW - steps.length * barW;
  const style = getComputedStyle(document.documentElement);
  const barHeight = (tokens) => (plotH * Math.min(tokens, max)) / max;
  steps.forEach(([, prefill, generated], i) => {
    const x = x0 + i * barW, w = Math.max(1, barW - 1);
    const hPrefill = barHeight(prefill), hTotal = barHeight(prefill + generated);
    ctx.fillStyle = style.getPropertyValue("--prefill");
    ctx.fillRect(x, top + plotH - hPrefill, w, hPrefill);
    ctx.fillStyle = style.getPropertyValue("--decode");
    ctx.fillRect(x, top + plotH - hTotal, w, hTotal - hPrefill);
    if (prefill + generated > max) {
      ctx.fillStyle = "#1f2328";
      ctx.fillRect(x, top, w, 3);
    }
  });
  const caption = $("steps-caption");
  if (!steps.length) { caption.textContent = "No steps yet: the engine steps while requests run."; return; }
  const seconds = steps.reduce((sum, s) => sum + s[3], 0) / 1000;
  const first = steps[0][0], last = steps[steps.length - 1][0];
  const tallest = Math.max(...totals);
  caption.textContent = `Steps ${fmt(first)}–${fmt(last)}, one bar each: ${fmt(seconds, 2)} s of stepping, `
    + `mean step ${fmt((1000 * seconds) / steps.length, 1)} ms`
    + (tallest > max ? `; bars with a dark cap go past the top (the largest: ${fmt(tallest)} tokens).` : ".");
}

function drawRates(now) {
  const { ctx, width, height } = canvasContext($("tps-chart"));
  const left = 70, top = 8, plotW = width - left - 8, plotH = height - top - 8;
  const max = niceCeil(Math.max(1, ...page.rates.map((r) => r[1])));
  drawAxes(ctx, left, top, plotW, plotH, max, "");
  if (page.rates.length < 2) return;
  const x = (t) => left + plotW * (1 - (now - t) / RATE_HISTORY_S);
  const y = (v) => top + plotH * (1 - v / max);
  ctx.beginPath();
  page.rates.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
  ctx.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--decode");
  ctx.lineWidth = 2;
  ctx.stroke();
  ctx.lineTo(x(page.rates[page.rates.length - 1][0]), top + plotH);
  ctx.lineTo(x(page.rates[0][0]), top + plotH);
  ctx.fillStyle = "rgba(37, 99, 235, 0.12)";
  ctx.fill();
}

// -- wiring --------------------------------------------------------------------------------------

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  $("view-chat").hidden = name !== "chat";
  $("view-engine").hidden = name !== "engine";
  if (name === "engine" && !page.watching) {
    page.watching = watchStats().finally(() => { page.watching = null; });
  } else if (name !== "engine" && page.watching) {
    page.statsRequest.abort();  // no stream while nobody looks
    setStatus(page.model ? "ready" : "…", Boolean(page.model));
  }
  location.hash = name === "engine" ? "#engine" : "";
}

for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showView(tab.dataset.view));
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || page.chatRequest) return;
  $("prompt").value = "";
  sendMessage(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => page.chatRequest && page.chatRequest.abort());
$("new-chat").addEventListener("click", newChat);
$("key-button").addEventListener("click", () => askForKey("API key for this server:"));
for (const id of ["system-prompt", ...Object.keys(SETTINGS)]) $(id).addEventListener("change", saveChat);

restoreChat();
loadModel();
showView(location.hash === "#engine" ? "engine" : "chat");
