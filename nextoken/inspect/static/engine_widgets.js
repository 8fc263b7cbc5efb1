// Widgets 10-14: KV cache, continuous batching, speculative decoding (live), quantization, requests.
import { $, api, h, ready, showError, lineChart, table, fmtBytes, s } from "./lib.js";

export async function kvStatic() {
  try {
    const r = await api("kv");
    const f = r.formula;
    $("kv-formula").textContent = `bytes per token = 2 (K and V) × ${f.layers} layers × ${f.kv_heads} KV heads × ${f.head_dim} head dim × ${f.bytes_per_value} bytes (${f.dtype}) = ${r.bytes_per_token} B` +
      ` (the cache's tensors: ${r.measured_bytes_per_token} B/token; without GQA it would be ${r.per_query_heads_without_gqa} B)` +
      (r.sliding.layers ? ` + ${r.sliding.bytes_per_token} B/token for the ${r.sliding.layers} sliding layers, up to their window of ${r.sliding.window}` : "") +
      ` · cache: ${r.num_blocks} blocks × ${r.block_size} tokens = ${fmtBytes(r.cache_bytes)}`;
    lineChart($("kv-curve"), r.curve.map((c) => ({ x: c.tokens, y: c.bytes / 2 ** 20 })), { logx: true, xlabel: "context length (tokens, log)", ylabel: "MiB per sequence", fmtY: (y) => y.toFixed(1) });
    ready("w-kv");
  } catch (e) { showError("w-kv", e); }
}

// the KV cache on and off: time per generated token against the context length, two series
export async function kvContrast() {
  try {
    $("kv-contrast-go").disabled = true;
    const r = await api("kv/contrast", { tokens: 24 });
    const svg = $("kv-contrast");
    svg.replaceChildren();
    const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), m = 44;
    const all = [...r.with_cache_ms, ...r.without_cache_ms], y1 = Math.max(...all) * 1.1;
    const x0 = r.positions[0], x1 = r.positions[r.positions.length - 1];
    const X = (x) => m + ((x - x0) / (x1 - x0 || 1)) * (W - m - 12), Y = (y) => H - 24 - (y / y1) * (H - 44);
    svg.append(s("line", { x1: m, y1: H - 24, x2: W - 12, y2: H - 24, stroke: "#556" }), s("line", { x1: m, y1: 20, x2: m, y2: H - 24, stroke: "#556" }));
    const series = [["with the cache", r.with_cache_ms, "#5fb3f9", r.slope_with], ["recomputing the prefix", r.without_cache_ms, "#f2994a", r.slope_without]];
    series.forEach(([name, ys, col, slope], i) => {
      svg.append(s("polyline", { points: ys.map((y, k) => `${X(r.positions[k])},${Y(y)}`).join(" "), fill: "none", stroke: col, "stroke-width": 2 }));
      svg.append(s("text", { x: W - 12, y: 14 + 14 * i, "text-anchor": "end", fill: col, style: `fill:${col}` }, `${name}: +${slope.toFixed(2)} ms per token of context`));
    });
    svg.append(s("text", { x: 4, y: 14 }, `${y1.toFixed(0)} ms`));
    svg.append(s("text", { x: 4, y: H - 26 }, "0"));
    svg.append(s("text", { x: m, y: H - 6 }, String(x0)));
    svg.append(s("text", { x: W - 12, y: H - 6, "text-anchor": "end" }, String(x1)));
    svg.append(s("text", { x: (m + W) / 2, y: H - 6, "text-anchor": "middle" }, "context length (tokens)"));
    const mean = (a) => a.reduce((x, y) => x + y, 0) / a.length;
    $("kv-contrast-meta").textContent = `${r.positions.length} steps after a ${r.prompt_tokens}-token prompt, measured now on the loaded model: ` +
      `${mean(r.with_cache_ms).toFixed(1)} ms per token with the cache, ${mean(r.without_cache_ms).toFixed(1)} ms recomputing the prefix` +
      (r.same_tokens ? " · the same tokens both ways" : " · the tokens differ (bf16 rounding between the two paths)");
  } catch (e) { showError("w-kv", e); }
  $("kv-contrast-go").disabled = false;
}

const POOL_COLORS = { ".": "#26313c", c: "#3d6b4a" };
const MIN_CELL = 4, MAX_ROWS = 40;  // px, cells: a larger pool shows several blocks a cell
const RANK = (c) => (c === "." ? 0 : c === "c" ? 1 : c === "1" ? 2 : 3);
function drawPool(cv, blocks) {  // one cell per block (or per run of blocks: the busiest's state): free, cached and free, used by one, shared
  const ctx = cv.getContext("2d"), n = blocks.length, cols = Math.floor(cv.width / MIN_CELL);
  const per = Math.max(1, Math.ceil(n / (cols * MAX_ROWS))), cells = Math.ceil(n / per);
  const across = Math.min(cols, Math.ceil(Math.sqrt(cells * (cv.width / 120)))), size = Math.floor(cv.width / across);
  cv.height = Math.max(40, Math.ceil(cells / across) * size);
  ctx.clearRect(0, 0, cv.width, cv.height);
  for (let i = 0; i < cells; i++) {
    let c = ".";
    for (let j = i * per; j < Math.min(n, (i + 1) * per); j++) if (RANK(blocks[j]) > RANK(c)) c = blocks[j];
    ctx.fillStyle = POOL_COLORS[c] || (c === "1" ? "#5fb3f9" : "#f2c94c");
    ctx.fillRect((i % across) * size, Math.floor(i / across) * size, size - (size > 3 ? 1 : 0), size - (size > 3 ? 1 : 0));
  }
  const used = [...blocks].filter((c) => c !== "." && c !== "c").length;
  return { n, per, used, shared: [...blocks].filter((c) => c !== "." && c !== "c" && c !== "1").length,
    free: [...blocks].filter((c) => c === "." || c === "c").length };
}

function ringText(r) {  // a ring's slots: block id, and the logical block it holds
  if (!r) return "–";
  const slots = r.slots.map((b, i) => r.logical[i] === null ? `${b}` : `${b}:${r.logical[i]}`).join(" ");
  const off = Object.entries(r.off_ring).map(([j, b]) => `${b}:${j}`).join(" ");
  return off ? `${slots} · off the ring ${off}` : slots;
}

export function kvLive(st) {
  const p = drawPool($("kv-pool"), st.blocks);
  $("kv-legend").textContent = `${p.n} blocks${p.per > 1 ? ` (${p.per} a cell, shown as the busiest)` : ""}: ${p.used} in use (blue; yellow = shared by several sequences: ${p.shared}), ${st.cached_blocks} holding cached prefixes (green when free), ${st.stats.free_blocks} free · prefix-cache hit rate ${(st.stats.prefix_cache_hit_rate * 100).toFixed(1)}%`;
  const sl = st.sliding;
  $("kv-sliding").hidden = !sl;
  if (sl) {
    const q = drawPool($("kv-sliding-pool"), sl.blocks);
    $("kv-sliding-legend").textContent = `${q.n} blocks${q.per > 1 ? ` (${q.per} a cell)` : ""} for the layers that see only the last ${sl.window} tokens: each sequence writes into a ring of slots, a cached block (green when free) is kept and its slot takes a new one · ${q.used} in use (${q.shared} shared), ${sl.cached_blocks} cached, ${q.free} free`;
  }
  const seqs = st.running.concat(st.waiting);
  const head = ["request", "prompt", "computed", "output", "cached", "block table"].concat(sl ? ["ring (block:logical block)"] : []);
  $("kv-tables").replaceChildren(seqs.length ? table(head,
    seqs.map((q) => [q.sequence, q.prompt_tokens, q.computed, q.output_tokens, q.cached_tokens, q.blocks.join(" ") || "–"].concat(sl ? [ringText(q.ring)] : []))) : h("div", { class: "note" }, "No request running now: send demo requests (11) to watch blocks fill and free."));
  ready("w-kv");
}

const history = [];
const LANE_LEFT = 90;  // px of request ids left of the lanes (and of the steps chart's columns)
export function batchingLive(st) {
  for (const step of st.steps) history.push(step);
  while (history.length > 150) history.shift();
  const fallbacks = Object.values(st.stats.kernel_fallbacks || {}).reduce((x, y) => x + y, 0);
  $("bt-stats").textContent = `running ${st.stats.running} · waiting ${st.stats.waiting} · preemptions ${st.stats.num_preemptions} · failed ${st.stats.num_failed ?? 0} · kernel fallbacks ${fallbacks} · KV usage ${(st.stats.kv_cache_usage * 100).toFixed(1)}%`;
  const cv = $("bt-steps"), ctx = cv.getContext("2d");
  ctx.clearRect(0, 0, cv.width, cv.height);
  const maxTok = Math.max(8, ...history.map((x) => x.prefill.reduce((a, p) => a + p[1], 0) + x.decode.length));
  const left = LANE_LEFT, w = (cv.width - left) / 150;  // the same columns as the lanes below
  history.forEach((x, i) => {
    const pre = x.prefill.reduce((a, p) => a + p[1], 0), dec = x.decode.length;
    const H = cv.height - 20, hp = (pre / maxTok) * H, hd = (dec / maxTok) * H;
    ctx.fillStyle = "#5fb3f9"; ctx.fillRect(left + i * w, cv.height - hd, w - 1, hd);
    ctx.fillStyle = "#f2c94c"; ctx.fillRect(left + i * w, cv.height - hd - hp, w - 1, hp);
    if (x.preempted.length) { ctx.fillStyle = "#eb5757"; ctx.fillRect(left + i * w, 14, w - 1, 6); }
  });
  ctx.fillStyle = "#9aa5b1"; ctx.font = "11px sans-serif";
  ctx.fillText(`tokens per step (last ${history.length} steps, max ${maxTok}): yellow = prefill chunks, blue = decodes, red mark = preemption`, 4, 12);
  const row = (q) => h("span", { class: "tok", title: `priority ${q.priority ?? 0}` }, `${q.request_id} ${q.computed}/${q.prompt_tokens + q.output_tokens}${q.priority ? ` · p${q.priority}` : ""}`);
  const none = h("span", { class: "note" }, "none now");
  $("bt-queue").replaceChildren(h("div", { class: "note" }, "running: "), ...(st.running.length ? st.running.map(row) : [none.cloneNode(true)]),
    h("div", { class: "note" }, "waiting: "), ...(st.waiting.length ? st.waiting.map(row) : [none.cloneNode(true)]));
  drawLanes();
  ready("w-batching");
}

// one lane per request over the recent steps: yellow a prefill chunk, blue a decode, red a
// preemption, grey a step it sat out between its first and last (waiting, or preempted)
function drawLanes() {
  const cv = $("bt-lanes"), ctx = cv.getContext("2d");
  const ids = [];
  for (const x of history) for (const rid of [...x.prefill.map((p) => p[0]), ...x.decode, ...x.preempted]) if (!ids.includes(rid)) ids.push(rid);
  const lanes = ids.slice(-16), lh = 14, left = LANE_LEFT, w = (cv.width - left) / 150;
  cv.height = 18 + Math.max(1, lanes.length) * lh;
  ctx.clearRect(0, 0, cv.width, cv.height);
  ctx.font = "10px ui-monospace, monospace";
  ctx.fillStyle = "#9aa5b1";
  ctx.fillText(lanes.length ? "request lanes over the same steps: yellow prefill chunk, blue decode, red preempted, grey waiting" : "no request in the recent steps: send demo requests", 4, 11);
  lanes.forEach((rid, r) => {
    const y = 16 + r * lh;
    ctx.fillStyle = "#9aa5b1";
    ctx.fillText(rid.length > 13 ? "…" + rid.slice(-12) : rid, 2, y + lh - 4);
    const seen = history.map((x) => (x.preempted.includes(rid) ? "p" : x.prefill.some((p) => p[0] === rid) ? "f" : x.decode.includes(rid) ? "d" : ""));
    const first = seen.findIndex((c) => c), last = seen.length - 1 - [...seen].reverse().findIndex((c) => c);
    seen.forEach((c, i) => {
      if (i < first || i > last) return;
      ctx.fillStyle = { f: "#f2c94c", d: "#5fb3f9", p: "#eb5757" }[c] || "#3a4550";
      ctx.fillRect(left + i * w, y, Math.max(1, w - 1), lh - 2);
    });
  });
}

const specHistory = [];
export function specLive(st) {
  for (const step of st.steps) for (const v of step.spec) specHistory.push({ step: step.step, ...v });
  while (specHistory.length > 40) specHistory.shift();
  const sp = st.speculative;
  if (!sp) {
    $("spec-out").replaceChildren(h("div", { class: "note" }, "This server runs without speculative decoding in its steps (try it on demand above). Start it with --speculative-method ngram (or --speculative-model M) to see every request's drafts, which the target accepted, and the target's and draft's probabilities here."));
  } else {
    const s = st.stats;
    $("spec-out").replaceChildren(
      h("div", { class: "stat" }, `${sp.method}, up to ${sp.num_speculative_tokens} drafted tokens · drafted ${s.spec_num_drafted_tokens}, accepted ${s.spec_num_accepted_tokens} (acceptance rate ${(s.spec_acceptance_rate * 100).toFixed(1)}%), mean tokens per verification ${s.spec_mean_accepted_length.toFixed(2)}`),
      specHistory.length ? table(["step", "request", "drafted (p target as the acceptance test saw it / q draft; – not checked)", "accepted", "emitted"], specHistory.slice().reverse().map((v) => [v.step, v.request_id,
        h("span", {}, ...v.drafted.map((t, i) => h("span", { class: "tok " + (i < v.accepted ? "kept" : "cut") }, `${t} ${v.p_target[i] ?? "–"}/${v.q_draft[i]}`))), v.accepted, v.emitted.join(" ")])) : h("div", { class: "note" }, "No verification yet: send demo requests (11)."));
  }
  ready("w-spec");
}

export function requestsLive(st) {
  if (!st.requests.length) {
    $("req-out").replaceChildren(h("div", { class: "note" }, "No finished request yet."));
  } else {
    $("req-out").replaceChildren(table(["request", "prompt ids (after the template)", "output", "finish", "priority", "queue ms", "TTFT ms", "latency ms", "cached", "blocks", "preemptions"],
      st.requests.slice().reverse().map((r) => [r.request_id, r.prompt_ids.slice(0, 24).join(" ") + (r.prompt_ids.length > 24 ? ` … (${r.prompt_ids.length})` : ""),
        r.outputs.map((o) => o.text).join(" | ").slice(0, 80), r.outputs.map((o) => o.finish_reason).join(","), r.priority ?? 0, r.queue_ms?.toFixed(1) ?? "–", r.ttft_ms?.toFixed(1) ?? "–", r.latency_ms?.toFixed(1) ?? "–", r.num_cached_tokens, r.num_blocks.join(","), r.num_preemptions])));
  }
  ready("w-requests");
}

export async function quantization(isGguf) {
  if (!isGguf) {
    $("q-formats").replaceChildren(h("div", { class: "note" }, "This model is a Hugging Face folder: its tensors are dense; the format view reads GGUF files."));
    ready("w-quant");
    return;
  }
  try {
    const r = await api("quant/tensors");
    $("q-formats").replaceChildren(
      h("div", { class: "stat" }, `${(r.parameters / 1e6).toFixed(1)} M parameters in ${fmtBytes(r.bytes)} as stored · bf16 would take ${fmtBytes(r.bf16_bytes)}, fp32 ${fmtBytes(r.fp32_bytes)}`),
      table(["format", "tensors", "parameters", "bytes", "bits per weight"], Object.entries(r.formats).map(([k, v]) => [k, v.tensors, v.parameters, fmtBytes(v.bytes), (8 * v.bytes / v.parameters).toFixed(2)])));
    const matrices = r.tensors.filter((t) => t.shape.length === 2);  // (Qwen's attn_q.bias, 1-D, is listed first)
    $("q-tensor").replaceChildren(...matrices.map((t) => h("option", { value: t.name }, `${t.name} ${t.type} [${t.shape.join("×")}]`)));
    const go = async () => {
      try {
        const e = await api("quant/error?tensor=" + encodeURIComponent($("q-tensor").value));
        $("q-out").replaceChildren(h("div", { class: "note" }, `${e.tensor} stored as ${e.stored_type}; de-quantized (first ${e.rows_used} rows, RMS ${e.rms.toExponential(3)}) then re-quantized with the gguf package's quantizers:`),
          table(["format", "bits/weight", "RMS error", "relative RMS", "max |error|"], e.requantized.map((q) => [q.format, q.bits_per_weight, q.rms_error.toExponential(3), (q.relative_rms * 100).toFixed(2) + "%", q.max_abs_error.toExponential(3)])));
        ready("w-quant");
      } catch (err) { showError("w-quant", err); }
    };
    $("q-go").addEventListener("click", go);
    const q = matrices.find((t) => t.name.includes("attn_q")) || matrices[0];
    $("q-tensor").value = q.name;
    await go();
  } catch (e) { showError("w-quant", e); }
}

// speculation on demand: one request, n-gram drafts verified by the served model
export async function specDemand() {
  try {
    $("spec-go").disabled = true;
    const r = await api("spec/run", { method: $("spec-method").value, prompt: $("spec-prompt").value, num_speculative_tokens: +$("spec-k").value, temperature: +$("spec-t").value, max_tokens: 24 });
    $("spec-meta").textContent = `${r.method}: ${r.token_ids.length} tokens in ${r.target_passes} target passes (${r.tokens_per_pass} per pass; without speculation: 1) · ${r.verifications} verifications, drafted ${r.drafted}, accepted ${r.accepted} (${(r.acceptance_rate * 100).toFixed(1)}%)`;
    const tok = (t, cls, title) => h("span", { class: "tok " + cls, title }, t.token);
    $("spec-steps").replaceChildren(
      table(["pass", "drafted: p_target / q_draft (green accepted, struck out rejected, grey not checked)", "accepted", "emitted"], r.steps.map((st, i) => [i + 1,
        st.drafted.length ? h("span", { class: "tokens" }, ...st.drafted.map((d, j) => h("span", { class: "tok " + (j < st.accepted ? "kept" : j < st.p_target.length ? "cut" : "") }, `${d.token} ${st.p_target[j] ?? "–"}/${st.q_draft[j]}`))) : h("span", { class: "note" }, "no earlier occurrence: nothing to guess"),
        st.accepted, h("span", { class: "tokens" }, ...st.emitted.map((e, j) => tok(e, j < st.accepted ? "kept" : "gen", j < st.accepted ? "an accepted draft" : "the target's own token")))])),
      h("pre", { class: "stream" }, r.text));
    ready("w-spec");
  } catch (e) { showError("w-spec", e); } finally { $("spec-go").disabled = false; }
}

// the served weights against the float32 reference, per position of the learner's prompt
export async function quantKl() {
  try {
    $("qkl-go").disabled = true;
    $("qkl-meta").textContent = "building the float32 reference on first use, then scoring …";
    const r = await api("quant/kl", { prompt: $("qkl-prompt").value });
    const sv = r.served, ref = r.reference;
    $("qkl-meta").textContent = `served: ${sv.dtype} activations, weights ${sv.weights.join(", ")}, KV cache ${sv.kv_cache_dtype} · reference: float32 (${fmtBytes(ref.bytes)}; built once in ${ref.build_s} s; the page builds one up to ${fmtBytes(ref.cap_bytes)}) · mean KL ${r.kl_mean.toExponential(3)} nats, max ${r.kl_max.toExponential(3)} · same top token at ${(r.top1_agreement * 100).toFixed(1)}% of ${r.positions.length} positions`;
    const svg = $("qkl-chart"), H = 180, m = 40, bw = Math.max(6, Math.min(24, 560 / r.positions.length));
    const W = Math.max(620, m + 10 + bw * r.positions.length);
    svg.setAttribute("width", String(W));
    svg.replaceChildren();
    const top = Math.max(...r.positions.map((p) => p.kl), 1e-9);
    r.positions.forEach((p, i) => {
      const bh = (Math.max(0, p.kl) / top) * (H - 40);
      const bar = s("rect", { x: m + i * bw, y: H - 20 - bh, width: bw - 1, height: Math.max(1, bh), fill: p.same_top ? "#5fb3f9" : "#eb5757" });
      bar.append(s("title", {}, `${p.token} → ${p.next}: KL ${p.kl}`));
      svg.append(bar);
    });
    svg.append(s("line", { x1: m, y1: H - 20, x2: W - 8, y2: H - 20, stroke: "#556" }));
    svg.append(s("text", { x: 2, y: 14 }, `KL ${top.toExponential(1)} nats`));
    svg.append(s("text", { x: m, y: H - 4 }, "position 0"));
    svg.append(s("text", { x: W - 8, y: H - 4, "text-anchor": "end" }, `${r.positions.length - 1} (red: a different top token)`));
    $("qkl-out").replaceChildren(table(["position", "token → next", "KL (nats)", "top served", "top reference", "log p(next) served", "log p(next) reference"],
      r.positions.map((p) => [p.position, `${p.token} → ${p.next}`, p.kl.toExponential(2), h("span", { class: p.same_top ? "kept" : "cut" }, p.top_served), p.top_reference, p.logprob_served, p.logprob_reference])));
    ready("w-quant");
  } catch (e) { showError("w-quant", e); } finally { $("qkl-go").disabled = false; }
}
