// Widgets 1-4: tokenizer and BPE replay, embeddings and analogy, positions, architecture.
import { $, api, h, ready, showError, heatmap, s, lineChart, debounce, table, fmtBytes } from "./lib.js";

export function tokenizer() {
  const run = debounce(async () => {
    try {
      const r = await api("tokenize", { text: $("tok-text").value || " ", chat: $("tok-chat").checked });
      $("tok-count").textContent = `${r.count} tokens from ${r.chars} characters · vocabulary ${r.vocab_size}`;
      $("tok-out").replaceChildren(...r.tokens.map((t) =>
        h("span", { class: "tok" + (t.special ? " special" : "") + (t.partial_utf8 ? " partial" : ""), title: `piece ${t.piece} · bytes ${t.bytes}` },
          t.display, h("small", {}, t.id))));
      ready("w-tokenizer");
    } catch (e) { showError("w-tokenizer", e); }
  }, 150);
  $("tok-text").addEventListener("input", run);
  $("tok-chat").addEventListener("change", run);
  run();
  const bpe = async () => {
    try {
      const r = await api("bpe", { word: $("bpe-word").value });
      const out = [h("div", { class: "note" }, `${r.num_merges} merges in the model's list; the pair of lowest rank merges first. Tokenizer ids: ${r.tokenizer_ids.join(", ")}`)];
      for (const p of r.pieces) {
        out.push(h("div", { class: "merge-step" }, "start: ", p.start.map((x) => `[${x}]`).join(" ")));
        for (const st of p.steps)
          out.push(h("div", { class: "merge-step" }, h("b", {}, `rank ${st.rank}: ${st.pair[0]} + ${st.pair[1]}`), "  →  ", st.symbols.map((x) => `[${x}]`).join(" ")));
        out.push(h("div", { class: "stat" }, `ids ${p.ids.join(", ")}`));
      }
      $("bpe-out").replaceChildren(...out);
    } catch (e) { showError("w-tokenizer", e); }
  };
  $("bpe-go").addEventListener("click", bpe);
  bpe();
}

// a point's label beside it, moved to the first of a few spots where it overlaps no label placed
// before (then joined to its point by a thin line); returns its box
function placeLabel(svg, x, y, label, placed) {
  const t = s("text", { x: x + 6, y: y + 4 }, label);
  svg.append(t);
  const W = +svg.getAttribute("width");
  const spots = [[6, 4], [6, -10], [6, 18], [-6, 4], [-6, -10], [-6, 18], [6, -24], [6, 32], [-6, -24], [-6, 32], [6, -38], [6, 46]];
  let box = null;
  for (const [dx, dy] of spots) {
    t.setAttribute("x", x + dx);
    t.setAttribute("y", y + dy);
    t.setAttribute("text-anchor", dx < 0 ? "end" : "start");
    const b = t.getBBox();
    box = { x: b.x - 1, y: b.y - 1, w: b.width + 2, h: b.height + 2 };
    if (box.x >= 0 && box.x + box.w <= W && !placed.some((o) => overlaps(o, box))) {
      if (dy !== 4) svg.insertBefore(s("line", { x1: x, y1: y, x2: x + dx, y2: y + dy - 4, stroke: "#556" }), t);
      return box;
    }
  }
  return box;  // every spot taken: the first that fits the plot
}

export function overlaps(a, b) {
  return a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h;
}

export function embeddings() {
  const plot = async () => {
    try {
      const words = $("emb-words").value.split(",").map((w) => w.trim()).filter(Boolean);
      const r = await api("embeddings", { words });
      const svg = $("emb-plot");
      svg.replaceChildren();
      const W = +svg.getAttribute("width"), H = +svg.getAttribute("height");
      const xs = r.points.map((p) => p.x), ys = r.points.map((p) => p.y);
      const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
      const X = (x) => 40 + ((x - x0) / (x1 - x0 || 1)) * (W - 100), Y = (y) => H - 30 - ((y - y0) / (y1 - y0 || 1)) * (H - 60);
      const caption = s("text", { x: 4, y: H - 6 }, `PC1 ${(r.explained_variance[0] * 100).toFixed(1)}% · PC2 ${(r.explained_variance[1] * 100).toFixed(1)}% of the variance of ${r.hidden_size}-dim rows`);
      svg.append(caption);
      const cb = caption.getBBox();
      const placed = [{ x: cb.x - 1, y: cb.y - 1, w: cb.width + 2, h: cb.height + 2 }];  // labels keep off the caption
      for (const p of r.points) {
        svg.append(s("circle", { cx: X(p.x), cy: Y(p.y), r: 4, fill: "#5fb3f9" }));
        placed.push(placeLabel(svg, X(p.x), Y(p.y), `${p.word} (${p.id})`, placed));
      }
      ready("w-embeddings");
    } catch (e) { showError("w-embeddings", e); }
  };
  const analogy = async () => {
    try {
      const r = await api("analogy", { a: $("an-a").value, b: $("an-b").value, c: $("an-c").value, target: $("an-t").value });
      $("an-out").replaceChildren(
        h("div", { class: "stat" }, `"${r.target.token}" ranks #${r.target.rank} of ${r.vocab_size - 3} tokens (cosine ${r.target.cosine})`),
        table(["#", "token", "id", "cosine"], r.nearest.map((n, i) => [i + 1, n.token, n.id, n.cosine])),
        h("div", { class: "note" }, `The three inputs are left out, as word2vec does. Their own cosines: ${Object.entries(r.inputs_cosine).map(([k, v]) => k + " " + v).join(", ")}`));
      ready("w-embeddings");
    } catch (e) { showError("w-embeddings", e); }
  };
  $("emb-go").addEventListener("click", plot);
  $("an-go").addEventListener("click", analogy);
  plot();
  analogy();
}

export async function positions() {
  try {
    const r = await api("rope?positions=64");
    if (r.learned_position_embeddings) {
      $("rope-meta").textContent = "This model learns its position embeddings (GPT-2): no RoPE.";
    } else {
      $("rope-meta").textContent = `RoPE over ${r.rope_dim} of ${r.head_dim} head dims (${r.pairs} pairs), base ${r.base}: rate_i = base^(-2i/${r.rope_dim}), from ${r.rate[0].toFixed(3)} to ${r.rate[r.pairs - 1].toExponential(2)} rad/position` + (r.sliding_cos ? " · sliding-window layers use their own table" : "");
      heatmap($("rope-heat"), r.positions, r.pairs, (i, j) => r.cos[i][j], { lo: -1, hi: 1, signed: true });
      lineChart($("rope-decay"), r.decay.distance.map((d, i) => ({ x: d, y: r.decay.score[i] })), { logx: true, xlabel: "distance (tokens, log)", ylabel: "relative score" });
    }
    ready("w-positions");
  } catch (e) { showError("w-positions", e); }
  const sin = debounce(async () => {
    try {
      const base = Math.round(10 ** +$("sin-base").value);
      $("sin-base-v").textContent = base;
      const r = await api(`sinusoidal?base=${base}&positions=50&dims=64`);
      heatmap($("sin-heat"), r.positions, r.dims, (i, j) => r.values[i][j], { lo: -1, hi: 1, signed: true });
      ready("w-positions");
    } catch (e) { showError("w-positions", e); }
  }, 100);
  $("sin-base").addEventListener("input", sin);
  sin();
}

export async function architecture() {
  try {
    const r = await api("architecture");
    const svg = $("arch-svg");
    svg.replaceChildren();
    const parts = r.parts;
    const eps = Number(r.norm_eps).toExponential(0);  // 1e-5, not 0.000009999999747378752
    const blocks = [  // key, label, x, height: the data flow, top to bottom
      ["embedding", `Embedding ${r.vocab_size} × ${r.hidden_size}`, 10, 46],
      ["norms", `${r.norm} (eps ${eps})`, 40, 26],
      ["attention", `Attention: ${r.num_heads} query / ${r.num_kv_heads} KV heads × ${r.head_dim}`, 40, 46],
      ["add", "+ residual", 40, 22],
      ["norms", `${r.norm}`, 40, 26],
      ["mlp", `MLP ${r.hidden_size} → ${r.intermediate_size} → ${r.hidden_size}, ${r.activation}`, 40, 46],
      ["add", "+ residual", 40, 22],
      ["norms", `final ${r.norm}`, 10, 26],
      ["lm_head", `LM head ${r.hidden_size} → ${r.vocab_size}` + (r.tied_embeddings ? " (tied)" : ""), 10, 46],
    ];
    const fill = { attention: "#24496b", mlp: "#3b2d6b", add: "#2d4a36", norms: "#3a3f46" };
    svg.append(s("defs", {}, ""));
    svg.querySelector("defs").append(s("marker", { id: "arrow", viewBox: "0 0 8 8", refX: 7, refY: 4, markerWidth: 7, markerHeight: 7, orient: "auto" }));
    svg.querySelector("marker").append(s("path", { d: "M0,0 L8,4 L0,8 z", fill: "#9aa5b1" }));
    let y = 8, layerTop = 0, layerBottom = 0;
    const detail = (key) => {
      const p = parts[key] || { parameters: 0, bytes: 0 };
      const rows = key === "attention" || key === "mlp" ? r.layer0.filter((l) => (key === "mlp" ? l.name.includes("mlp") : l.name.includes("attn"))) : [];
      const times = r.layer_times_ms;
      $("arch-detail").replaceChildren(h("h3", {}, key), h("div", { class: "stat" }, `${(p.parameters / 1e6).toFixed(2)} M parameters · ${fmtBytes(p.bytes)} in memory`),
        rows.length ? table(["layer 0 weight", "shape [out, in]", "format", "bytes"], rows.map((l) => [l.name, l.shape.join(" × "), l.format, fmtBytes(l.bytes)])) : "",
        times ? h("div", { class: "note" }, `time per layer in the last attention trace (reference attention): ${times.map((t) => t.toFixed(1)).join(", ")} ms`) : h("div", { class: "note" }, "Trace a prompt (5. Attention) to see the time each layer took."));
    };
    blocks.forEach(([key, label, x, hgt], i) => {
      if (i === 1) layerTop = y - 4;
      const g = s("g", { style: "cursor:pointer", onclick: () => detail(key), "data-part": key, "aria-label": label });
      g.append(s("rect", { x, y, width: 300 - (x - 10), height: hgt, rx: 5, fill: fill[key] || "#2a3946" }));
      g.append(s("text", { x: x + 10, y: y + 17 }, label));
      const p = parts[key];
      if (p && hgt > 30) g.append(s("text", { x: x + 10, y: y + 35 }, `${(p.parameters / 1e6).toFixed(2)} M params · ${fmtBytes(p.bytes)}`));
      svg.append(g);
      y += hgt;
      if (i === 6) layerBottom = y + 4;
      if (i < blocks.length - 1) {
        svg.append(s("line", { x1: 160, y1: y, x2: 160, y2: y + 12, stroke: "#9aa5b1", "marker-end": "url(#arrow)" }));
        y += 14;
      }
    });
    svg.append(s("rect", { x: 30, y: layerTop, width: 290, height: layerBottom - layerTop, fill: "none", stroke: "#5fb3f9", "stroke-dasharray": "4 3" }));
    svg.append(s("text", { x: 326, y: layerTop + 14 }, `× ${r.layers} layers`));
    svg.append(s("text", { x: 10, y: y + 18 }, `total ${fmtBytes(r.total_bytes)} · ${r.dtype} · context ${r.context_length}`));
    if (r.sliding_window) svg.append(s("text", { x: 10, y: y + 34 }, `sliding window ${r.sliding_window} on ${r.sliding_layers.length} layers`));
    svg.setAttribute("height", y + 42);
    $("arch-plan").textContent = r.plan;
    detail("attention");
    ready("w-architecture");
  } catch (e) { showError("w-architecture", e); }
}
