// Helpers shared by the widgets: the API (with the key from ?key=), DOM, canvas heatmaps, SVG.
const KEY = new URLSearchParams(location.search).get("key");
// the API beside this file (/inspect/static/ -> /inspect/api/), under whatever prefix a proxy serves it (--root-path)
const API = new URL("../api/", import.meta.url).pathname;

export async function api(path, body) {
  const opts = { headers: {} };
  if (KEY) opts.headers["Authorization"] = "Bearer " + KEY;
  if (body !== undefined) {
    opts.method = "POST";
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const res = await fetch(API + path, opts);
  const data = JSON.parse(await readBody(res, path));
  if (!res.ok) throw new Error(data.error ? data.error.message : res.statusText);
  return data;
}

export const PROGRESS_BYTES = 1 << 20;  // answers larger than this show their bytes as they arrive

// the body's text; an answer over PROGRESS_BYTES (its Content-Length, or its size so far) shows
// its progress in #progress, byte by byte, while it arrives
async function readBody(res, what) {
  const total = Number(res.headers.get("Content-Length")) || 0;
  if (!res.body || (total && total <= PROGRESS_BYTES)) return res.text();
  const reader = res.body.getReader(), parts = [], bar = document.getElementById("progress");
  let got = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    parts.push(value);
    got += value.length;
    if (bar && got > PROGRESS_BYTES) {
      bar.hidden = false;
      bar.dataset.bytes = String(got);
      bar.textContent = `${what}: ${(got / 2 ** 20).toFixed(1)}${total ? ` of ${(total / 2 ** 20).toFixed(1)}` : ""} MiB`;
    }
  }
  if (bar && got > PROGRESS_BYTES) setTimeout(() => { bar.hidden = true; }, 1500);
  const all = new Uint8Array(got);
  let at = 0;
  for (const p of parts) { all.set(p, at); at += p.length; }
  return new TextDecoder().decode(all);
}

export function liveUrl() { return API + "live" + (KEY ? "?key=" + encodeURIComponent(KEY) : ""); }

export const $ = (id) => document.getElementById(id);

// where a view's numbers come from: measured on this run, derived from measured values or the
// model's constants, or illustrative (each view carries its badge: `data-provenance`)
const PROVENANCE_NOTE = { measured: "read from this run of the model", derived: "computed from the model's own constants and this run's numbers",
  illustrative: "an illustration, not this run's numbers" };

export function badge(kind) {
  return h("span", { class: `prov prov-${kind}`, "data-provenance": kind, title: PROVENANCE_NOTE[kind] }, kind);
}

// the widgets' provenance (the journey's stages carry their own)
export const WIDGET_PROVENANCE = { "w-tokenizer": ["measured"], "w-embeddings": ["measured"], "w-positions": ["derived"],
  "w-architecture": ["measured"], "w-attention": ["measured"], "w-lens": ["measured"], "w-timeline": ["measured"],
  "w-sampling": ["measured"], "w-beam": ["measured"], "w-kv": ["measured", "derived"], "w-batching": ["measured"],
  "w-spec": ["measured"], "w-quant": ["measured"], "w-requests": ["measured"] };

// an element that reacts to a click is reachable and operable from the keyboard as well
function operable(e, onclick) {
  if (["BUTTON", "INPUT", "SELECT", "A"].includes(e.tagName)) return;
  e.setAttribute("tabindex", "0");
  e.setAttribute("role", "button");
  e.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); onclick(ev); } });
}

export function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) { e.addEventListener(k.slice(2), v); if (k === "onclick") operable(e, v); }
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

export function ready(id) { $(id).dataset.ready = String(Number($(id).dataset.ready || 0) + 1); }

export function showError(where, err) {
  const box = $(where);
  const msg = h("div", { class: "stat", style: "color:var(--bad)" }, String(err.message || err));
  box.querySelectorAll(".err").forEach((e) => e.remove());
  msg.classList.add("err");
  box.append(msg);
}

export function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i];
}

export function table(head, rows) {
  return h("table", {}, h("tr", {}, head.map((c) => h("th", {}, c))),
    rows.map((r) => h("tr", {}, r.map((c) => (c instanceof Node ? h("td", {}, c) : h("td", { class: typeof c === "number" ? "num" : "" }, c))))));
}

// value in [lo, hi] -> color (dark blue .. yellow); signed maps blue/red around 0
export function color(v, lo = 0, hi = 1, signed = false) {
  if (signed) {
    const t = Math.max(-1, Math.min(1, v / Math.max(Math.abs(lo), Math.abs(hi))));
    return t >= 0 ? `rgb(${40 + 200 * t},${40 + 60 * t},${50})` : `rgb(${50},${40 + 80 * -t},${50 + 200 * -t})`;
  }
  const t = Math.max(0, Math.min(1, (v - lo) / (hi - lo || 1)));
  return `rgb(${Math.round(20 + 235 * t)},${Math.round(30 + 200 * Math.sqrt(t))},${Math.round(80 + 40 * (1 - t))})`;
}

// rows x cols matrix -> canvas; get(r, c) gives the value
export function heatmap(canvas, rows, cols, get, opts = {}) {
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#0b0f13";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const pad = opts.pad || 0;
  const w = (canvas.width - pad) / cols, hh = (canvas.height - pad) / rows;
  for (let r = 0; r < rows; r++)
    for (let c = 0; c < cols; c++) {
      ctx.fillStyle = color(get(r, c), opts.lo ?? 0, opts.hi ?? 1, opts.signed);
      ctx.fillRect(pad + c * w, pad + r * hh, Math.ceil(w), Math.ceil(hh));
    }
  return { w, h: hh, pad };
}

export const SVG = "http://www.w3.org/2000/svg";
export function s(tag, attrs = {}, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k.startsWith("on")) { e.addEventListener(k.slice(2), v); if (k === "onclick") operable(e, v); } else e.setAttribute(k, v);
  }
  if (text !== undefined) e.textContent = text;
  return e;
}

// a line chart of points [{x, y}] in an svg; logx for log-scaled x
export function lineChart(svg, points, opts = {}) {
  svg.replaceChildren();
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), m = 34;
  const fx = opts.logx ? (x) => Math.log(Math.max(x, 1)) : (x) => x;
  const xs = points.map((p) => fx(p.x)), ys = points.map((p) => p.y);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(...ys);
  const X = (x) => m + ((fx(x) - x0) / (x1 - x0 || 1)) * (W - m - 8), Y = (y) => H - 18 - ((y - y0) / (y1 - y0 || 1)) * (H - 28);
  svg.append(s("line", { x1: m, y1: H - 18, x2: W - 8, y2: H - 18, stroke: "#556" }));
  svg.append(s("line", { x1: m, y1: 6, x2: m, y2: H - 18, stroke: "#556" }));
  svg.append(s("polyline", { points: points.map((p) => `${X(p.x)},${Y(p.y)}`).join(" "), fill: "none", stroke: opts.color || "#5fb3f9", "stroke-width": 2 }));
  svg.append(s("text", { x: m + 2, y: 14 }, opts.ylabel || ""));
  svg.append(s("text", { x: (m + W) / 2, y: H - 4, "text-anchor": "middle" }, opts.xlabel || ""));
  svg.append(s("text", { x: 2, y: H - 18 }, String(opts.fmtY ? opts.fmtY(y0) : y0.toFixed(2))));
  svg.append(s("text", { x: 2, y: 16 }, String(opts.fmtY ? opts.fmtY(y1) : y1.toFixed(2))));
  svg.append(s("text", { x: m, y: H - 4 }, String(points[0].x)));
  svg.append(s("text", { x: W - 8, y: H - 4, "text-anchor": "end" }, String(points[points.length - 1].x)));
}

export function debounce(fn, ms) {
  let t;
  return (...a) => { clearTimeout(t); t = setTimeout(() => fn(...a), ms); };
}
