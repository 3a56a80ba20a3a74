// The live dashboard: polls /api/state once a second and redraws. Plain DOM and SVG, no library
// (the machines that run jobs often have no internet, and a vendored chart library is a lot of
// code to keep for two line plots).
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const LOST_COLORS = {detection: "#d62728", recovery: "#ff7f0e", catch_up: "#1f77b4", redone: "#9467bd",
                     isolated: "#7f7f7f", other: "#c7c7c7"};

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(x, digits) {
  return x === null || x === undefined ? "" : Number(x).toFixed(digits);
}

function renderReplicas(replicas) {
  const body = document.getElementById("replicas");
  body.replaceChildren();
  for (const r of replicas) {
    const tr = el("tr", {id: "replica-" + r.replica, "data-state": r.state});
    tr.append(el("td", {}, String(r.replica)));
    const td = el("td");
    td.append(el("span", {class: "state state-" + r.state}, r.state));
    tr.append(td);
    tr.append(el("td", {}, r.step === null ? "" : String(r.step)));
    tr.append(el("td", {}, fmt(r.step_s, 3)));
    tr.append(el("td", {}, r.node || ""));
    tr.append(el("td", {}, String(r.restarts)));
    tr.append(el("td", {class: "history"}, r.history.join(" \u2192 ")));
    tr.append(el("td", {}, r.last_event || ""));
    body.append(tr);
  }
}

function renderTimeline(entries) {
  const box = document.getElementById("timeline");
  box.replaceChildren();
  for (const e of entries.slice().reverse()) {
    const t = new Date(e.t * 1000).toLocaleTimeString();
    box.append(el("div", {class: "tl-" + e.kind}, t + "  " + e.text));
  }
}

// One line per replica: series[replica] = [[step, loss, step_s], ...]; column picks the value.
function plot(svgId, series, column) {
  const svg = document.getElementById(svgId);
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), L = 50, B = 22, T = 8, R = 10;
  const lines = Object.entries(series).map(([r, pts]) => [r, pts.filter(p => p[column] !== null)]);
  const all = lines.flatMap(([, pts]) => pts);
  svg.replaceChildren();
  if (!all.length) return;
  const xs = all.map(p => p[0]), ys = all.map(p => p[column]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const ns = "http://www.w3.org/2000/svg";
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
  };
  add("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#888"});
  add("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#888"});
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    add("text", {x: L - 4, y: sy(y) + 4, "text-anchor": "end", "font-size": 10}, y.toPrecision(3));
  }
  add("text", {x: L, y: H - 6, "font-size": 10}, "step " + x0);
  add("text", {x: W - R, y: H - 6, "text-anchor": "end", "font-size": 10}, "step " + x1);
  lines.forEach(([r, pts], i) => {
    if (!pts.length) return;
    const d = pts.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[column]).toFixed(1)).join("");
    const color = COLORS[i % COLORS.length];
    add("path", {d: d, fill: "none", stroke: color, "stroke-width": 1.3});
    add("text", {x: W - R - 4, y: T + 12 + 12 * i, "text-anchor": "end", "font-size": 11, fill: color}, "r" + r);
  });
}

function renderGoodput(g) {
  const bar = document.getElementById("goodbar"), table = document.getElementById("goodtable");
  bar.replaceChildren();
  table.replaceChildren();
  if (!g || !g.capacity_s) return;
  const parts = [["productive", g.productive_s, "#2ca02c"]].concat(
    Object.entries(g.lost_s).map(([k, v]) => [k, v, LOST_COLORS[k] || "#999"]));
  for (const [name, seconds, color] of parts) {
    const share = seconds / g.capacity_s;
    if (share > 0) bar.append(el("div", {style: `width:${(100 * share).toFixed(2)}%;background:${color}`,
                                         title: `${name}: ${(100 * share).toFixed(1)}%`}));
    const tr = el("tr");
    tr.append(el("td", {}, name));
    tr.append(el("td", {}, seconds.toFixed(1) + " replica-s"));
    tr.append(el("td", {}, (100 * share).toFixed(1) + "%"));
    table.append(tr);
  }
}

async function refresh() {
  const err = document.getElementById("error");
  try {
    const resp = await fetch("api/state", {headers: {Authorization: "Bearer " + TOKEN}, cache: "no-store"});
    if (!resp.ok) throw new Error(resp.status + " " + (await resp.text()));
    const s = await resp.json();
    document.getElementById("title").textContent = s.title;
    document.getElementById("epoch").textContent = s.job.epoch ?? "-";
    document.getElementById("step").textContent = s.job.step ?? "-";
    document.getElementById("healthy").textContent = s.job.healthy + " / " + s.job.total;
    document.getElementById("goodput").textContent = s.goodput ? (100 * s.goodput.goodput).toFixed(1) + "%" : "-";
    err.textContent = s.job.failed
      ? "JOB FAILED (exit " + s.job.failed.exit_code + "): " + s.job.failed.reason
      : (s.job.coordinator ? "" : "(no coordinator answer: events only)");
    renderReplicas(s.replicas);
    renderTimeline(s.timeline);
    plot("loss", s.series, 1);
    plot("steptime", s.series, 2);
    renderGoodput(s.goodput);
    document.body.setAttribute("data-updated", String(s.t));
  } catch (e) {
    err.textContent = "cannot reach the job: " + e.message;
  }
}

refresh();
setInterval(refresh, 1000);
