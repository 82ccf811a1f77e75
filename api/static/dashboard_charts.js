// History charts of the dashboard: hit rate per tier, occupancy per location, event rate
// and moves, drawn with uPlot (vendored in vendor/, MIT licence, no CDN). Each poll of
// /v1/stats adds one point per series; the last HISTORY_POINTS points are kept. Beside each
// chart a table lists every series' latest value (data-value = the raw number, so tests and
// scripts read the same numbers as /v1/stats).
"use strict";

const HISTORY_POINTS = 900; // 30 min at one poll every 2 s

const CHARTS = {
  hit: { title: "lookup hit rate per tier, last minute", unit: "%", scale: 100 },
  occupancy: { title: "blocks per location", unit: "blocks", scale: 1 },
  events: { title: "events applied per second", unit: "events/s", scale: 1 },
  moves: { title: "moves (cumulative)", unit: "moves", scale: 1 },
};
const PALETTE = ["#2563eb", "#16a34a", "#d97706", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];

const history = { t: [], series: { hit: {}, occupancy: {}, events: {}, moves: {} } };
const plots = {};

/** Series values of one /v1/stats answer, per chart: {chart: {name: number}}. */
function chartPoints(st) {
  const hit = {};
  for (const [kind, windows] of Object.entries(st.hit_rates || {})) {
    const tiers = (windows["1m"] || {}).tiers || {};
    for (const [tier, v] of Object.entries(tiers)) hit[kind === "lookup" ? tier : `${kind} ${tier}`] = v.hit_rate;
  }
  return {
    hit,
    occupancy: { ...st.blocks_per_location },
    events: { "events/s": st.events_per_s },
    moves: { promotions: st.moves.promotions, demotions: st.moves.demotions, compactions: st.moves.compactions },
  };
}

function pushHistory(st) {
  const pts = chartPoints(st);
  const n = history.t.length;
  history.t.push(Date.now() / 1000);
  for (const [chart, values] of Object.entries(pts)) {
    const series = history.series[chart];
    for (const name of Object.keys(values)) if (!(name in series)) series[name] = new Array(n).fill(null);
    for (const [name, arr] of Object.entries(series)) arr.push(name in values ? Number(values[name]) : null);
  }
  if (history.t.length > HISTORY_POINTS) {
    history.t.shift();
    for (const series of Object.values(history.series)) for (const arr of Object.values(series)) arr.shift();
  }
  return pts;
}

function drawChart(chart) {
  const spec = CHARTS[chart];
  const names = Object.keys(history.series[chart]).sort();
  const data = [history.t, ...names.map((n) => history.series[chart][n].map((v) => (v == null ? null : v * spec.scale)))];
  const box = document.getElementById(`chart-${chart}`);
  const key = names.join("\u0000");
  let p = plots[chart];
  if (!p || p.key !== key) {
    if (p) p.plot.destroy();
    const opts = {
      width: Math.max(320, box.clientWidth || 560), height: 200,
      series: [{}, ...names.map((n, i) => ({ label: n, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true }))],
      axes: [{}, { label: spec.unit, size: 60 }],
      legend: { show: false },
    };
    plots[chart] = p = { key, plot: new uPlot(opts, data, box) };
  } else {
    p.plot.setData(data);
  }
}

function renderLatest(chart, values) {
  const spec = CHARTS[chart];
  const body = document.getElementById(`chart-${chart}-latest`);
  const names = Object.keys(values).sort();
  body.replaceChildren(...names.map((n, i) => {
    const tr = document.createElement("tr");
    tr.dataset.key = n;
    const sw = document.createElement("td");
    sw.innerHTML = `<i class="sw" style="background:${PALETTE[Object.keys(history.series[chart]).sort().indexOf(n) % PALETTE.length]}"></i>`;
    const name = document.createElement("td");
    name.className = "mono";
    name.dataset.field = "series";
    name.textContent = n;
    const val = document.createElement("td");
    val.className = "num";
    val.dataset.field = "value";
    val.dataset.value = String(values[n]);
    const shown = Number(values[n]) * spec.scale;
    val.textContent = spec.unit === "%" ? `${shown.toFixed(1)} %` : Math.round(shown).toLocaleString("en-US");
    tr.append(sw, name, val);
    return tr;
  }));
  if (!names.length) body.innerHTML = '<tr class="empty"><td colspan="3">no data yet</td></tr>';
}

/** Called by dashboard.js after each successful poll of /v1/stats. */
function renderCharts(st) {
  const pts = pushHistory(st);
  for (const chart of Object.keys(CHARTS)) {
    renderLatest(chart, pts[chart]);
    if (typeof uPlot === "function") drawChart(chart);
  }
  document.body.dataset.chartPoints = String(history.t.length);
}
