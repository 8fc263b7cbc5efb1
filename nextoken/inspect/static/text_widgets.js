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
      svg.append(s("text", { x: 4, y: H - 6 }, `PC1 ${(r.explained_variance[0] * 100).toFixed(1)}% · PC2 ${(r.explained_variance[1] * 100).toFixed(1)}% of the variance of ${r.hidden_size}-dim rows`));
      for (const p of r.points) {
        svg.append(s("circle", { cx: X(p.x), cy: Y(p.y), r: 4, fill: "#5fb3f9" }));
        svg.append(s("text", { x: X(p.x) + 6, y: Y(p.y) + 4 }, `${p.word} (${p.id})`));
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
    const blocks = [
      ["embedding", `Embedding ${r.vocab_size} × ${r.hidden_size}`],
      ["attention", `Attention: ${r.num_heads} query / ${r.num_kv_heads} KV heads × ${r.head_dim}`],
      ["mlp", `MLP ${r.hidden_size} → ${r.intermediate_size} → ${r.hidden_size}, ${r.activation}`],
      ["norms", `${r.norm} (eps ${r.norm_eps})`],
      ["lm_head", `LM head ${r.hidden_size} → ${r.vocab_size}` + (r.tied_embeddings ? " (tied)" : "")],
    ];
    let y = 10;
    const detail = (key) => {
      const p = parts[key] || { parameters: 0, bytes: 0 };
      const rows = key === "attention" || key === "mlp" ? r.layer0.filter((l) => (key === "mlp" ? l.name.includes("mlp") : l.name.includes("attn"))) : [];
      const times = r.layer_times_ms;
      $("arch-detail").replaceChildren(h("h3", {}, key), h("div", { class: "stat" }, `${(p.parameters / 1e6).toFixed(2)} M parameters · ${fmtBytes(p.bytes)} in memory`),
        rows.length ? table(["layer 0 weight", "shape [out, in]", "format", "bytes"], rows.map((l) => [l.name, l.shape.join(" × "), l.format, fmtBytes(l.bytes)])) : "",
        times ? h("div", { class: "note" }, `time per layer in the last attention trace (reference attention): ${times.map((t) => t.toFixed(1)).join(", ")} ms`) : h("div", { class: "note" }, "Trace a prompt (5. Attention) to see the time each layer took."));
    };
    for (const [key, label] of blocks) {
      const hgt = key === "attention" || key === "mlp" ? 70 : 50;
      const g = s("g", { style: "cursor:pointer", onclick: () => detail(key), "data-part": key });
      g.append(s("rect", { x: key === "attention" || key === "mlp" ? 40 : 10, y, width: 300, height: hgt, rx: 6, fill: key === "attention" ? "#24496b" : key === "mlp" ? "#3b2d6b" : "#2a3946" }));
      g.append(s("text", { x: 50, y: y + 20 }, label));
      const p = parts[key];
      if (p) g.append(s("text", { x: 50, y: y + 38 }, `${(p.parameters / 1e6).toFixed(2)} M params · ${fmtBytes(p.bytes)}`));
      svg.append(g);
      y += hgt + 12;
    }
    svg.append(s("rect", { x: 30, y: 72, width: 320, height: 170, fill: "none", stroke: "#5fb3f9", "stroke-dasharray": "4 3" }));
    svg.append(s("text", { x: 250, y: 256 }, `× ${r.layers} layers`));
    svg.append(s("text", { x: 10, y: y + 10 }, `total ${fmtBytes(r.total_bytes)} · ${r.dtype} · context ${r.context_length}`));
    if (r.sliding_window) svg.append(s("text", { x: 10, y: y + 26 }, `sliding window ${r.sliding_window} on ${r.sliding_layers.length} layers`));
    $("arch-plan").textContent = r.plan;
    detail("attention");
    ready("w-architecture");
  } catch (e) { showError("w-architecture", e); }
}
