// mlxd chat page: streams /v1/chat/completions (SSE over fetch), Stop aborts the request.
// No build step, no dependencies. Settings live in localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, model: null };
const SETTINGS = ["system", "temperature", "max-tokens", "top-p", "api-key"];

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text) { $("status").textContent = text; }

function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

// Markdown-lite: fenced code blocks (```lang ... ```, an unclosed fence while streaming too)
// and `inline code`; everything else is text.
function render(text) {
  const out = [];
  const fence = /```([\w+-]*)[^\n]*\n?([\s\S]*?)(?:```|$)/g;
  let last = 0, m;
  while ((m = fence.exec(text)) !== null) {
    out.push(inline(text.slice(last, m.index).replace(last ? /^\n/ : /^$/, "")));
    const lang = m[1] ? ` data-lang="${escapeHtml(m[1])}"` : "";
    out.push(`<pre${lang}><code>${escapeHtml(m[2])}</code></pre>`);
    last = fence.lastIndex;
    if (m[0].length === 0) fence.lastIndex++;
  }
  out.push(inline(text.slice(last).replace(last ? /^\n/ : /^$/, "")));  // the newline after a fence
  return out.join("");
}

function inline(s) {
  return escapeHtml(s).replace(/`([^`\n]+)`/g, '<code class="inline">$1</code>');
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.dataset.role = role;
  div.innerHTML = render(text);
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;  // a new message: show it
  return div;
}

// The transcript follows new text while it is scrolled to its end; a reader who scrolled up to
// read something earlier is left where they are.
function atEnd(log) { return log.scrollHeight - log.scrollTop - log.clientHeight < 40; }

function showAssistant(div, reasoning, content) {
  const log = $("log");
  const follow = atEnd(log);
  div.innerHTML = (reasoning ? `<div class="reasoning">${escapeHtml(reasoning)}</div>` : "") + render(content);
  if (follow) log.scrollTop = log.scrollHeight;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) { $("model-name").textContent = r.status === 401 ? "(API key needed: see Settings)" : "(unavailable)"; return; }
    const body = await r.json();
    state.model = body.data[0].id;
    $("model-name").textContent = state.model;
  } catch (e) {
    $("model-name").textContent = "(server unreachable)";
  }
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  document.body.dataset.streaming = on ? "1" : "0";
}

async function send(prompt) {
  state.messages.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const div = addMessage("assistant", "");
  div.dataset.done = "0";
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.messages);
  const body = {
    messages, stream: true,
    temperature: parseFloat($("temperature").value),
    max_tokens: parseInt($("max-tokens").value, 10),
    top_p: parseFloat($("top-p").value),
  };
  if (state.model) body.model = state.model;
  const controller = new AbortController();
  state.controller = controller;
  busy(true);
  setStatus("generating…");
  let content = "", reasoning = "", finish = null;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) {
      let msg = r.statusText;
      try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(`${r.status}: ${msg}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          for (const c of chunk.choices || []) {
            const d = c.delta || {};
            if (d.content) content += d.content;
            if (d.reasoning_content) reasoning += d.reasoning_content;
            if (c.finish_reason) finish = c.finish_reason;
          }
          showAssistant(div, reasoning, content);
        }
      }
    }
    setStatus(finish ? `done (${finish})` : "done");
  } catch (e) {
    if (e.name === "AbortError") {
      setStatus("stopped");
      finish = "stopped";
    } else {
      div.classList.add("error");
      div.textContent = String(e.message || e);
      setStatus("error");
    }
  } finally {
    state.controller = null;
    div.dataset.done = "1";
    div.dataset.finish = finish || "";
    if (content) state.messages.push({ role: "assistant", content });
    busy(false);
  }
}

function init() {
  for (const id of SETTINGS) {
    const saved = localStorage.getItem("mlxd." + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => { localStorage.setItem("mlxd." + id, $(id).value); if (id === "api-key") loadModel(); });
  }
  $("settings-toggle").addEventListener("click", () => {
    const s = $("settings");
    s.hidden = !s.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
  });
  $("clear").addEventListener("click", () => { if (state.controller) state.controller.abort(); state.messages = []; $("log").innerHTML = ""; setStatus(""); });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const prompt = $("prompt").value.trim();
    if (!prompt || state.controller) return;
    $("prompt").value = "";
    send(prompt);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  busy(false);
  loadModel();
}

init();
