// Dashboard: polls /dashboard/stats once a second (only new points), redraws the canvas
// charts that mean something here (speculative decoding once drafts are verified, the CPU's
// run and wait where the kernel counts them, thermal zones and cpufreq only where the board has
// them), and runs a chat panel that streams from /v1/chat/completions: the model's reasoning
// folded above its answer, its tool calls shown as such and, with "board tools" on, run here (a
// tool reading this board's sensors) and sent back. A checkpoint without a chat template gets plain completions (/v1/completions).
// Text from the model or the server is only ever set with textContent.
"use strict";
(function () {
  const KEEP = 300;                 // points kept per series in the page
  const POLL_MS = 1000;
  const state = {
    since: {steps: 0, series: 0, thermal: 0}, steps: [], series: [], thermal: [], drawn: 0, model: null,
    chat: [], busy: false, sensors: null, notes: null, speculation: null,
  };
  const $ = id => document.getElementById(id);

  function keep(arr, items) {
    for (const x of items) arr.push(x);
    if (arr.length > KEEP) arr.splice(0, arr.length - KEEP);
  }

  // rows: [label, value] or [label, value, hint]; the hint (a setting's help) is the row's tooltip
  function setRows(table, rows) {
    const body = table.tBodies[0];
    body.replaceChildren();
    for (const [k, v, hint] of rows) {
      const tr = document.createElement("tr");
      const a = document.createElement("td"), b = document.createElement("td");
      a.textContent = k;
      b.textContent = v === null || v === undefined ? "—" : (typeof v === "object" ? JSON.stringify(v) : String(v));
      if (hint) tr.title = hint;
      tr.append(a, b);
      body.append(tr);
    }
  }

  function show(id, on) { $(id).hidden = !on; }

  function throttledRanges(policyName) {
    const out = [];
    let start = null;
    for (const s of state.thermal) {
      const p = s.policies[policyName];
      const on = !!(p && p.throttled);
      if (on && start === null) start = s.t;
      if (!on && start !== null) { out.push([start, s.t]); start = null; }
    }
    if (start !== null) out.push([start, state.thermal[state.thermal.length - 1].t + 1]);
    return out;
  }

  // A chart in a hidden card is not drawn: it has no size to draw at. Each canvas keeps the
  // number of points it drew (data-points), for tests and for a look in the inspector.
  function chart(id, opt) {
    const canvas = $(id);
    const n = canvas.closest("[hidden]") ? 0 : drawChart(canvas, opt);
    canvas.dataset.points = String(n);
    return n;
  }

  function draw() {
    let n = 0;
    n += chart("chart-decode", {xTime: true, series: [
      {name: "ms per step", points: state.steps.map(s => [s.t, s.ms])}]});
    n += chart("chart-attn", {kind: "scatter", yMin: 0, yMax: 100, xLabel: "context (tokens)", series: [
      {name: "attention %", points: state.steps.map(s => [s.ctx, 100 * s.attn])}]});
    n += chart("chart-tps", {xTime: true, series: [
      {name: "tokens/s", points: state.series.map(s => [s.t, s.tokens_per_s])}]});
    n += chart("chart-queue", {xTime: true, series: [
      {name: "running", points: state.series.map(s => [s.t, s.running])},
      {name: "waiting", points: state.series.map(s => [s.t, s.waiting])}]});
    n += chart("chart-cpu", {xTime: true, yMin: 0, series: [
      {name: "running", points: state.series.map(s => [s.t, s.cpu_run_cores ?? null])},
      {name: "waiting for a CPU", points: state.series.map(s => [s.t, s.cpu_wait_cores ?? null])}]});
    // seconds without drafts are gaps, not 0%: nothing was guessed then
    n += chart("chart-spec", {xTime: true, yMin: 0, yMax: 100, empty: "no drafts yet", series: [
      {name: "accepted %", points: state.series.map(s => [s.t,
        s.spec_drafted ? 100 * s.spec_accepted / s.spec_drafted : null])}]});
    const positions = (state.speculation && state.speculation.by_position) || [];
    n += chart("chart-spec-position", {yMin: 0, yMax: 100, xInteger: true, xLabel: "position in the draft",
      empty: "no drafts yet", series: [{name: "accepted % (since start)",
        points: positions.filter(p => p.drafted).map(p => [p.position, 100 * p.accepted / p.drafted])}]});
    const zones = new Set(), policies = new Set();
    for (const s of state.thermal) {
      Object.keys(s.zones).forEach(z => zones.add(z));
      Object.keys(s.policies).forEach(p => policies.add(p));
    }
    n += chart("chart-temp", {xTime: true, floating: true, empty: "no thermal zones", series: [...zones].map(z => (
      {name: z.replace(/-thermal$/, ""), points: state.thermal.map(s => [s.t, s.zones[z] ?? null])}))});
    // each policy's throttled periods shaded in its own line colour; the legend says which
    const shade = [], last = state.thermal[state.thermal.length - 1];
    [...policies].forEach((p, i) => {
      for (const [a, b] of throttledRanges(p)) shade.push([a, b, PALETTE[i % PALETTE.length]]);
    });
    n += chart("chart-freq", {xTime: true, yMin: 0, shade, empty: "no cpufreq policies",
      series: [...policies].map(p => ({
        name: p + (last && last.policies[p] && last.policies[p].throttled ? " (throttled)" : ""),
        points: state.thermal.map(s => {
          const v = s.policies[p]; return [s.t, v && v.cur_hz ? v.cur_hz / 1e9 : null]; })}))});
    state.drawn += 1;
    document.body.dataset.drawn = String(state.drawn);
    document.body.dataset.points = String(n);
  }

  function showFacts(d) {
    const status = $("status");
    status.textContent = d.status;
    status.className = "badge " + (d.status === "ready" ? "ok" : d.status === "failed" ? "bad" : "");
    if (d.model && d.model.id) {
      $("model-name").textContent = d.model.id;
      if (!state.model) {
        setRows($("model-facts"), (d.rows && d.rows.model) || []);
        state.model = d.model;
        setNotes(d.model_notes || {});
      }
    }
    if (d.error) setRows($("model-facts"), [["error", d.error]]);
    setRows($("settings-facts"), (d.rows && d.rows.settings) || []);
    showSpeculation(d);
    const q = d.queue || {};
    const pc = q.prefix_cache;   // prefix cache: share of prompt tokens served from cached KV blocks
    $("queue-now").textContent = `${q.running || 0} running, ${q.waiting || 0} waiting; ` +
      `KV blocks ${q.kv_blocks_used || 0} of ${q.kv_blocks_total || 0} in use` +
      (pc && pc.query_tokens ? `; prefix cache served ${(100 * pc.hit_ratio).toFixed(0)}% of ` +
        `${pc.query_tokens.toLocaleString("en")} prompt tokens` : "");
    const last = state.steps[state.steps.length - 1];
    $("decode-now").textContent = last ? `${last.ms.toFixed(1)} ms, ${last.batch} sequence${last.batch > 1 ? "s" : ""}, ` +
      `context ${last.ctx.toLocaleString("en")} tokens` : "";
    const lastSec = state.series[state.series.length - 1];
    $("tps-now").textContent = lastSec ? `${lastSec.tokens_per_s} tokens/s` : "";
    showCpu();
    const th = d.thermal, badge = $("throttle");
    state.sensors = th;
    // null: not sampled yet; empty lists: a machine without sensors (a VM, a laptop's container)
    const zones = th ? th.zones.length > 0 : false, policies = th ? th.policies.length > 0 : false;
    show("card-temp", zones);
    show("card-freq", policies);
    show("thermal-section", zones || policies);
    show("throttle", zones || policies);
    show("thermal-none", th !== null && !zones && !policies);
    if (zones || policies) {
      badge.textContent = th.throttled ? "THROTTLED" : "not throttled";
      badge.className = "badge " + (th.throttled ? "bad" : "ok");
      const rows = th.zones.map(z => [z.zone, z.temp_c === null ? "unknown" : z.temp_c.toFixed(1) + " °C"]);
      for (const p of th.policies) {
        const ghz = v => v ? (v / 1e9).toFixed(2) : "?";
        rows.push([`${p.policy} (${p.cluster})`, `${ghz(p.cur_hz)} / ${ghz(p.hw_max_hz || p.max_hz)} GHz` +
          (p.throttled ? ` THROTTLED: ${p.reason}` : "") +
          ` · ${(d.throttled_seconds || {})[p.policy] || 0} s throttled`]);
      }
      setRows($("thermal-facts"), rows);
    }
  }

  async function poll() {
    try {
      const q = new URLSearchParams(state.since);
      const r = await fetch(`/dashboard/stats?${q}`, {cache: "no-store"});
      const d = await r.json();
      const lists = {steps: d.steps || [], series: d.series || [], thermal: d.thermal_history || []};
      for (const [name, items] of Object.entries(lists)) {
        keep(state[name], items);
        if (items.length) state.since[name] = items[items.length - 1].t;
      }
      showFacts(d);
      if (d.auth_required) $("key-label").hidden = false;
      draw();
    } catch (e) {
      $("status").textContent = "offline";
      $("status").className = "badge bad";
    }
    setTimeout(poll, POLL_MS);
  }

  // ---- CPU wait --------------------------------------------------------------------
  // Shown where the kernel counts run-queue waits (schedstat): the cores the process ran on and
  // the cores' worth of time its ready threads waited, a neighbour holding them. Over the last
  // seconds, the wait as a share of the run time: Prometheus's BoardCpuContended fires when it
  // stays above half for 15 minutes (docs/fleet.md).
  const CPU_WINDOW_S = 10, CPU_CONTENDED = 0.5;

  function showCpu() {
    const known = state.series.filter(s => s.cpu_run_cores !== null && s.cpu_run_cores !== undefined);
    show("card-cpu", known.length > 0);
    const recent = known.slice(-CPU_WINDOW_S);
    const run = recent.reduce((a, s) => a + s.cpu_run_cores, 0);
    const wait = recent.reduce((a, s) => a + s.cpu_wait_cores, 0);
    const now = $("cpu-now");
    if (!recent.length || run < 0.01 * recent.length) {
      now.textContent = recent.length ? "idle" : "";
      now.className = "now";
      return;
    }
    const share = wait / run;
    now.textContent = `${(run / recent.length).toFixed(2)} cores; waited ${(100 * share).toFixed(0)}% ` +
      `as long as it ran (last ${recent.length} s)`;
    now.className = "now" + (share > CPU_CONTENDED ? " bad" : "");
  }

  // ---- speculative decoding ------------------------------------------------------
  // Shown once the server speculates by default or has verified a draft: the share of drafted
  // tokens accepted over the last seconds with drafts and since the start, per second and per
  // position in the draft (a position is reached only when the ones before it were accepted).
  const SPEC_WINDOW_S = 10;

  function showSpeculation(d) {
    const sp = d.speculation;
    if (!sp) return;
    state.speculation = sp;
    const on = !!(d.settings && d.settings.spec_prompt_lookup);
    show("card-spec", on || sp.draft_tokens > 0);
    show("card-spec-position", sp.draft_tokens > 0);
    if (!sp.draft_tokens) {
      $("spec-now").textContent = on ? `on, up to ${d.settings.spec_prompt_lookup} tokens per step; no drafts yet` : "";
      return;
    }
    const recent = state.series.filter(s => s.spec_drafted).slice(-SPEC_WINDOW_S);
    const drafted = recent.reduce((a, s) => a + s.spec_drafted, 0);
    const accepted = recent.reduce((a, s) => a + s.spec_accepted, 0);
    const overall = 100 * sp.accepted_tokens / sp.draft_tokens;
    const rate = drafted ? 100 * accepted / drafted : overall;
    $("spec-now").textContent = `drafts accepted ${rate.toFixed(0)}% (${overall.toFixed(0)}% ` +
      `of ${sp.draft_tokens} overall)`;
  }

  // What the chat panel adapts to: the demo model's note, plain completions without a template.
  function setNotes(notes) {
    state.notes = notes;
    show("demo-note", !!notes.demo);
    const plain = notes.chat_template === false;
    $("chat-mode").querySelector("option[value=chat]").disabled = plain;
    show("mode-note", plain);
    if (plain) setMode("completion");
  }

  function setMode(mode) {
    $("chat-mode").value = mode;
    document.body.dataset.mode = mode;
    for (const el of document.querySelectorAll(".chat-only")) el.hidden = mode !== "chat";
    $("chat-input").placeholder = mode === "chat" ? "Ask something" : "Text for the model to continue";
  }

  // ---- chat ------------------------------------------------------------------

  const MAX_TOOL_ROUNDS = 3;
  // The one tool the page offers and runs itself: what the board's thermal zones read now.
  const BOARD_TOOL = {type: "function", function: {
    name: "read_board_sensor",
    description: "Read the current temperature of one of this board's sensors (thermal zones)",
    parameters: {type: "object", properties: {sensor: {type: "string",
      description: "the sensor, e.g. soc, bigcore0, gpu"}}, required: ["sensor"]}}};

  function runBoardTool(call) {
    let args;
    try { args = JSON.parse(call.arguments || "{}"); } catch (e) { return {error: "arguments are not JSON"}; }
    const zones = (state.sensors && state.sensors.zones) || [];
    // "soc", "SoC sensor", "soc-thermal" all name the zone soc-thermal: compare bare letters and digits
    const bare = s => String(s).toLowerCase().replace(/\b(sensor|thermal|zone)\b/g, "").replace(/[^a-z0-9]+/g, "");
    const want = bare(args.sensor || "");
    const zone = zones.find(z => want && bare(z.zone).startsWith(want)) ||
      zones.find(z => want && bare(z.zone).includes(want));
    if (!zone) return {error: `no sensor ${JSON.stringify(args.sensor)}`, sensors: zones.map(z => z.zone)};
    return {sensor: zone.zone, celsius: zone.temp_c};
  }

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = {user: "you", error: "error", tool: "tool"}[role] || "model";
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    div.append(who, body);
    const log = $("chat-log");
    const follow = atBottom();
    log.append(div);
    if (follow || role === "user") scrollDown();
    return body;
  }

  // The log follows the newest line unless the reader has scrolled up to read an older one.
  function atBottom() {
    const log = $("chat-log");
    return log.scrollHeight - log.scrollTop - log.clientHeight < 24;
  }
  function scrollDown() { const log = $("chat-log"); log.scrollTop = log.scrollHeight; }
  function grew(update) { const follow = atBottom(); update(); if (follow) scrollDown(); }
  window.applianceAddMessage = addMessage;   // used by the browser test to check escaping

  // An assistant turn: its reasoning folded (opened while it streams), the answer, its tool calls.
  function addReply() {
    const text = addMessage("assistant", "");
    const div = text.parentElement;
    const fold = document.createElement("details");
    fold.className = "reasoning";
    fold.open = true;
    fold.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "reasoning";
    const thought = document.createElement("div");
    fold.append(summary, thought);
    const calls = document.createElement("span");
    calls.className = "calls";
    div.insertBefore(fold, text);
    div.append(calls);
    return {text, fold, thought, calls};
  }

  function showCalls(view, calls) {
    view.calls.replaceChildren(...calls.map(c => {
      const el = document.createElement("span");
      el.className = "call";
      el.textContent = `\u2192 ${c.name}(${c.arguments})`;
      return el;
    }));
  }

  // One streamed reply into one reply view; resolves to what the model said. With a prompt,
  // a plain completion of it; without, the chat so far through the model's template.
  async function stream(view, headers, prompt) {
    const common = {model: state.model ? state.model.id : undefined, stream: true,
      max_tokens: parseInt($("chat-max").value, 10) || 128, stream_options: {include_usage: true}};
    const withTools = $("chat-tools").checked;
    const [url, body] = prompt !== undefined ? ["/v1/completions", {...common, prompt}]
      : ["/v1/chat/completions", {...common, messages: state.chat,
        chat_template_kwargs: {enable_thinking: $("chat-think").checked},
        ...(withTools ? {tools: [BOARD_TOOL]} : {})}];
    const resp = await fetch(url, {method: "POST", headers, body: JSON.stringify(body)});
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({error: {message: resp.statusText}}));
      throw new Error(`${resp.status}: ${err.error ? err.error.message : resp.statusText}`);
    }
    const out = {content: "", reasoning: "", calls: [], finish: null, usage: null, chunks: 0, first: null};
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i); buf = buf.slice(i + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const obj = JSON.parse(data);
          if (obj.error) throw new Error(obj.error.message);
          if (obj.usage) out.usage = obj.usage;
          for (const c of obj.choices || []) {
            const d = c.delta || (c.text ? {content: c.text} : {});     // a completion's chunk: text
            if (d.content || d.reasoning_content || d.tool_calls) {
              if (out.first === null) out.first = performance.now();
              out.chunks++;
            }
            if (d.reasoning_content) {
              out.reasoning += d.reasoning_content;
              grew(() => { view.fold.hidden = false; view.thought.textContent = out.reasoning; });
            }
            if (d.content) {
              out.content += d.content;
              grew(() => { view.text.textContent = out.content; });
            }
            for (const t of d.tool_calls || []) {      // OpenAI's deltas: id and name first, then arguments
              const call = out.calls[t.index] || (out.calls[t.index] = {id: "", name: "", arguments: ""});
              if (t.id) call.id = t.id;
              if (t.function && t.function.name) call.name += t.function.name;
              if (t.function && t.function.arguments) call.arguments += t.function.arguments;
              grew(() => showCalls(view, out.calls));
            }
            if (c.finish_reason) out.finish = c.finish_reason;
          }
        }
      }
    }
    if (out.reasoning && out.content) view.fold.open = false;       // folded once the answer is there
    return out;
  }

  async function send(ev) {
    ev.preventDefault();
    if (state.busy) return;
    const text = $("chat-input").value.trim();
    if (!text) return;
    state.busy = true;
    $("chat-send").disabled = true;
    document.body.dataset.chat = "streaming";
    // An attached image goes inline as a data: URL part before the text (vision models only).
    const file = $("chat-mode").value === "chat" ? $("chat-image").files[0] : undefined;
    const image = file ? await new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    }) : null;
    addMessage("user", image ? `[image: ${file.name}] ${text}` : text);
    const plain = $("chat-mode").value === "completion";
    const turnStart = state.chat.length;
    if (!plain) state.chat.push({role: "user", content: image
      ? [{type: "image_url", image_url: {url: image}}, {type: "text", text}] : text});
    $("chat-input").value = "";
    $("chat-image").value = "";
    const headers = {"Content-Type": "application/json"};
    const key = $("chat-key").value;
    if (key) headers["Authorization"] = "Bearer " + key;
    const t0 = performance.now();
    let chunks = 0, tokens = 0, toolCalls = 0, reasoning = 0, first = null, last = null;
    try {
      for (let round = 0; ; round++) {
        const view = addReply();
        try {
          last = await stream(view, headers, plain ? text : undefined);
        } catch (e) {
          if (!view.text.textContent && !view.thought.textContent) view.text.parentElement.remove();
          throw e;
        }
        chunks += last.chunks;
        tokens += last.usage ? last.usage.completion_tokens : last.chunks;
        reasoning += last.reasoning.length;
        if (first === null) first = last.first;
        if (plain) break;                              // a completion: no history, no tools
        const msg = {role: "assistant", content: last.content || null};
        if (last.reasoning) msg.reasoning_content = last.reasoning;
        if (last.calls.length) msg.tool_calls = last.calls.map(c => (
          {id: c.id, type: "function", function: {name: c.name, arguments: c.arguments}}));
        state.chat.push(msg);
        if (last.finish !== "tool_calls" || round + 1 >= MAX_TOOL_ROUNDS) break;
        for (const call of last.calls) {                // the page runs the calls and answers them
          toolCalls++;
          const result = call.name === BOARD_TOOL.function.name ? runBoardTool(call)
            : {error: `no tool named ${call.name}`};
          addMessage("tool", `${call.name} \u2192 ${JSON.stringify(result)}`);
          state.chat.push({role: "tool", tool_call_id: call.id, name: call.name, content: JSON.stringify(result)});
        }
      }
      const secs = (performance.now() - t0) / 1000;
      $("chat-stats").textContent = `${tokens} tokens in ${secs.toFixed(2)} s` +
        (secs > 0 ? ` (${(tokens / secs).toFixed(1)} tokens/s)` : "") +
        (first !== null ? `, first token after ${((first - t0) / 1000).toFixed(2)} s` : "") +
        (toolCalls ? `, ${toolCalls} tool call${toolCalls > 1 ? "s" : ""}` : "") +
        (last && last.finish ? `, finish: ${last.finish}` : "");
      document.body.dataset.chatChunks = String(chunks);
      document.body.dataset.chatToolCalls = String(toolCalls);
      document.body.dataset.chatReasoning = String(reasoning);
      document.body.dataset.chat = "done";
    } catch (e) {
      addMessage("error", String(e.message || e));
      state.chat.splice(turnStart);
      document.body.dataset.chat = "error";
    } finally {
      state.busy = false;
      $("chat-send").disabled = false;
    }
  }

  $("chat-form").addEventListener("submit", send);
  $("chat-reset").addEventListener("click", () => { state.chat = []; $("chat-log").replaceChildren(); });
  $("chat-input").addEventListener("keydown", e => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("chat-mode").addEventListener("change", () => setMode($("chat-mode").value));
  setMode($("chat-mode").value);
  poll();
})();
