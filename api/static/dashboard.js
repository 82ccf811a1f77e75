// kvadvisor dashboard: polls the advisor's JSON API and renders it. Vanilla JS, no deps.
// Every value shown comes from /v1/stats, /v1/volumes, /v1/plans or POST /v1/lookup.
// Key numbers carry stable ids; table rows carry data-key (source / location / volume id)
// and their cells data-field; the raw number of a formatted value is in data-value.
// Text from the API (source names, reasons) is only ever set through textContent.
"use strict";

const POLL_MS = 2000;
const PLAN_LIMIT = 50;

// ---------------------------------------------------------------- formatting
const intFmt = new Intl.NumberFormat("en-US");
function fmtInt(n) { return n === null || n === undefined ? "—" : intFmt.format(n); }
function fmtRate(x) { return x === null || x === undefined ? "—" : x.toFixed(1); }
function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = n, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${n} B` : `${v.toFixed(v >= 100 ? 0 : 1)} ${units[i]}`;
}
function fmtDuration(s) {
  s = Math.floor(s);
  if (s < 60) return `${s} s`;
  const m = Math.floor(s / 60), h = Math.floor(m / 60), d = Math.floor(h / 24);
  if (h < 1) return `${m} min ${s % 60} s`;
  if (d < 1) return `${h} h ${String(m % 60).padStart(2, "0")} min`;
  return `${d} d ${h % 24} h`;
}
function fmtHex64(n) {
  if (n === null || n === undefined) return "—";
  return `0x${BigInt(n).toString(16).padStart(16, "0")}`;
}
function fmtClock(ns) {
  if (!ns) return "—";
  const d = new Date(Number(ns) / 1e6);
  return d.toLocaleTimeString("en-GB", { hour12: false });
}
function pct(part, whole) { return whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0; }
function sumValues(obj) { return Object.values(obj || {}).reduce((a, b) => a + b, 0); }

// ---------------------------------------------------------------- DOM helpers
function $(id) { return document.getElementById(id); }
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-") || k === "title" || k === "colspan" || k === "style" || k === "id") node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}
/** Set a key number: formatted text, raw value in data-value, optional alert class. */
function setNum(id, value, fmt = fmtInt, alertIfPositive = false) {
  const node = $(id);
  if (!node) return;
  node.textContent = fmt(value);
  node.dataset.value = value === null || value === undefined ? "" : String(value);
  if (typeof value === "number" && fmt === fmtBytes) node.title = `${fmtInt(value)} bytes`;
  node.classList.toggle("alert", alertIfPositive && value > 0);
}
function numCell(field, value, fmt = fmtInt) {
  const td = el("td", { class: "num", "data-field": field, "data-value": value ?? "", text: fmt(value) });
  if (fmt === fmtBytes && typeof value === "number") td.title = `${fmtInt(value)} bytes`;
  return td;
}
function replaceRows(tbodyId, rows, emptyText, colspan) {
  const body = $(tbodyId);
  if (!rows.length) rows = [el("tr", { class: "empty" }, el("td", { colspan: String(colspan), text: emptyText }))];
  body.replaceChildren(...rows);
}
function bar(segments) {
  // segments: [{cls, pct, title}]
  // a non-zero share stays visible (at least 1% wide)
  return el("div", { class: "bar" }, ...segments.map((s) =>
    el("span", { class: s.cls, style: `width:${(s.pct > 0 ? Math.max(s.pct, 1) : 0).toFixed(2)}%`, title: s.title })));
}

// ---------------------------------------------------------------- tiers
/** Tier of a location: "<source>/g1" and "/g2" are worker tiers; volumes by their role. */
function tierOf(location, roles) {
  if (/\/g1$/i.test(location)) return { cls: "g1", label: "G1 GPU" };
  if (/\/g2$/i.test(location)) return { cls: "g2", label: "G2 host" };
  const role = roles[location];
  if (role === "fast") return { cls: "fast", label: "G3 fast" };
  if (role === "slow") return { cls: "slow", label: "G3 slow" };
  if (role === "archive") return { cls: "archive", label: "G4 archive" };
  return { cls: "other", label: role && role !== "none" ? role : "volume" };
}

// ---------------------------------------------------------------- renderers
/** "12 s ago" from a ns timestamp (the publisher's clock; BigInt or number). */
function fmtAgo(tsNs) {
  if (!tsNs) return "never";
  const s = Math.max(0, (Date.now() - Number(BigInt(tsNs) / 1000000n)) / 1000);
  return s < 120 ? `${s.toFixed(0)} s ago` : s < 7200 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

function renderStats(st) {
  const sub = st.subscriber || {};
  const hasSub = Object.keys(sub).length > 0;
  setNum("events-applied", st.events_applied);
  setNum("events-per-s", st.events_per_s, fmtRate);
  setNum("batches-applied", st.batches_applied);
  setNum("gaps", hasSub ? sub.gaps : null, fmtInt, true);
  setNum("decode-errors", hasSub ? sub.decode_errors : null, fmtInt, true);
  setNum("unrecovered", hasSub ? sub.unrecovered : null, fmtInt, true);
  for (const id of ["gaps", "decode-errors", "unrecovered"]) if (!hasSub) $(id).title = "no event subscription";
  setNum("blocks-total", st.blocks);
  setNum("orphans-pending", st.orphans_pending);
  setNum("duplicate-batches", st.ingest.duplicate_batches);
  setNum("bad-batches", st.ingest.bad_batches, fmtInt, true);
  setNum("advisor-events", st.advisor_events);
  setNum("journal-position", st.journal_position);
  $("uptime").textContent = fmtDuration(st.uptime_s);
  $("uptime").dataset.value = String(st.uptime_s);

  const mv = st.moves;
  setNum("promotions", mv.promotions);
  setNum("demotions", mv.demotions);
  setNum("compactions", mv.compactions);
  setNum("bytes-moved", mv.bytes_moved, fmtBytes);
  setNum("moves-skipped", sumValues(mv.skipped));
  setNum("moves-failed", sumValues(mv.failed), fmtInt, true);
  const kinds = Object.keys(mv.done);
  replaceRows("moves-body", kinds.map((k) =>
    el("tr", { "data-key": k },
      el("td", { "data-field": "kind" }, el("span", { class: "tag", text: k })),
      numCell("done", mv.done[k]), numCell("skipped", mv.skipped[k]), numCell("failed", mv.failed[k]),
      numCell("blocks", mv.blocks_by_kind[k]), numCell("bytes", mv.bytes_by_kind[k], fmtBytes))),
  "no mover (index-only advisor)", 6);
  setNum("policy-rounds", st.ingest.policy_rounds);
  setNum("plans-deferred", st.ingest.plans_deferred);

  const sources = Object.entries(st.sources);
  $("sources-count").textContent = sources.length ? String(sources.length) : "";
  replaceRows("sources-body", sources.map(([name, s]) =>
    el("tr", { "data-key": name },
      el("td", { class: "mono", "data-field": "source", text: name }),
      el("td", { class: "num mono", "data-field": "epoch", "data-value": String(s.epoch), text: fmtHex64(s.epoch),
        title: `epoch ${fmtInt(s.epoch)}` }),
      numCell("last_seq", s.last_seq),
      numCell("batches", s.batches), numCell("events", s.events),
      el("td", { class: "num", "data-field": "last_seen", "data-value": String(s.last_ts_ns ?? 0),
        title: s.last_seen || "never",
        text: s.last_seen ? `${s.last_seen.replace("T", " ").slice(0, 19)} · ${fmtAgo(s.last_ts_ns)}` : "never" }))),
    "no sources yet", 6);
}

function renderLocations(perLocation, roles) {
  const entries = Object.entries(perLocation).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  const max = Math.max(1, ...entries.map(([, n]) => n));
  $("locations-count").textContent = entries.length ? String(entries.length) : "";
  replaceRows("locations-body", entries.map(([loc, n]) => {
    const t = tierOf(loc, roles);
    return el("tr", { "data-key": loc },
      el("td", { class: "mono", "data-field": "location", text: loc }),
      el("td", {}, el("span", { class: `tag t-${t.cls}`, text: t.label })),
      numCell("blocks", n),
      el("td", {}, bar([{ cls: `b-${t.cls}`, pct: pct(n, max), title: `${fmtInt(n)} blocks` }])));
  }), "no blocks indexed", 4);
}

function renderVolumes(vols) {
  $("volumes-count").textContent = vols.length ? String(vols.length) : "";
  replaceRows("volumes-body", vols.map((v) => {
    const cap = v.capacity_bytes, live = v.live_bytes ?? 0, used = v.used_bytes ?? 0;
    const dead = v.dead_bytes ?? Math.max(0, used - live);
    const usedPct = pct(used, cap);
    const t = tierOf(v.id, { [v.id]: v.role });
    return el("tr", { "data-key": v.id },
      el("td", { class: "mono", "data-field": "id", text: v.id }),
      el("td", { "data-field": "role" }, el("span", { class: `tag t-${t.cls}`, text: v.role })),
      el("td", { class: "muted", text: `${v.kind} / ${v.media}` }),
      numCell("capacity_bytes", cap, fmtBytes), numCell("used_bytes", v.used_bytes, fmtBytes),
      numCell("live_bytes", v.live_bytes, fmtBytes), numCell("dead_bytes", v.dead_bytes, fmtBytes),
      numCell("segments", v.segments), numCell("blocks", v.blocks),
      el("td", { "data-field": "fill", "data-value": usedPct.toFixed(2) },
        el("div", { class: "fill" },
          bar([{ cls: "b-live", pct: pct(live, cap), title: `live ${fmtBytes(live)}` },
               { cls: "b-dead", pct: pct(dead, cap), title: `dead ${fmtBytes(dead)}` }]),
          el("span", { class: "fill-pct", text: `${usedPct.toFixed(usedPct < 10 && usedPct > 0 ? 1 : 0)}%` }))));
  }), "no volumes configured (index-only advisor)", 10);
}

function renderPlans(body) {
  const plans = body.plans.slice().reverse(); // newest first
  $("plans-count").textContent = plans.length ? String(plans.length) : "";
  $("plans-summary").replaceChildren(...Object.entries(body.summary).sort().map(([k, n]) =>
    el("span", { class: "chip", "data-key": k }, k.replace("_", " "), el("b", { text: fmtInt(n) }))));
  replaceRows("plans-body", plans.map((p, i) => {
    const what = p.sequence_hash_hex ?? (p.segment_id !== null ? `segment ${p.segment_id}` : "—");
    return el("tr", { "data-key": String(i) },
      el("td", { class: "muted", "data-field": "finished", title: `${p.duration_s.toFixed(3)} s`, text: fmtClock(p.finished_ns) }),
      el("td", { "data-field": "kind" }, el("span", { class: "tag", text: p.kind })),
      el("td", { "data-field": "status" }, el("span", { class: `tag s-${p.status}`, text: p.status })),
      el("td", { class: "mono", "data-field": "route", text: `${p.src_volume} → ${p.dst_volume ?? "∅"}` }),
      el("td", { class: "mono", "data-field": "target", text: what }),
      numCell("bytes_moved", p.bytes_moved, fmtBytes),
      el("td", { class: "reason", "data-field": "reason" }, el("div", { text: p.reason }),
        p.detail ? el("div", { class: "detail", text: p.detail }) : null));
  }), "no plans executed yet", 7);
}

// ---------------------------------------------------------------- polling
/** JSON.parse keeping integers above 2**53 exact as BigInt (epochs, ns timestamps, u64 hashes). */
function parseJSON(text) {
  return JSON.parse(text, (_key, value, ctx) =>
    typeof value === "number" && !Number.isSafeInteger(value) && ctx && typeof ctx.source === "string" &&
    /^-?\d+$/.test(ctx.source) ? BigInt(ctx.source) : value);
}

/** Bearer token for APIs with tokens configured: asked once on a 401, kept for this tab only. */
const TOKEN_KEY = "kvadvisor-api-token";
let tokenAsked = false;

async function getJSON(path, init) {
  const headers = { ...((init && init.headers) || {}) };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const resp = await fetch(path, { cache: "no-store", ...init, headers });
  if (resp.status === 401 && !tokenAsked && typeof window.prompt === "function") {
    tokenAsked = true;
    const given = window.prompt("This advisor API needs a read token (admin for policy runs):");
    if (given) {
      sessionStorage.setItem(TOKEN_KEY, given.trim());
      return getJSON(path, init);
    }
  }
  let body = null;
  try { body = parseJSON(await resp.text()); } catch (_) { /* non-JSON error page */ }
  if (!resp.ok) {
    const why = body && body.error ? `${body.error}: ${body.detail}`
      : `HTTP ${resp.status}${body && typeof body.detail === "string" ? ` ${body.detail}` : ""}`;
    throw new Error(`${path}: ${why}`);
  }
  return body;
}

function setStatus(ok, text) {
  const s = $("status");
  s.className = `pill ${ok ? "pill-ok" : "pill-bad"}`;
  s.textContent = text;
  s.dataset.state = ok ? "ok" : "error";
  const banner = $("error-banner");
  banner.hidden = ok;
  if (!ok) banner.textContent = `Cannot reach the advisor API — showing the last data received. ${text}`;
}

// ---------------------------------------------------------------- one volume's segments
let volumeShown = new URLSearchParams(window.location.search).get("volume");

function renderVolumeSelect(vols) {
  const sel = $("volume-select");
  const ids = vols.map((v) => v.id);
  if (!volumeShown || !ids.includes(volumeShown)) volumeShown = ids[0] || null;
  if (sel.dataset.ids !== ids.join("\u0000")) {
    sel.replaceChildren(...ids.map((id) => el("option", { value: id, text: id })));
    sel.dataset.ids = ids.join("\u0000");
  }
  if (volumeShown) sel.value = volumeShown;
  $("volume-detail").hidden = !ids.length;
}

function renderSegments(body) {
  $("segments-count").textContent = `${fmtInt(body.count)} segment${body.count === 1 ? "" : "s"}`;
  replaceRows("segments-body", body.segments.map((g) =>
    el("tr", { "data-key": String(g.segment_id) },
      numCell("segment_id", g.segment_id), numCell("size_bytes", g.size_bytes, fmtBytes),
      numCell("live_bytes", g.live_bytes, fmtBytes), numCell("dead_bytes", g.dead_bytes, fmtBytes),
      numCell("live_blocks", g.live_blocks),
      el("td", { "data-field": "sealed", "data-value": String(g.sealed), text: g.sealed ? "sealed" : "open" }),
      el("td", {}, bar([{ cls: "b-live", pct: pct(g.live_bytes, g.size_bytes), title: `${fmtBytes(g.live_bytes)} live` },
        { cls: "b-dead", pct: pct(g.dead_bytes, g.size_bytes), title: `${fmtBytes(g.dead_bytes)} dead` }])))),
  "no segments", 7);
}

let polls = 0;
async function poll() {
  try {
    // allSettled: the error shown is the first in request order, not whichever lost a race
    const settled = await Promise.allSettled([
      getJSON("v1/stats"), getJSON("v1/volumes"), getJSON(`v1/plans?limit=${PLAN_LIMIT}`)]);
    const failed = settled.find((r) => r.status === "rejected");
    if (failed) throw failed.reason;
    const [stats, vols, plans] = settled.map((r) => r.value);
    const roles = Object.fromEntries(vols.volumes.map((v) => [v.id, v.role]));
    renderStats(stats);
    renderLocations(stats.blocks_per_location, roles);
    renderVolumes(vols.volumes);
    renderVolumeSelect(vols.volumes);
    if (volumeShown) renderSegments(await getJSON(`v1/volumes/${encodeURIComponent(volumeShown)}/segments?limit=200`));
    renderPlans(plans);
    if (typeof renderCharts === "function") renderCharts(stats);
    polls += 1;
    document.body.dataset.polls = String(polls);
    const now = new Date();
    $("updated-at").textContent = now.toLocaleTimeString("en-GB", { hour12: false });
    setStatus(true, "live");
  } catch (err) {
    setStatus(false, String(err.message || err));
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// ---------------------------------------------------------------- lookup
function parseHashes(text) { return text.split(/[\s,;]+/).map((t) => t.trim()).filter(Boolean); }

async function lookup(text) {
  const hashes = parseHashes(text);
  const errBox = $("lookup-error"), result = $("lookup-result"), button = $("lookup-button");
  errBox.hidden = true;
  if (!hashes.length) { errBox.textContent = "Paste at least one sequence hash."; errBox.hidden = false; result.hidden = true; return; }
  button.disabled = true;
  try {
    // hashes go as strings: u64 values above 2**53 are not exact as JS numbers
    const body = await getJSON("v1/lookup", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ sequence_hashes: hashes }),
    });
    setNum("lookup-requested", body.requested);
    setNum("lookup-longest", body.longest);
    setNum("lookup-any", body.any_location);
    const entries = Object.entries(body.prefix_blocks).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    replaceRows("lookup-body", entries.map(([loc, n]) =>
      el("tr", { "data-key": loc },
        el("td", { class: "mono", "data-field": "location", text: loc }),
        numCell("prefix_blocks", n),
        el("td", {}, bar([{ cls: "b-live", pct: pct(n, body.requested), title: `${n} of ${body.requested}` }])))),
    "no leading block is cached anywhere", 3);
    result.hidden = false;
  } catch (err) {
    errBox.textContent = String(err.message || err);
    errBox.hidden = false;
    result.hidden = true;
  } finally {
    button.disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("volume-select").addEventListener("change", (ev) => { volumeShown = ev.target.value; });
  $("lookup-form").addEventListener("submit", (ev) => { ev.preventDefault(); lookup($("lookup-input").value); });
  // ?lookup=h0,h1,... pre-fills the box and runs it (shareable links)
  const pre = new URLSearchParams(window.location.search).get("lookup");
  if (pre) { $("lookup-input").value = parseHashes(pre).join("\n"); lookup(pre); }
  poll();
});
