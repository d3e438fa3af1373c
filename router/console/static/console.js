// Orchard's console: renders GET /v1/cluster/console, streams GET /v1/cluster/events/stream, asks
// GET /v1/cluster/what-if and carries out the admin routes. The admin key lives in this tab's
// sessionStorage and travels only in the Authorization header (an EventSource cannot send headers,
// so the stream is read with fetch). Everything is written with textContent: no markup from the server.
"use strict";

const KEY = "orchard.adminKey";
const state = { view: null, events: [], lastSeq: 0, offset: null, stream: null, refreshTimer: null, pending: null };

const $ = (id) => document.getElementById(id);
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}
function size(b) {
  if (b === null || b === undefined) return "?";
  const a = Math.abs(b);
  if (a >= 2 ** 30) return (b / 2 ** 30).toFixed(1) + " GiB";
  if (a >= 2 ** 20) return (b / 2 ** 20).toFixed(0) + " MiB";
  return (b / 1024).toFixed(0) + " KiB";
}
function dur(s) {
  if (s === null || s === undefined) return "?";
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(0) + " min";
  return (s / 3600).toFixed(1) + " h";
}
function notice(text, error) {
  const n = $("notice");
  n.hidden = !text;
  n.textContent = text || "";
  n.className = error ? "error" : "";
}

// ---- the key and the API -------------------------------------------------------------------------
function key() { return sessionStorage.getItem(KEY) || ""; }
function headers(json) {
  const h = { Authorization: "Bearer " + (key() || "none") };
  if (json) h["Content-Type"] = "application/json";
  return h;
}
async function api(method, path, body) {
  const r = await fetch(path, { method, headers: headers(body !== undefined), body: body === undefined ? undefined : JSON.stringify(body), cache: "no-store" });
  let data = null;
  try { data = await r.json(); } catch (_) { /* not JSON */ }
  if (!r.ok) {
    const msg = (data && data.error && data.error.message) || r.status + " " + r.statusText;
    const err = new Error(msg);
    err.status = r.status;
    throw err;
  }
  return data;
}
function refused(e) {
  if (e.status === 401) notice("This cluster needs an admin key: enter it above (it stays in this tab).", true);
  else if (e.status === 403) notice("That key is a user key: the console needs an admin key.", true);
  else notice(e.message, true);
}

// ---- the view ------------------------------------------------------------------------------------
async function refresh() {
  try {
    const view = await api("GET", "/v1/cluster/console");
    state.view = view;
    if (view.now !== null) state.offset = Date.now() / 1000 - view.now;
    notice("");
    render(view);
    if (!state.stream) startStream();
  } catch (e) {
    refused(e);
  }
}
function refreshSoon(ms) {
  clearTimeout(state.refreshTimer);
  state.refreshTimer = setTimeout(refresh, ms);
}

function render(v) {
  const dash = $("dashboard-link");
  if (v.dashboard_url) { dash.href = v.dashboard_url + "/#/actors"; dash.hidden = false; } else dash.hidden = true;
  renderNodes(v);
  renderInstances(v);
  renderPolicy(v);
  fillSelect($("whatif-model"), v.models.map((m) => m.id), null);
  fillSelect($("whatif-node"), v.nodes.filter((n) => n.alive).map((n) => n.node_id), "anywhere (as a request)");
  fillSelect($("filter-model"), v.models.map((m) => m.id), "all");
  fillSelect($("filter-node"), v.nodes.map((n) => n.node_id), "all");
  const copying = v.nodes.some((n) => n.store && n.store.copies.length) || v.instances.some((i) => i.status === "loading");
  if (copying) refreshSoon(1500); // progress moves between events
}
function fillSelect(sel, values, blank) {
  const keep = sel.value;
  const wanted = (blank !== null ? [""] : []).concat(values);
  const have = Array.from(sel.options).map((o) => o.value);
  if (have.join("\n") !== wanted.join("\n")) {
    sel.replaceChildren(...wanted.map((v) => el("option", { value: v }, v === "" ? blank : v)));
  }
  if (wanted.includes(keep)) sel.value = keep;
}

function renderNodes(v) {
  const out = v.nodes.map((n) => {
    const bar = el("div", { class: "bar", "data-usable": n.usable_bytes });
    const total = Math.max(n.usable_bytes, n.segments.reduce((a, s) => a + s.bytes, 0)) || 1;
    for (const s of n.segments) {
      const loading = v.instances.some((i) => i.model === s.model && i.node_id === n.node_id && i.status === "loading");
      bar.append(el("div", {
        class: "seg " + s.kind + (loading ? " loading" : ""), "data-kind": s.kind, "data-model": s.model, "data-bytes": s.bytes,
        title: s.label, style: "width:" + (100 * s.bytes / total).toFixed(2) + "%",
      }, s.kind === "weights" ? s.model : ""));
    }
    const card = el("div", { class: "node" + (n.alive ? "" : " dead"), "data-node": n.node_id },
      el("h3", {}, el("span", {}, n.node_id + " ", el("span", { class: "quiet" }, n.chip)),
        el("span", { class: "badge " + (n.alive ? "on" : "off") }, n.alive ? (n.draining ? "draining" : "alive") : "dead")),
      bar,
      el("div", { class: "scale" }, el("span", {}, "0"), el("span", {}, size(n.usable_bytes) + " usable of " + size(n.total_bytes))),
      el("p", { class: "words" }, n.words));
    if (n.ingress_url) card.append(el("p", { class: "quiet" }, "its own ingress: ", el("a", { href: n.ingress_url + "/ui" }, n.ingress_url)));
    if (n.store) {
      const st = el("div", { class: "store" }, el("div", {}, n.store.words),
        el("div", { class: "quiet" }, "weights on disk: " + (n.store.models.join(", ") || "none")));
      for (const c of n.store.copies) {
        const pct = c.total_bytes ? (100 * c.done_bytes / c.total_bytes) : 0;
        st.append(el("div", { class: "copy", "data-model": c.model }, c.words,
          el("div", { class: "progress" }, el("div", { style: "width:" + pct.toFixed(1) + "%" }))));
      }
      card.append(st);
    }
    return card;
  });
  $("nodes").replaceChildren(...out);
}

function renderInstances(v) {
  const rows = v.instances.map((i) => {
    const guards = el("td", {}, ...i.guards.map((g) => el("span", { class: "guard " + g.protection, title: g.words, "data-protection": g.protection }, g.protection.replace("_", "-"))));
    const ray = el("td", {});
    if (i.actor_url) ray.append(el("a", { href: i.actor_url, target: "_blank", rel: "noopener noreferrer", title: i.actor }, "actor & log"));
    else if (i.actor) ray.append(el("span", { class: "quiet", title: "no dashboard link: see README" }, i.actor));
    return el("tr", { "data-model": i.model, "data-node": i.node_id, "data-status": i.status },
      el("td", {}, el("b", {}, i.model)), el("td", {}, i.node_id), el("td", {}, i.kind + (i.role === "utility" ? " (utility)" : "")),
      el("td", {}, i.status), el("td", { title: "of which reserved KV " + size(i.kv_bytes) + (i.cache_bytes ? "; kept prompt prefixes beside it " + size(i.cache_bytes) : "") + (i.memory_words ? "; " + i.memory_words : "") }, size(i.bytes) + (i.kv_bytes ? " (KV " + size(i.kv_bytes) + ")" : "") + (i.cache_bytes ? " + " + size(i.cache_bytes) + " kept prefixes" : ""), ...(i.memory_words ? [el("div", { class: "quiet measured" }, i.memory_words)] : [])),
      el("td", {}, String(Math.max(i.in_flight, i.leases))), el("td", {}, i.idle_s === null ? "?" : dur(i.idle_s)),
      guards, el("td", { class: "stays" }, i.stays), ray);
  });
  $("instances").tBodies[0].replaceChildren(...rows);
  $("no-instances").hidden = rows.length > 0;
}

function renderPolicy(v) {
  const p = v.policy;
  $("policy-sentences").replaceChildren(...p.sentences.map((s) => el("li", {}, s)));
  $("caps").tBodies[0].replaceChildren(...p.caps.map((c) => el("tr", { "data-cap": c.name, "data-scope": c.scope },
    el("td", { title: c.name }, c.words), el("td", {}, c.scope), el("td", { class: c.used >= c.limit ? "full" : "" }, c.used + " / " + c.limit))));
  $("no-caps").hidden = p.caps.length > 0;
  $("utility").textContent = p.utility.join(", ") || "none";
  $("pinned").textContent = p.pinned.join(", ") || "none";
  $("keep-warm").textContent = p.keep_warm.join(", ") || "none";
  $("models").tBodies[0].replaceChildren(...v.models.map((m) => el("tr", { "data-model": m.id },
    el("td", {}, m.id), el("td", {}, m.kind), el("td", {}, m.role), el("td", {}, size(m.need_bytes)),
    el("td", {}, m.words), el("td", {}, m.stored_on.join(", ") || "-"))));
}

// ---- the story: server-sent events over fetch -----------------------------------------------------
function when(at) {
  if (state.offset === null) return "";
  return new Date((at + state.offset) * 1000).toLocaleTimeString();
}
function storyLine(s, fresh) {
  const e = s.event;
  return el("li", { class: fresh ? "fresh" : "", "data-kind": e.kind, "data-model": e.model, "data-node": e.node_id, "data-seq": e.seq },
    el("span", { class: "when" }, when(e.at)), el("span", { class: "kind" }, e.kind), s.sentence);
}
function shown(s) {
  const m = $("filter-model").value, n = $("filter-node").value;
  return (!m || s.event.model === m) && (!n || s.event.node_id === n);
}
function renderStory() {
  const items = state.events.filter(shown).slice(-400).reverse().map((s) => storyLine(s, false));
  $("story").replaceChildren(...items);
}
function addEvents(batch, live) {
  for (const s of batch) {
    if (s.event.seq <= state.lastSeq) continue; // a reconnect sends from the last one seen
    state.events.push(s);
    state.lastSeq = s.event.seq;
    if (live && state.offset === null) state.offset = Date.now() / 1000 - s.event.at;
    if (live && shown(s)) $("story").prepend(storyLine(s, true));
  }
  if (state.events.length > 2000) state.events = state.events.slice(-1000);
}

async function startStream() {
  const ctl = new AbortController();
  state.stream = ctl;
  const live = $("live");
  let caughtUp = false;
  try {
    const r = await fetch("/v1/cluster/events/stream?since=" + state.lastSeq, { headers: headers(false), signal: ctl.signal, cache: "no-store" });
    if (!r.ok) throw Object.assign(new Error("the event stream: " + r.status), { status: r.status });
    live.textContent = "live"; live.className = "badge on";
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      const batch = [];
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const lines = buf.slice(0, cut).split("\n");
        buf = buf.slice(cut + 2);
        const kind = (lines.find((l) => l.startsWith("event: ")) || "event: message").slice(7);
        const data = lines.filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (kind === "caught_up") {
          // the log so far has come: show it at once; what follows is live
          if (!caughtUp) { addEvents(batch.splice(0), false); renderStory(); }
          caughtUp = true;
        } else if (kind === "cluster_event" && data) batch.push(JSON.parse(data));
      }
      if (batch.length) {
        addEvents(batch, caughtUp);
        if (caughtUp) refreshSoon(250);
      }
    }
  } catch (e) {
    if (ctl.signal.aborted) return;
    if (e.status === 401 || e.status === 403) { refused(e); state.stream = null; live.textContent = "offline"; live.className = "badge off"; return; }
  }
  if (state.stream !== ctl) return;
  live.textContent = "reconnecting"; live.className = "badge off";
  state.stream = null;
  setTimeout(startStream, 2000);
}
function restartStream() {
  if (state.stream) state.stream.abort();
  state.stream = null;
  state.events = []; state.lastSeq = 0;
  $("story").replaceChildren();
}

// ---- what if, and act ----------------------------------------------------------------------------
function showAnswer(box, answer) {
  box.hidden = false;
  box.className = "answer " + answer.decision.decision;
  box.setAttribute("data-decision", answer.decision.decision);
  box.replaceChildren(el("div", { class: "words" }, answer.words), answer.message ? el("div", { class: "message" }, answer.message) : "");
}
async function whatIf(model, node) {
  const q = "model=" + encodeURIComponent(model) + (node ? "&node=" + encodeURIComponent(node) : "");
  return api("GET", "/v1/cluster/what-if?" + q);
}
async function onWhatIf(ev) {
  ev.preventDefault();
  const model = $("whatif-model").value, node = $("whatif-node").value;
  if (!model) return;
  try { showAnswer($("whatif-result"), await whatIf(model, node)); } catch (e) { refused(e); }
}

async function preview(action, model, node) {
  const v = state.view;
  const inst = v.instances.filter((i) => i.model === model);
  if (action === "load") {
    const a = await whatIf(model, node);
    showAnswer($("whatif-result"), a);
    return { text: "Load " + model + (node ? " on " + node : " where the policy chooses") + ": " + a.words + (a.message ? " (" + a.message + ")" : ""), go: a.decision.decision === "place" };
  }
  if (action === "unload") {
    if (!inst.length) return { text: model + " is not loaded anywhere: nothing to unload.", go: false };
    const freed = inst.reduce((a, i) => a + i.bytes, 0);
    const busy = inst.filter((i) => i.in_flight || i.leases).length;
    return { text: "Unload " + model + " from " + inst.map((i) => i.node_id).join(", ") + ": frees " + size(freed) + (busy ? "; requests in flight there end first" : "") + ".", go: true };
  }
  if (action === "pin") return { text: "Pin " + model + ": its instances are never evicted nor unloaded when idle, and its room is no longer available to other models.", go: true };
  if (action === "unpin") return { text: "Unpin " + model + ": its instances may be evicted again by the " + v.policy.eviction + " order.", go: true };
  const row = v.models.find((m) => m.id === model);
  const targets = node ? [node] : v.nodes.filter((n) => n.alive).map((n) => n.node_id);
  const missing = targets.filter((t) => !(row && row.stored_on.includes(t)));
  return { text: "Pull " + model + "'s weights into the store of " + targets.join(", ") + (missing.length ? " (copies to " + missing.join(", ") + ")" : ": already stored everywhere asked") + "; nothing is loaded.", go: true };
}
async function onAction(ev) {
  const action = ev.target.getAttribute("data-action");
  const model = $("whatif-model").value, node = $("whatif-node").value;
  if (!model || !state.view) return;
  $("act-result").hidden = true;
  try {
    const p = await preview(action, model, node);
    state.pending = p.go ? { action, model, node } : null;
    $("confirm-text").textContent = p.text;
    $("confirm-go").disabled = !p.go;
    $("confirm").hidden = false;
  } catch (e) { refused(e); }
}
async function onConfirm() {
  const p = state.pending;
  if (!p) return;
  state.pending = null;
  $("confirm").hidden = true;
  const out = $("act-result");
  out.hidden = false; out.className = "answer"; out.textContent = p.action + " " + p.model + "...";
  const body = p.action === "load" ? (p.node ? { node: p.node } : {}) : p.action === "pull" ? (p.node ? { nodes: [p.node] } : {}) : {};
  try {
    const r = await api("POST", "/v1/models/" + encodeURIComponent(p.model) + "/" + p.action, body);
    out.className = "answer place"; out.setAttribute("data-done", p.action);
    out.textContent = "done: " + p.action + " " + p.model + " (" + JSON.stringify(r) + ")";
  } catch (e) {
    out.className = "answer reject"; out.setAttribute("data-done", "error");
    out.textContent = p.action + " " + p.model + " refused: " + e.message;
  }
  refreshSoon(0);
}

// ---- start ---------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    restartStream();
    refresh();
  });
  $("key-forget").addEventListener("click", () => { sessionStorage.removeItem(KEY); restartStream(); notice("The key is forgotten."); });
  $("whatif-form").addEventListener("submit", onWhatIf);
  for (const b of document.querySelectorAll(".actions button")) b.addEventListener("click", onAction);
  $("confirm-go").addEventListener("click", onConfirm);
  $("confirm-cancel").addEventListener("click", () => { state.pending = null; $("confirm").hidden = true; });
  $("filter-model").addEventListener("change", renderStory);
  $("filter-node").addEventListener("change", renderStory);
  refresh();
});
