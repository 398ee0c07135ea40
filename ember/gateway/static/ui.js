// ember's status page: polls /ui/data every second and draws the timeline on <canvas>, with no libraries,
// so the page works offline and ships as three files inside the package.
"use strict";

const POLL_MS = 1000;
const RUNG_COLORS = {hot: "#ff6a3d", paused: "#9b8cff", "sleep-1": "#c77dff", "sleep-2": "#7b2cbf",
                     template: "#f3c03b", zygote: "#3fa7d6", restore: "#2ec4b6", fetch: "#59cd90",
                     queued: "#8a8aa0"};
const STATE_COLORS = {starting: "#f3c03b", idle: "#59cd90", busy: "#ff6a3d", paused: "#9b8cff",
                      asleep: "#7b2cbf", draining: "#8a8aa0"};
const PCT_COLORS = {p50: "#59cd90", p95: "#f3c03b", p99: "#ff6a3d"};
const RECENT_S = 60;   // the rung strip: one cell a second, this many
const cards = new Map();
// Metrics under model="": requests that named no deployed model, and metrics that carry no model label.
const UNLABELLED = {key: "", name: "(no model)", version: "", state: "unlabelled metrics", instances: [], template: null};

// ----- numbers -------------------------------------------------------------------------------

function mib(bytes) {
  return bytes ? (bytes / 2 ** 20).toFixed(bytes < 10 * 2 ** 20 ? 1 : 0) + " MiB" : "–";
}

function ms(seconds) {
  return seconds < 0.01 ? (seconds * 1000).toFixed(2) + " ms" : seconds < 1 ? (seconds * 1000).toFixed(0) + " ms"
    : seconds.toFixed(2) + " s";
}

function sumValues(obj) {
  return Object.values(obj || {}).reduce((a, b) => a + b, 0);
}

// ----- canvas plots --------------------------------------------------------------------------

// A canvas sized to its box in device pixels, with the plot area inside its margins.
function frame(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "10px system-ui, sans-serif";
  return {ctx, left: 44, right: w - 6, top: 6, bottom: h - 16, w, h};
}

// x: seconds before now (negative) to pixels; the span grows with the data up to the window.
function xScale(f, span) {
  return t => f.left + (f.right - f.left) * (1 + t / span);
}

function axes(f, span, yTicks) {
  const {ctx} = f;
  ctx.strokeStyle = "#2e2e3c";
  ctx.fillStyle = "#8a8aa0";
  ctx.lineWidth = 1;
  for (const [y, label] of yTicks) {
    ctx.beginPath(); ctx.moveTo(f.left, y); ctx.lineTo(f.right, y); ctx.stroke();
    ctx.fillText(label, 2, y + 3);
  }
  const step = span > 300 ? 120 : span > 120 ? 60 : span > 60 ? 30 : 10;
  const x = xScale(f, span);
  for (let t = 0; t <= span; t += step) {
    ctx.fillText(t ? `-${t >= 60 ? t / 60 + "m" : t + "s"}` : "now", x(-t) - (t ? 10 : 18), f.h - 3);
  }
}

// Lines with gaps where a value is null; y on a log scale from decades around the data.
function drawLogLines(canvas, span, series) {
  const f = frame(canvas);
  const values = series.flatMap(s => s.points.map(p => p[1]).filter(v => v !== null && v > 0));
  const lo = Math.floor(Math.log10(Math.min(...values, 1e-3)));
  const hi = Math.max(lo + 1, Math.ceil(Math.log10(Math.max(...values, 1e-2))));
  const y = v => f.bottom - (f.bottom - f.top) * (Math.log10(v) - lo) / (hi - lo);
  const ticks = [];
  for (let d = lo; d <= hi; d++) ticks.push([y(10 ** d), d < 0 ? `${(10 ** (d + 3)).toFixed(Math.max(0, -(d + 3)))} ms` : `${10 ** d} s`]);
  axes(f, span, ticks);
  const x = xScale(f, span);
  for (const s of series) {
    strokePath(f.ctx, s.color, s.points.map(([t, v]) => (v === null || v <= 0 ? null : [x(t), y(v)])));
  }
}

function strokePath(ctx, color, points) {
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let pen = false;
  for (const p of points) {
    if (p === null) { pen = false; continue; }
    if (pen) ctx.lineTo(p[0], p[1]); else ctx.moveTo(p[0], p[1]);
    ctx.fillRect(p[0] - 1, p[1] - 1, 2, 2);   // a lone point (one second of requests) still shows
    pen = true;
  }
  ctx.stroke();
}

// Stacked columns, one a sample: layers = [{color, values}] with values aligned to times.
function drawStacked(canvas, span, times, layers, unit) {
  const f = frame(canvas);
  const totals = times.map((_, i) => layers.reduce((a, l) => a + (l.values[i] || 0), 0));
  const top = Math.max(1, ...totals);
  const y = v => f.bottom - (f.bottom - f.top) * v / top;
  axes(f, span, [[y(0), "0"], [y(top), top.toFixed(top < 10 && top % 1 ? 1 : 0) + unit]]);
  const x = xScale(f, span);
  const width = Math.max(1, (f.right - f.left) / span - 0.5);
  times.forEach((t, i) => {
    let base = 0;
    for (const l of layers) {
      const v = l.values[i] || 0;
      if (!v) continue;
      f.ctx.fillStyle = l.color;
      f.ctx.fillRect(x(t) - width, y(base + v), width, y(base) - y(base + v));
      base += v;
    }
  });
}

function legend(parent, colors) {
  const box = document.createElement("span");
  box.className = "legend";
  for (const [name, color] of Object.entries(colors)) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = color;
    item.append(swatch, name);
    box.appendChild(item);
  }
  parent.appendChild(box);
}

// ----- the page ------------------------------------------------------------------------------

function card(model) {
  if (!cards.has(model.key)) {
    const node = document.getElementById("model-card").content.firstElementChild.cloneNode(true);
    node.dataset.model = model.key;
    node.querySelector(".name").textContent = model.name;
    node.querySelector(".version").textContent = model.version ? "v" + model.version : "";
    legend(node.querySelector(".rungs-row"), RUNG_COLORS);
    const captions = node.querySelectorAll("figcaption");
    legend(captions[0], PCT_COLORS);
    legend(captions[1], STATE_COLORS);
    legend(captions[2], Object.assign({requests: "#3a3a4c"}, RUNG_COLORS));
    const strip = node.querySelector(".rungs");
    for (let i = 0; i < RECENT_S; i++) strip.appendChild(document.createElement("span"));
    document.getElementById("models").appendChild(node);
    cards.set(model.key, node);
  }
  return cards.get(model.key);
}

function renderModel(model, samples, now, span) {
  const node = card(model);
  const badge = node.querySelector(".state");
  badge.textContent = model.state;
  badge.className = "state badge " + (model.state === "ready" ? "ready" : /unavailable|fail/i.test(model.state) ? "bad" : "");
  const mine = samples.map(s => [s.t - now, s.models[model.key] || null]);
  renderSummary(node, model, mine);
  renderRungs(node, mine);
  const latency = node.querySelector("canvas.latency");
  const series = ["p50", "p95", "p99"].map(p => ({color: PCT_COLORS[p], points: mine.map(([t, m]) => [t, m ? m[p] : null])}));
  drawLogLines(latency, span, series);
  latency.dataset.points = String(mine.filter(([, m]) => m && m.p50 !== null).length);
  renderCounts(node, mine, span);
}

function renderSummary(node, model, mine) {
  const states = {};
  for (const i of model.instances) states[i.state] = (states[i.state] || 0) + 1;
  const parts = Object.entries(states).map(([s, n]) => `${n} ${s}`);
  const last = mine.length ? mine[mine.length - 1][1] : null;
  const tmpl = model.template && model.template.pss_bytes ? `template ${mib(model.template.pss_bytes)}` : "";
  const inflight = last && last.in_flight ? `${last.in_flight} in flight` : "";
  node.querySelector(".summary").textContent =
    [parts.length ? parts.join(", ") : "no instances", inflight, tmpl].filter(Boolean).join(" · ");
}

// The last RECENT_S seconds, one cell each: the rung most of that second's requests came from.
function renderRungs(node, mine) {
  const cells = node.querySelectorAll(".rungs span");
  const recent = mine.slice(-RECENT_S);
  cells.forEach((cell, i) => {
    const entry = recent[i - (RECENT_S - recent.length)];
    const rungs = entry && entry[1] ? entry[1].rungs : {};
    const top = Object.entries(rungs).sort((a, b) => b[1] - a[1])[0];
    cell.style.background = top ? RUNG_COLORS[top[0]] || "#ccc" : "";
    cell.title = top ? Object.entries(rungs).map(([r, n]) => `${r} ×${n}`).join(", ") : "";
    cell.dataset.rung = top ? top[0] : "";
  });
}

function renderCounts(node, mine, span) {
  const times = mine.map(([t]) => t);
  const states = Object.keys(STATE_COLORS);
  const instances = node.querySelector("canvas.instances");
  drawStacked(instances, span, times,
    states.map(s => ({color: STATE_COLORS[s], values: mine.map(([, m]) => (m && m.instances ? m.instances[s] || 0 : 0))})), "");
  instances.dataset.points = String(times.length);
  const cold = node.querySelector("canvas.cold");
  const rungs = Object.keys(RUNG_COLORS);
  const layers = [{color: "#3a3a4c", values: mine.map(([, m]) => (m ? m.requests - sumValues(m.cold_starts) : 0))}]
    .concat(rungs.map(r => ({color: RUNG_COLORS[r], values: mine.map(([, m]) => (m ? m.cold_starts[r] || 0 : 0))})));
  drawStacked(cold, span, times, layers, "/s");
  cold.dataset.points = String(mine.filter(([, m]) => m && sumValues(m.cold_starts) > 0).length);
}

function renderNode(data, span) {
  document.getElementById("node-memory").textContent = mib(data.node.pss_bytes);
  const plot = document.getElementById("node-memory-plot");
  const times = data.samples.map(s => s.t - data.now);
  drawStacked(plot, span, times, [{color: "#3fa7d6", values: data.samples.map(s => s.node_pss_bytes / 2 ** 20)}], " MiB");
  plot.dataset.points = String(times.length);
  fillTable("slices", data.node.slices.map(s => [s.slice, s.model, s.instance, s.state]), "no slices in use");
}

function renderJobs(data, span) {
  const last = data.samples.length ? data.samples[data.samples.length - 1].models : {};
  const rows = Object.entries(last).filter(([, m]) => m.jobs_queued || m.jobs_oldest_age_s)
    .map(([key, m]) => [key || "(unlabelled)", m.jobs_queued || 0, m.jobs_oldest_age_s ? ms(m.jobs_oldest_age_s) : "–"]);
  document.getElementById("jobs-queued").textContent = String(rows.reduce((a, r) => a + r[1], 0));
  fillTable("jobs-table", rows, "no jobs queued");
  const plot = document.getElementById("jobs-plot");
  const times = data.samples.map(s => s.t - data.now);
  const queued = data.samples.map(s => Object.values(s.models).reduce((a, m) => a + (m.jobs_queued || 0), 0));
  drawStacked(plot, span, times, [{color: "#f3c03b", values: queued}], "");
  plot.dataset.points = String(times.length);
}

function fillTable(id, rows, empty) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...(rows.length ? rows : [[empty]]).map(row => {
    const tr = document.createElement("tr");
    for (const cell of row) {
      const td = document.createElement("td");
      td.textContent = String(cell);
      if (row.length === 1) { td.colSpan = 4; td.className = "muted"; }
      tr.appendChild(td);
    }
    return tr;
  }));
}

function render(data) {
  const oldest = data.samples.length ? data.now - data.samples[0].t : 0;
  const step = oldest > 300 ? 60 : 30;   // the x axis grows with the data, in steps, so it does not creep
  const span = Math.min(data.window_s, Math.max(60, Math.ceil(oldest / step) * step));
  renderNode(data, span);
  renderJobs(data, span);
  const models = data.models.concat(data.samples.some(s => s.models[""]) ? [UNLABELLED] : []);
  for (const model of models) renderModel(model, data.samples, data.now, span);
  for (const [key, node] of cards) if (!models.some(m => m.key === key)) { node.remove(); cards.delete(key); }
  const updated = document.getElementById("updated");
  updated.textContent = `updated ${new Date().toLocaleTimeString()} · ${data.samples.length} samples`;
  document.body.dataset.samples = String(data.samples.length);
}

async function poll() {
  try {
    const r = await fetch("/ui/data", {cache: "no-store"});
    if (!r.ok) throw new Error(`/ui/data: ${r.status}`);
    render(await r.json());
  } catch (err) {
    document.getElementById("updated").textContent = "disconnected: " + err.message;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
