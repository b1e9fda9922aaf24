// The mlxr page: chat over /v1/chat/completions (streamed, SSE), the models view over Ollama's
// /api/tags, /api/ps, /api/pull and /api/generate (keep_alive 0 unloads), Hub search over
// /api/search. Same-origin requests only; the API key (when the server wants one) is entered
// once and kept in this browser's localStorage, sent as a Bearer header, never in the page.
"use strict";

(function () {
  const $ = function (id) { return document.getElementById(id); };
  const md = window.mlxrMarkdown;
  const store = {
    get: function (k, d) {
      try { const v = localStorage.getItem("mlxr." + k); return v === null ? d : JSON.parse(v); }
      catch (e) { return d; }
    },
    set: function (k, v) { localStorage.setItem("mlxr." + k, JSON.stringify(v)); },
    del: function (k) { localStorage.removeItem("mlxr." + k); },
  };
  const state = { history: store.get("history", []), controller: null, info: {} };

  // -- HTTP ----------------------------------------------------------------------------------

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = store.get("apiKey", "");
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  async function errorText(r) {
    try {
      const body = await r.json();
      const e = body.error;
      return (typeof e === "string" ? e : e && e.message) || r.status + " " + r.statusText;
    } catch (e) { return r.status + " " + r.statusText; }
  }

  async function api(method, path, body, signal) {
    const r = await fetch(path, {
      method: method, headers: headers(body !== undefined), signal: signal,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (r.status === 401) { askKey(); throw new Error(await errorText(r)); }
    if (!r.ok) throw new Error(await errorText(r));
    return r;
  }

  function showError(msg) {
    const el = $("error");
    el.textContent = msg || "";
    el.hidden = !msg;
  }

  function askKey() {
    $("keybar").hidden = false;
    $("apikey").focus();
  }

  // -- chat ------------------------------------------------------------------------------------

  function settings() {
    return {
      system: $("system").value, temperature: $("temperature").value,
      top_p: $("top_p").value, max_tokens: $("max_tokens").value,
    };
  }

  function bubble(msg) {
    const div = document.createElement("div");
    div.className = "msg " + msg.role + (msg.error ? " error" : "");
    if (msg.reasoning) {
      const d = document.createElement("details");
      const s = document.createElement("summary");
      s.textContent = "Reasoning";
      const body = document.createElement("div");
      body.className = "reasoning";
      body.innerHTML = md.render(msg.reasoning);
      d.append(s, body);
      div.append(d);
    }
    const c = document.createElement("div");
    c.className = "content";
    if (msg.role === "user") c.textContent = msg.content;
    else c.innerHTML = md.render(msg.content || "");
    div.append(c);
    if (msg.stats || msg.error) {
      const s = document.createElement("div");
      s.className = "stats";
      s.textContent = msg.error || msg.stats;
      div.append(s);
    }
    return div;
  }

  function renderHistory() {
    const box = $("messages");
    box.replaceChildren.apply(box, state.history.map(bubble));
    box.lastElementChild && box.lastElementChild.scrollIntoView({ block: "end" });
  }

  function save() { store.set("history", state.history); }

  function requestBody(model) {
    const s = settings();
    const messages = [];
    if (s.system.trim()) messages.push({ role: "system", content: s.system });
    state.history.forEach(function (m) {
      if (!m.error && (m.role === "user" || m.content)) {
        messages.push({ role: m.role, content: m.content });
      }
    });
    const body = { model: model, messages: messages, stream: true,
                   stream_options: { include_usage: true } };
    if (s.temperature !== "") body.temperature = Number(s.temperature);
    if (s.top_p !== "") body.top_p = Number(s.top_p);
    if (s.max_tokens !== "") body.max_tokens = Number(s.max_tokens);
    return body;
  }

  // a streamed body's text, frame by frame: the pieces between `sep`s as they complete
  async function* frames(response, sep) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf(sep)) >= 0) {
        yield buf.slice(0, cut);
        buf = buf.slice(cut + sep.length);
      }
    }
  }

  // SSE: "data: {json}\n\n" events; "data: [DONE]" ends the stream
  async function* sseEvents(response) {
    for await (const event of frames(response, "\n\n")) {
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").hidden = !busy;
    $("model").disabled = busy;
  }

  async function send(text) {
    const model = $("model").value;
    if (!model) { showError("No model to chat with: pick one in Models."); return; }
    showError("");
    state.history.push({ role: "user", content: text });
    const answer = { role: "assistant", content: "", reasoning: "", model: model };
    state.history.push(answer);
    renderHistory();
    const node = $("messages").lastElementChild;
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const t0 = performance.now();
    let tFirst = null, tokens = 0, usage = null;
    const update = function () {
      const fresh = bubble(answer);
      fresh.dataset.streaming = "1";
      node.replaceChildren.apply(node, Array.from(fresh.childNodes));
      node.className = fresh.className;
      node.scrollIntoView({ block: "end" });
    };
    try {
      const r = await api("POST", "/v1/chat/completions", requestBody(model), controller.signal);
      for await (const ev of sseEvents(r)) {
        if (ev.error) throw new Error(ev.error.message || String(ev.error));
        if (ev.usage) usage = ev.usage;
        const d = ev.choices && ev.choices[0] && ev.choices[0].delta;
        if (!d) continue;
        if (d.content || d.reasoning_content) {
          if (tFirst === null) tFirst = performance.now();
          tokens += 1;
          answer.content += d.content || "";
          answer.reasoning += d.reasoning_content || "";
          update();
        }
      }
      // tok/s over the whole answer (first token included: outputs that queued up arrive
      // merged, so a rate from the first token on overstates short answers)
      const n = usage ? usage.completion_tokens : tokens;
      const secs = (performance.now() - t0) / 1000;
      answer.stats = n + " tokens, " + (n / secs).toFixed(1) + " tok/s, first token " +
        ((tFirst === null ? secs * 1000 : tFirst - t0) / 1000).toFixed(2) + " s";
    } catch (e) {
      if (e.name === "AbortError") {
        answer.stats = "stopped (" + tokens + " chunks)";
      } else {
        answer.error = "Error: " + e.message;
        showError(e.message);
      }
    } finally {
      state.controller = null;
      setBusy(false);
      save();
      renderHistory();
      $("messages").dataset.done = String(Number($("messages").dataset.done || 0) + 1);
    }
  }

  // -- models ----------------------------------------------------------------------------------

  function human(n) {
    if (n === null || n === undefined) return "?";
    const u = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
    return (i ? n.toFixed(1) : n) + " " + u[i];
  }

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  function buttonCell(label, fn) {
    const td = document.createElement("td");
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.addEventListener("click", fn);
    td.append(b);
    return td;
  }

  async function loadModels() {
    const sel = $("model");
    const want = store.get("model", "") || sel.value;
    const names = [];
    let ok = true;
    sel.dataset.ready = "";
    try {
      const v1 = await (await api("GET", "/v1/models")).json();
      v1.data.forEach(function (m) { names.push(m.id); });
      const tags = await (await api("GET", "/api/tags")).json();
      tags.models.forEach(function (m) { if (names.indexOf(m.name) < 0) names.push(m.name); });
      fillLocal(tags.models);
    } catch (e) { ok = false; showError(e.message); }
    sel.replaceChildren.apply(sel, names.map(function (n) {
      const o = document.createElement("option");
      o.value = o.textContent = n;
      return o;
    }));
    if (names.indexOf(want) >= 0) sel.value = want;
    else if (state.info.default_model && names.indexOf(state.info.default_model) >= 0) {
      sel.value = state.info.default_model;
    }
    if (ok) sel.dataset.ready = "1";
  }

  function fillLocal(models) {
    const body = $("local").tBodies[0];
    body.replaceChildren.apply(body, models.map(function (m) {
      const tr = document.createElement("tr");
      tr.append(cell(m.name), cell(m.details.family), cell(m.details.quantization_level),
        cell(human(m.size)), buttonCell("Chat", function () {
          $("model").value = m.name;
          store.set("model", m.name);
          show("chat");
        }));
      return tr;
    }));
  }

  async function loadPs() {
    try {
      const ps = await (await api("GET", "/api/ps")).json();
      const body = $("loaded").tBodies[0];
      body.replaceChildren.apply(body, ps.models.map(function (m) {
        const tr = document.createElement("tr");
        const until = m.expires_at.startsWith("9999") ? "forever"
          : new Date(m.expires_at).toLocaleTimeString();
        tr.append(cell(m.name), cell(human(m.size)), cell(m.device || "?"), cell(until),
          buttonCell("Stop", async function () {
            try {
              await api("POST", "/api/generate", { model: m.name, keep_alive: 0 });
            } catch (e) { showError(e.message); }
            loadPs();
          }));
        return tr;
      }));
    } catch (e) { showError(e.message); }
  }

  async function pull(name, progress, status) {
    try {
      const r = await api("POST", "/api/pull", { model: name, stream: true });
      const files = {};
      for await (const text of frames(r, "\n")) {  // NDJSON: one object a line
        const line = JSON.parse(text);
        if (line.error) throw new Error(line.error);
        status.textContent = line.status;
        if (line.total) {  // per file: the bar shows the sum over the files seen so far
          files[line.digest] = [line.total, line.completed || 0];
          let total = 0, done = 0;
          Object.values(files).forEach(function (f) { total += f[0]; done += f[1]; });
          progress.max = total;
          progress.value = done;
        }
        if (line.status === "success") progress.value = progress.max;
      }
      loadModels();
    } catch (e) { status.textContent = "failed: " + e.message; showError(e.message); }
  }

  async function search(q) {
    const body = $("hub").tBodies[0];
    body.replaceChildren();
    try {
      const res = await (await api("GET", "/api/search?q=" + encodeURIComponent(q))).json();
      res.models.forEach(function (m) {
        const tr = document.createElement("tr");
        tr.append(cell(m.name), cell(m.quantization || ""), cell(human(m.size)),
          cell((m.downloads || 0) + " downloads"));
        if (state.info.allow_pull) {
          const progress = document.createElement("progress");
          const status = document.createElement("span");
          const td = buttonCell("Pull", function () { pull(m.name, progress, status); });
          td.append(progress, status);
          progress.value = 0;
          tr.append(td);
        }
        body.append(tr);
      });
    } catch (e) { showError(e.message); }
  }

  function show(view) {
    $("chat-view").hidden = view !== "chat";
    $("models-view").hidden = view !== "models";
    $("tab-chat").classList.toggle("active", view === "chat");
    $("tab-models").classList.toggle("active", view === "models");
    if (view === "models") { loadPs(); loadModels(); }
  }

  // -- wiring ----------------------------------------------------------------------------------

  async function start() {
    try {
      state.info = await (await api("GET", "/api/info")).json();
      $("pull-note").hidden = !!state.info.allow_pull;
    } catch (e) { showError(e.message); }
    await loadModels();
  }

  const saved = store.get("settings", {});
  ["system", "temperature", "top_p", "max_tokens"].forEach(function (k) {
    if (saved[k] !== undefined) $(k).value = saved[k];
    $(k).addEventListener("change", function () { store.set("settings", settings()); });
  });
  $("composer").addEventListener("submit", function (ev) {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", function (ev) {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", function () {
    if (state.controller) state.controller.abort();
  });
  $("new-chat").addEventListener("click", function () {
    if (state.controller) state.controller.abort();
    state.history = [];
    save();
    renderHistory();
  });
  $("model").addEventListener("change", function () { store.set("model", $("model").value); });
  $("tab-chat").addEventListener("click", function () { show("chat"); });
  $("tab-models").addEventListener("click", function () { show("models"); });
  $("search-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    search($("search").value);
  });
  $("keybar").addEventListener("submit", function (ev) {
    ev.preventDefault();
    store.set("apiKey", $("apikey").value);
    $("apikey").value = "";
    $("keybar").hidden = true;
    showError("");
    start();
  });
  $("forget-key").addEventListener("click", function () { store.del("apiKey"); askKey(); });
  renderHistory();
  start();
})();
