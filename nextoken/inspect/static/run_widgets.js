// Widgets 5-9: attention (trace), logit lens, prefill vs decode, sampling, beam search.
import { $, api, h, ready, showError, heatmap, s, debounce, table, color } from "./lib.js";

let trace = null;        // the last trace's summary
let layerData = {};      // layer -> Uint8Array [heads, T, T]
let selected = null;     // clicked query position

async function layer(L) {
  if (!layerData[L]) {
    const r = await api(`trace/${trace.trace_id}/attention?layer=${L}`);
    const bin = atob(r.data);
    const a = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) a[i] = bin.charCodeAt(i);
    layerData[L] = a;
  }
  return layerData[L];
}

async function drawAttention() {
  const L = +$("att-layer").value, H = +$("att-head").value, T = trace.tokens.length;
  const a = await layer(L);
  const at = (q, k) => a[H * T * T + q * T + k] / 255;
  heatmap($("att-heat"), T, T, (q, k) => at(q, k));
  const focus = selected ?? T - 1;
  const row = trace.tokens.map((t, k) => ({ k, w: k <= focus ? at(focus, k) : 0 }));
  const top = [...row].sort((x, y) => y.w - x.w).slice(0, 5);
  const sliding = trace.sliding_layers.includes(L) ? ` · sliding-window layer (window ${trace.sliding_window})` : "";
  const lab = trace.labels[L][H];
  $("att-focus").replaceChildren(
    h("div", { class: "stat" }, `layer ${L} head ${H} (KV head ${Math.floor(H / (trace.heads / trace.kv_heads))}): ${lab.label}${sliding}`),
    h("div", { class: "note" }, `"${trace.tokens[focus].token}" (position ${focus}) attends to: ` + top.map((t) => `${trace.tokens[t.k].token} ${(t.w * 100).toFixed(0)}%`).join(", ")),
    table(["mean weight on", "value"], [["previous token", lab.prev], ["first token", lab.first], ["itself", lab.self], ["normalised entropy", lab.entropy]]));
  $("att-tokens").querySelectorAll(".tok").forEach((e, k) => {
    e.classList.toggle("sel", k === focus);
    e.style.background = k <= focus ? `rgba(95,179,249,${at(focus, k)})` : "";
  });
  ready("w-attention");
}

// layers x positions: each cell the lens' top token, its probability as the colour
async function drawLensGrid() {
  const g = await api(`trace/${trace.trace_id}/lens_grid`);
  const canvas = $("lens-heat"), rows = g.cells.length, cols = g.positions;
  const cw = Math.max(36, Math.min(90, Math.floor(880 / cols))), ch = 16, left = 70, top = 18;
  canvas.width = left + cols * cw;
  canvas.height = top + rows * ch;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#0b0f13";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.font = "10px ui-monospace, monospace";
  ctx.textBaseline = "middle";
  const fit = (text, w) => { let t = text; while (t.length > 1 && ctx.measureText(t).width > w) t = t.slice(0, -1); return t; };
  for (let p = 0; p < cols; p++) { ctx.fillStyle = "#9aa5b1"; ctx.fillText(fit(g.tokens[p], cw - 4), left + p * cw + 2, top / 2); }
  for (let l = 0; l < rows; l++) {
    ctx.fillStyle = "#9aa5b1";
    ctx.fillText(l === 0 ? "embedding" : `layer ${l - 1}`, 2, top + l * ch + ch / 2);
    for (let p = 0; p < cols; p++) {
      const c = g.cells[l][p];
      ctx.fillStyle = color(c.prob);
      ctx.fillRect(left + p * cw, top + l * ch, cw - 1, ch - 1);
      ctx.fillStyle = c.prob > 0.5 ? "#0b0f13" : "#e6e6e6";
      ctx.fillText(fit(c.token, cw - 4), left + p * cw + 2, top + l * ch + ch / 2);
    }
  }
  canvas.setAttribute("aria-label", `logit lens: top token of each of ${rows} residual streams at ${cols} positions`);
}

async function drawLens() {
  try {
    const r = await api(`trace/${trace.trace_id}/lens?position=${$("lens-pos").value}&top=5`);
    $("lens-out").replaceChildren(table(["layer", "top tokens (probability)"],
      r.layers.map((l) => [String(l.layer), l.top.map((t) => `${t.token} ${(t.prob * 100).toFixed(1)}%`).join("   ")])));
    ready("w-lens");
  } catch (e) { showError("w-lens", e); }
}

export function attention() {
  const go = async () => {
    try {
      trace = await api("trace", { prompt: $("att-prompt").value });
      layerData = {};
      selected = null;
      const T = trace.tokens.length;
      $("att-meta").textContent = `${T} tokens · ${trace.layers} layers × ${trace.heads} heads · traced in ${trace.trace_ms.toFixed(0)} ms as an engine request (reference attention)`;
      $("att-layer").replaceChildren(...Array.from({ length: trace.layers }, (_, i) => h("option", { value: i }, i + (trace.sliding_layers.includes(i) ? " (sliding)" : ""))));
      $("att-head").replaceChildren(...Array.from({ length: trace.heads }, (_, i) => h("option", { value: i }, i)));
      $("att-tokens").replaceChildren(...trace.tokens.map((t, k) => h("span", { class: "tok" + (t.special ? " special" : ""), onclick: () => { selected = k; drawAttention(); } }, t.token)));
      $("att-rule").textContent = "Rule: " + trace.label_rule;
      $("att-labels").replaceChildren(...trace.labels.flatMap((heads, L) => heads.map((x, H) => {
        const cls = { "previous token": "lab-prev", "first token (sink)": "lab-first", self: "lab-self", broad: "lab-broad" }[x.label] || "";
        return h("div", { class: cls, title: `prev ${x.prev} · first ${x.first} · self ${x.self} · entropy ${x.entropy}`, onclick: () => { $("att-layer").value = L; $("att-head").value = H; drawAttention(); } }, `L${L}.H${H} ${{ "previous token": "prev", "first token (sink)": "sink" }[x.label] || x.label}`);
      })));
      $("lens-pos").replaceChildren(...trace.tokens.map((t, k) => h("option", { value: k }, `${k}: ${t.token}`)));
      $("lens-pos").value = T - 1;
      await drawAttention();
      await drawLensGrid();
      await drawLens();
    } catch (e) { showError("w-attention", e); }
  };
  $("att-go").addEventListener("click", go);
  $("att-layer").addEventListener("change", drawAttention);
  $("att-head").addEventListener("change", drawAttention);
  $("lens-pos").addEventListener("change", drawLens);
  $("att-heat").addEventListener("click", (ev) => {
    if (!trace) return;
    const rect = ev.target.getBoundingClientRect();
    selected = Math.min(trace.tokens.length - 1, Math.floor(((ev.clientY - rect.top) / rect.height) * trace.tokens.length));
    drawAttention();
  });
  return go();
}

export function timeline() {
  const go = async () => {
    try {
      const r = await api("run", { prompt: $("tl-prompt").value, max_tokens: 32 });
      const svg = $("tl-svg");
      svg.replaceChildren();
      const W = +svg.getAttribute("width");
      const end = Math.max(...r.steps.map((x) => x.start_ms + x.ms), 1);
      const X = (t) => 10 + (t / end) * (W - 20);
      for (const st of r.steps) {
        const pre = st.phase === "prefill";
        svg.append(s("rect", { x: X(st.start_ms), y: pre ? 20 : 60, width: Math.max(1.5, X(st.start_ms + st.ms) - X(st.start_ms) - 1), height: 30, fill: pre ? "#f2c94c" : "#5fb3f9" },
        ));
      }
      svg.append(s("text", { x: 10, y: 14 }, "prefill (all prompt tokens in one pass)"));
      svg.append(s("text", { x: 10, y: 106 }, "decode (one token per step)"));
      svg.append(s("text", { x: 10, y: 130 }, `0 ms`));
      svg.append(s("text", { x: W - 80, y: 130 }, `${end.toFixed(0)} ms`));
      const pre = r.steps.filter((x) => x.phase === "prefill");
      const dec = r.steps.filter((x) => x.phase === "decode");
      $("tl-meta").textContent = `prefill: ${pre.map((x) => `${x.tokens} tokens in ${x.ms.toFixed(1)} ms`).join(", ")} · ${dec.length} decode steps, mean ${(dec.reduce((a, x) => a + x.ms, 0) / Math.max(1, dec.length)).toFixed(1)} ms · TTFT ${r.ttft_ms?.toFixed(1)} ms · TPOT ${r.tpot_ms ? r.tpot_ms.toFixed(1) : "–"} ms`;
      $("tl-text").textContent = "Output: " + r.text;
      ready("w-timeline");
    } catch (e) { showError("w-timeline", e); }
  };
  $("tl-go").addEventListener("click", go);
  return go();
}

let generated = [];
export function sampling() {
  const names = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"];
  const body = () => {
    const b = { prompt: $("smp-prompt").value, generated, seed: +$("smp-seed").value };
    for (const n of names) b[n] = +$("smp-" + n).value;
    const kind = $("smp-kind").value, text = $("smp-constraint").value.trim();
    if (kind && text) b[kind] = kind === "json_schema" ? JSON.parse(text) : text;
    return b;
  };
  let last = null;
  const go = debounce(async () => {
    for (const n of names) $("smp-" + n).nextElementSibling.textContent = $("smp-" + n).value;
    try {
      const r = await api("sample", body());
      last = r;
      const k = r.kept_counts;
      $("smp-meta").textContent = `vocabulary ${r.vocab_size} · ` + (r.grammar ? `the grammar allows ${k.grammar} · ` : "") + `kept after top-k ${k.top_k}, top-p ${k.top_p}, min-p ${k.min_p} · entropy of the raw distribution ${r.entropy_raw} nats · seeded draw: "${r.chosen.token}"` + (r.greedy ? " (temperature 0: greedy)" : "");
      const max = Math.max(...r.candidates.map((c) => c.p_final), ...r.candidates.map((c) => c.p_raw), 1e-9);
      const g = r.grammar ? ["grammar"] : [];
      $("smp-out").replaceChildren(table(["token", "logit", "p raw", "p penalized", ...g, "p at T", "top-k", "top-p", "min-p", "p final", ""],
        r.candidates.map((c) => {
          const mark = (b, no = "cut") => h("span", { class: b ? "kept" : "cut" }, b ? "kept" : no);
          return [h("span", { class: c.id === r.chosen.id ? "chosen" : "" }, c.token), c.logit, c.p_raw, c.p_penalized,
            ...(r.grammar ? [mark(c.kept.grammar, "refused")] : []), c.p_temperature,
            mark(c.kept.top_k), mark(c.kept.top_p), mark(c.kept.min_p), c.p_final, h("span", { class: "bar", style: `width:${(c.p_final / max) * 160}px` })];
        })));
      $("w-sampling").querySelectorAll(".err").forEach((e) => e.remove());
      ready("w-sampling");
    } catch (e) { showError("w-sampling", e); }
  }, 120);
  for (const n of [...names, "seed", "prompt", "kind", "constraint"]) $("smp-" + n).addEventListener("input", go);
  $("smp-kind").addEventListener("change", () => { generated = []; $("smp-gen").textContent = ""; });
  $("smp-draw").addEventListener("click", () => {
    if (!last) return;
    generated.push(last.chosen.id);
    $("smp-gen").textContent = "generated so far: " + generated.length + " tokens";
    go();
  });
  $("smp-reset").addEventListener("click", () => { generated = []; $("smp-gen").textContent = ""; go(); });
  go();
}

export function beam() {
  const go = async () => {
    try {
      const r = await api("beam", { prompt: $("beam-prompt").value, beam_width: +$("beam-w").value, max_tokens: +$("beam-n").value });
      const svg = $("beam-svg");
      svg.replaceChildren();
      const steps = Math.max(...r.nodes.map((n) => n.step)) + 1;
      const shown = r.nodes.filter((n) => n.fate !== "pruned" || n.step < steps);
      const byStep = Array.from({ length: steps }, (_, i) => shown.filter((n) => n.step === i && n.fate !== "pruned").concat(shown.filter((n) => n.step === i && n.fate === "pruned").slice(0, 4)));
      const rows = Math.max(...byStep.map((x) => x.length));
      svg.setAttribute("height", String(40 + rows * 22));
      svg.setAttribute("width", String(Math.max(900, 160 * steps + 40)));
      const pos = {};
      byStep.forEach((list, i) => list.forEach((n, j) => (pos[n.id] = [20 + i * 160, 30 + j * 22])));
      const best = new Set(r.beams.length ? r.beams[0].ids.map((_, i) => r.beams[0].ids.slice(0, i + 1).join(",")) : []);
      const greedy = new Set(r.greedy.path);
      for (const n of byStep.flat()) {
        const [x, y] = pos[n.id];
        if (pos[n.parent]) svg.append(s("line", { x1: pos[n.parent][0] + 120, y1: pos[n.parent][1] - 4, x2: x, y2: y - 4, stroke: best.has(n.id) ? "#6fcf97" : "#445" }));
        const fill = n.fate === "pruned" ? "#6b7785" : n.fate === "finished" ? "#f2c94c" : "#e6e6e6";
        svg.append(s("text", { x, y, fill, style: `fill:${fill}` + (greedy.has(n.id) ? ";text-decoration:underline" : "") }, `${n.token} ${n.cumulative_logprob.toFixed(2)}`));
      }
      $("beam-meta").textContent = `best beam: "${r.beams[0]?.text}" (log p ${r.beams[0]?.cumulative_logprob}, score ${r.beams[0]?.score}) · greedy: "${r.greedy.text}" (log p ${r.greedy.cumulative_logprob}) · green: best beam's path, underlined: greedy path, grey: pruned, yellow: finished`;
      ready("w-beam");
    } catch (e) { showError("w-beam", e); }
  };
  $("beam-go").addEventListener("click", go);
  return go();
}
