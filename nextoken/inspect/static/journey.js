// The journey: one prompt through every stage, one decode step at a time (POST journey/step).
// DOM contract: #journey, #journey-prompt, #journey-start, #journey-next; every generated token an
// element with data-journey-token-id; each stage a [data-stage] element with data-ready="true" once drawn.
import { $, api, h, table, color, showError, badge } from "./lib.js";

const STAGES = [
  ["tokens", "1 · Text → tokens", "The tokenizer cuts the text into pieces from its vocabulary (BPE: the most frequent pairs were merged during training). The model only ever sees the ids. Generated tokens are added to the end, one per step."],
  ["embedding", "2 · Embedding", "Each id selects one row of the embedding table: a vector of hidden-size numbers. This is the row of the last token, the one whose next token is being predicted."],
  ["positions", "3 · Positions (RoPE)", "Attention alone does not know order. RoPE rotates each pair of query and key dimensions by position × rate: fast pairs turn many times, slow pairs barely move, so the score between two tokens depends on their distance."],
  ["layers", "4 · The layers", "Each layer reads the residual stream, attends to earlier tokens (the last token's strongest keys per head are shown), adds an MLP's output, and writes back: ‖h‖, the residual stream's size, is shown entering the layer, after attention adds its part, and after the MLP adds its own. The logit lens reads what the stream would predict if the model stopped after that layer."],
  ["final", "5 · Final norm and LM head", "The last residual vector is normalised and multiplied by the LM head: one logit per vocabulary entry. Softmax turns logits into probabilities."],
  ["sampler", "6 · Sampler", "Temperature divides the logits; top-k, top-p and min-p cut the tail; the draw picks from what is left (greedy at temperature 0). Crossed-out candidates were cut."],
  ["choice", "7 · The chosen token", "The token the sampler picked, and its probability under the raw softmax."],
  ["commitment", "7b · When the model committed", "For each generated token, the first layer from which the logit lens keeps it as its top-1 (the number under it; the bar's colour, dark early to bright late), measured on this run; hover for the top-3 layer and the rank at every layer. A token that settles only at the last layer (red outline) was decided at the very end."],
  ["detokenizer", "8 · Detokenizer and stream", "The new id is turned back into text. A piece can be part of a character, so the stream shows only the text that became complete."],
  ["kv", "9 · KV cache", "Keys and values of every token stay in the paged cache, block by block, so the next step computes only the new token. This request's blocks fill as it grows."],
];

// where each stage's numbers come from (the issue's provenance badges): measured on this run,
// derived from measured values or the model's constants, or illustrative
const PROVENANCE = { tokens: "measured", embedding: "measured", positions: "derived", layers: "measured", final: "measured",
  sampler: "measured", choice: "measured", commitment: "measured", detokenizer: "measured", kv: "measured" };

const state = { prompt: "", chat: false, generated: [], commits: [], views: [], busy: false, playing: false, stream: "" };
const FORMAT = "nextoken-journey/1";

function settings() {
  return { temperature: Number($("journey-temperature").value), seed: Number($("journey-seed").value) };
}

function stageBox(name) { return document.querySelector(`#journey [data-stage="${name}"] .body`); }

// a token chip; `output`: one of the journey's generated tokens in #journey-out (the DOM contract's
// data-journey-token-id; the stages' copies of them are only styled); clicking one branches there
function tokenEl(t, generated, output = false) {
  const e = h("span", { class: "tok" + (t.special ? " special" : "") + (generated ? " gen" : ""), title: output ? `id ${t.id} · click: the alternatives here` : `id ${t.id}` }, t.token, h("small", {}, t.id));
  if (output) {
    e.dataset.journeyTokenId = String(t.id);
    const at = state.generated.length - 1;  // its position among the generated tokens (pushed just before)
    e.addEventListener("click", () => branch(at));
  }
  return e;
}

// -- branching: the alternatives at a generated token, and trajectories from them -------------------
const TRAJECTORY_SETTINGS = [{ temperature: 0 }, { temperature: 0.8 }, { temperature: 1.2 }];

function branchBox() { return document.querySelector('#journey [data-stage="branch"]'); }

async function branch(at) {
  const box = branchBox(), body = box.querySelector(".body");
  const base = { prompt: state.prompt, chat: state.chat, generated: state.generated.slice(0, at), ...settings() };
  body.replaceChildren(h("div", { class: "note" }, `the alternatives at generated token ${at + 1}…`));
  try {
    const r = await api("journey/branch", base);
    const rows = r.alternatives.map((a) => h("div", { class: "row branch-alt", "data-branch-alt": "", "data-token-id": String(a.id), "data-prob": String(a.prob),
      role: "button", tabindex: "0", title: "generate the trajectory from this token", onclick: () => trajectories(at, a, base, body) },
      h("span", { class: "tok" + (a.chosen ? " gen" : "") }, a.token, h("small", {}, a.id)),
      h("span", { class: "stat" }, `p ${a.prob} after the sampler (raw ${a.p_raw})${a.chosen ? " · the journey's token" : ""} → `),
      h("span", { class: "stream" }, JSON.stringify(a.preview_text))));
    body.replaceChildren(h("div", { class: "stat" }, `${r.greedy ? "greedy (temperature 0): the chain keeps one token; the others by raw probability" : `temperature ${r.temperature}, seed ${r.seed}`} · each with the engine's greedy next ${r.alternatives[0]?.preview_ids.length ?? 0} tokens · click one for its trajectories`), ...rows);
    box.dataset.ready = "true";
  } catch (e) { body.replaceChildren(h("div", { class: "note" }, String(e.message || e))); }
}

async function trajectories(at, alt, base, body) {
  const original = state.generated.slice(at);
  const runs = await Promise.all(TRAJECTORY_SETTINGS.map((t) => api("journey/trajectory", { ...base, ...t, token: alt.id, max_tokens: Math.max(8, original.length) })));
  const chips = (ids, other) => ids.map((id, i) => h("span", { class: "tok" + (other && other[i] !== id ? " diverge" : "") }, String(id)));
  const rows = runs.map((r) => h("div", { class: "trajectory", "data-branch-trajectory": "", "data-token-ids": r.token_ids.join(","), "data-prefix-reused": String(r.prefix_reused) },
    h("div", { class: "stat" }, `${r.greedy ? "greedy" : `temperature ${r.temperature}, seed ${r.seed}`} · ${r.prefix_reused} of ${r.prompt_tokens} prompt tokens from the prefix cache (the engine's counter)`),
    h("pre", { class: "stream" }, r.text), h("div", { class: "tokens" }, chips(r.token_ids, original))));
  body.append(h("div", { class: "trajectories" }, h("div", { class: "stat" }, `from "${alt.token}" at generated token ${at + 1}; the journey's own continuation, ids where a trajectory differs from it outlined:`),
    h("div", { class: "tokens" }, chips(original, null)), ...rows));
}

// the merges that build one token, replayed with the model's own merge list (POST bpe)
async function showMerges(t, box) {
  try {
    const r = await api("bpe", { word: t.text });
    box.replaceChildren(h("div", { class: "note" }, `"${t.token}" (id ${t.id}): the pair of lowest rank merges first`),
      ...r.pieces.flatMap((p) => [h("div", { class: "merge-step" }, "start: ", p.start.map((x) => `[${x}]`).join(" ")),
        ...p.steps.map((st) => h("div", { class: "merge-step" }, h("b", {}, `rank ${st.rank}: ${st.pair[0]} + ${st.pair[1]}`), "  →  ", st.symbols.map((x) => `[${x}]`).join(" ")))]));
  } catch (e) { box.replaceChildren(h("div", { class: "note" }, String(e.message || e))); }
}

const draw = {
  tokens(v) {
    const merges = h("div", { class: "bpe", "aria-live": "polite" });
    const chip = (t) => {
      const e = tokenEl(t, t.generated);
      if (t.special || !t.text.trim()) return e;
      return h("span", { onclick: () => showMerges(t, merges), title: "show the BPE merges that build this token" }, e);
    };
    return [h("div", { class: "stat" }, `${v.prompt_tokens} prompt tokens + ${v.tokens.length - v.prompt_tokens} generated · click a token for its BPE merges`),
      h("div", { class: "tokens" }, v.tokens.map(chip)), merges];
  },
  embedding(v) {
    const e = v.embedding, max = Math.max(...e.values.map(Math.abs), 1e-6);
    return [h("div", { class: "stat" }, `token ${e.token} (id ${e.id}): ${e.hidden} numbers, norm ${e.norm}`),
      h("div", { class: "vec", role: "img", "aria-label": "first values of the embedding row" },
        e.values.map((x) => h("span", { style: `background:${color(x, -max, max, true)}`, title: x }, x.toFixed(3))))];
  },
  positions(v) {
    const p = v.positions;
    if (!p.rope) return [h("div", { class: "stat" }, `position ${p.position}: this model learns a position vector instead of rotating`)];
    return [h("div", { class: "stat" }, `position ${p.position}, ${p.num_pairs} dimension pairs (${p.pairs.length} shown)`),
      table(["pair", "rate", "turns", "angle (rad)", "cos", "sin"], p.pairs.map((r) => [r.pair, r.rate.toExponential(2), r.turns, r.angle, r.cos, r.sin]))];
  },
  layers(v) {
    const maxN = Math.max(...v.layers.map((l) => l.norm_out));
    const rows = v.layers.map((l) => {
      const best = l.heads.map((hs, i) => ({ i, k: hs[0] })).sort((a, b) => b.k.weight - a.k.weight).slice(0, 2);
      return [l.layer, `${l.norm_in} → ${l.norm_mid} → ${l.norm_out}`,
        h("span", { class: "bar", style: `width:${Math.round(80 * l.norm_out / maxN)}px` }),
        best.map((b) => `h${b.i}: ${b.k.token}@${b.k.position} (${b.k.weight})`).join(", "),
        `${l.lens.token} (${l.lens.prob})`, l.ms];
    });
    return [table(["layer", "‖h‖ in → after attention → after MLP", "", "strongest heads (key@position, weight)", "logit lens top-1", "ms"], rows)];
  },
  final(v) {
    const max = v.final.top[0].prob;
    return [h("div", { class: "stat" }, `‖h‖ before the norm ${v.final.norm_in}; ${v.final.vocab} logits`),
      table(["token", "logit", "p", ""], v.final.top.map((c) => [c.token, c.logit, c.prob, h("span", { class: "bar", style: `width:${Math.round(120 * c.prob / max)}px` })]))];
  },
  sampler(v) {
    const s = v.sampler, k = s.kept_counts;
    return [h("div", { class: "stat" }, s.greedy ? "greedy: the largest logit wins" : `kept after top-k ${k.top_k}, top-p ${k.top_p}, min-p ${k.min_p} of ${s.vocab_size}`),
      table(["token", "p raw", "p after temperature", "p final"], s.candidates.slice(0, 8).map((c) => [
        h("span", { class: c.id === s.chosen.id ? "chosen" : c.kept.min_p ? "kept" : "cut" }, c.token), c.p_raw, c.p_temperature, c.p_final]))];
  },
  choice(v) {
    const c = v.choice;
    return [h("div", { class: "tokens" }, tokenEl(c, false)), h("div", { class: "stat" }, `id ${c.id}, p = ${c.prob}${c.is_eos ? " (end of generation)" : ""}`)];
  },
  commitment() {
    const cells = state.commits.map((c) => {
      const at = c.top1 ?? c.layers, late = c.top1 === null || c.top1 >= c.layers - 1;
      const shade = color(at, 0, c.layers, false);
      return h("span", { class: "tok commit" + (late ? " late" : ""), style: `border-bottom:4px solid ${shade}`, "data-commit-layer": c.top1 === null ? "none" : String(c.top1),
        "data-commit-top3": c.top3 === null ? "none" : String(c.top3),
        title: `top-1 from layer ${c.top1 ?? "– (never)"}, top-3 from layer ${c.top3 ?? "– (never)"} of ${c.layers}; ranks by layer: ${c.ranks.join(" ")}` },
        c.token, h("small", {}, c.top1 === null ? "–" : `L${c.top1}`));
    });
    const late = state.commits.filter((c) => c.top1 === null || c.top1 >= c.layers - 1).length;
    return [h("div", { class: "stat" }, `${state.commits.length} tokens · ${late} settled only at the last layer (red)`),
      h("div", { class: "tokens" }, cells)];
  },
  detokenizer(v) {
    return [h("div", { class: "stat" }, `new text: ${JSON.stringify(v.detokenizer.delta)}`),
      h("pre", { class: "stream" }, state.prompt + v.detokenizer.after)];
  },
  kv(v) {
    const k = v.kv;
    return [h("div", { class: "stat" }, `${k.tokens} tokens in ${k.blocks.length} block${k.blocks.length === 1 ? "" : "s"} of ${k.block_size} · ${k.bytes_per_token} B per token`),
      h("div", { class: "blocks", role: "img", "aria-label": `${k.blocks.length} KV blocks` }, k.blocks.map((n, i) =>
        h("span", { class: "blk", title: `block ${i}: ${n}/${k.block_size}` }, h("i", { style: `width:${Math.round(100 * n / k.block_size)}%` }))))];
  },
};

function render(v) {
  for (const [name] of STAGES) {
    const el = document.querySelector(`#journey [data-stage="${name}"]`);
    stageBox(name).replaceChildren(...draw[name](v));
    el.dataset.ready = "true";
  }
  $("journey-meta").textContent = `step ${state.generated.length + 1} · ${v.step_ms} ms`;
}

async function step() {
  if (state.busy) return;
  state.busy = true;
  try {
    const v = await api("journey/step", { prompt: state.prompt, chat: state.chat, generated: state.generated, ...settings() });
    state.commits.push({ ...v.commitment, token: v.choice.token });
    state.views.push(v);
    render(v);
    state.generated.push(v.choice.id);
    $("journey-out").append(tokenEl(v.choice, true, true));
    if (v.choice.is_eos) state.playing = false;
  } catch (e) {
    state.playing = false;
    showError("journey", e);
  } finally {
    state.busy = false;
  }
}

async function start() {
  state.prompt = $("journey-prompt").value;
  state.chat = $("journey-chat").checked;
  state.generated = [];
  state.commits = [];
  state.views = [];
  $("journey-out").replaceChildren();
  document.querySelectorAll("#journey [data-stage]").forEach((e) => delete e.dataset.ready);
  await step();
}

async function play() {
  if (state.playing) { state.playing = false; return; }
  state.playing = true;
  $("journey-play").textContent = "Stop";
  while (state.playing && state.generated.length < 64) await step();
  state.playing = false;
  $("journey-play").textContent = "Play";
}

// -- interventions: zero-ablate a head, an attention block or an MLP (POST ablate) ------------------
function ablationStage() {
  const layer = h("input", { id: "ablate-layer", type: "number", min: "0", value: "0", size: "3", "aria-label": "layer" });
  const kind = h("select", { id: "ablate-kind", "aria-label": "what to ablate" }, ...["head", "attention", "mlp"].map((k) => h("option", { value: k }, k)));
  const head = h("input", { id: "ablate-head", type: "number", min: "0", value: "0", size: "3", "aria-label": "head" });
  const body = h("div", { class: "body" });
  const box = h("div", { class: "stage", "data-stage": "ablation" }, h("h3", {}, "Intervene: zero-ablate a part ", badge("measured")),
    h("p", { class: "note" }, "Zero one head's output, a whole attention block's or an MLP's in one layer, for the next token and the greedy continuation: the distribution before and after (KL divergence), and the text. Each side is a traced pass of the engine, in a pass of its own."),
    h("div", { class: "row" }, h("label", {}, "layer ", layer), h("label", {}, "part ", kind), h("label", {}, "head ", head),
      h("button", { id: "ablate-go", onclick: () => runAblation(body, box) }, "Ablate")), body);
  return box;
}

async function runAblation(body, box) {
  const prompt = state.prompt || $("journey-prompt").value;
  body.replaceChildren(h("div", { class: "note" }, "running the plain and the ablated passes…"));
  try {
    const r = await api("ablate", { prompt, chat: state.chat, generated: state.generated, layer: Number($("ablate-layer").value),
      kind: $("ablate-kind").value, head: Number($("ablate-head").value), continue_tokens: 6 });
    const side = (name, s) => [name, s.top.map((c) => `${c.token} ${c.prob}`).join(" · "), JSON.stringify(s.continuation)];
    body.replaceChildren(h("div", { class: "stat" }, `${r.kind}${r.head === null ? "" : ` ${r.head}`} of layer ${r.layer}: KL(plain ‖ ablated) = ${r.kl} nats${r.top_changed ? " · the top token changed" : ""}`),
      table(["", "top 5 next tokens", "greedy continuation"], [side("plain", r.plain), side("ablated", r.ablated)]));
    box.dataset.ready = "true";
  } catch (e) { body.replaceChildren(h("div", { class: "note" }, String(e.message || e))); }
}

// -- activation patching: the patch lens (POST patch) --------------------------------------------------
function patchingStage() {
  const clean = h("input", { id: "patch-clean", class: "wide", style: "width:min(28em, 70vw)", value: "The Eiffel Tower is in the city of", "aria-label": "prompt A" });
  const corrupt = h("input", { id: "patch-corrupt", class: "wide", style: "width:min(28em, 70vw)", value: "The Colosseum is in the city of", "aria-label": "prompt B" });
  const body = h("div", { class: "body" });
  const box = h("div", { class: "stage", "data-stage": "patching" }, h("h3", {}, "Patch: which layer carries the answer ", badge("measured")),
    h("p", { class: "note" }, "Two prompts of the same length with different answers. For each layer, prompt A runs with its last position's residual stream after that layer replaced by prompt B's: the bar is how much of B's answer that restores (the logit difference between B's and A's top tokens, 0 = A's, 1 = B's)."),
    h("div", { class: "row" }, h("label", {}, "A ", clean)), h("div", { class: "row" }, h("label", {}, "B ", corrupt),
      h("button", { id: "patch-go", onclick: () => runPatch(body, box) }, "Patch")), body);
  return box;
}

async function runPatch(body, box) {
  body.replaceChildren(h("div", { class: "note" }, "one traced pass per layer…"));
  try {
    const r = await api("patch", { clean: $("patch-clean").value, corrupt: $("patch-corrupt").value, chat: false });
    body.replaceChildren(h("div", { class: "stat" }, `A answers ${r.answer_clean.token}, B answers ${r.answer_corrupt.token}; logit difference ${r.logit_diff_clean} (A) → ${r.logit_diff_corrupt} (B)`),
      table(["layer", "restored", ""], r.layers.map((l) => [l.layer, l.restored.toFixed(3),
        h("span", { class: "bar", "data-restored": String(l.restored), style: `width:${Math.round(120 * Math.max(0, Math.min(1, l.restored)))}px` })])));
    box.dataset.ready = "true";
  } catch (e) { body.replaceChildren(h("div", { class: "note" }, String(e.message || e))); }
}

// -- the served weights against a float32 reference, layer by layer (POST quant/layers) ------------
function quantDiffStage() {
  const body = h("div", { class: "body" });
  const box = h("div", { class: "stage", "data-stage": "quantization-diff" }, h("h3", {}, "Quantization diff: where the served run drifts ", badge("measured")),
    h("p", { class: "note" }, "The journey's prompt traced on the served model (its quantized codes, bf16) and on a float32 reference of the same file: per layer, the residual streams' cosine similarity and their relative difference, and the KL divergence of the next token at the head. The reference is built on first use."),
    h("div", { class: "row" }, h("button", { id: "quantdiff-go", onclick: () => runQuantDiff(body, box) }, "Compare with float32")), body);
  return box;
}

async function runQuantDiff(body, box) {
  body.replaceChildren(h("div", { class: "note" }, "tracing both models…"));
  try {
    const r = await api("quant/layers", { prompt: state.prompt || $("journey-prompt").value, chat: state.chat });
    const worst = Math.max(...r.layers.map((l) => l.rel), 1e-9);
    body.replaceChildren(h("div", { class: "stat" }, `${r.prompt_tokens} tokens · served ${r.served.dtype}, ${r.served.weights.join(", ")} · KL(reference ‖ served) of the next token ${r.kl_next} nats`),
      table(["layer", "cosine", "relative difference", ""], r.layers.map((l) => [l.layer, l.cos.toFixed(5), l.rel.toFixed(4),
        h("span", { class: "bar", "data-rel": String(l.rel), style: `width:${Math.round(120 * l.rel / worst)}px` })])));
    box.dataset.ready = "true";
  } catch (e) { body.replaceChildren(h("div", { class: "note" }, String(e.message || e))); }
}

// -- a journey as one file: every step's data, the model's name and digest -------------------------
function exportJourney() {
  if (!state.views.length) return;
  const last = state.views[state.views.length - 1];
  const doc = { format: FORMAT, model: last.model, prompt: state.prompt, chat: state.chat, settings: settings(),
    generated: state.generated, steps: state.views };
  const url = URL.createObjectURL(new Blob([JSON.stringify(doc)], { type: "application/json" }));
  const a = h("a", { href: url, download: `journey-${(last.model?.name || "model").replace(/\W+/g, "-")}.json` });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

// shows an exported journey again from its file alone: no request to the server
async function importJourney(file) {
  try {
    const doc = JSON.parse(await file.text());
    if (doc.format !== FORMAT || !Array.isArray(doc.steps) || !doc.steps.length) throw new Error(`not a ${FORMAT} file`);
    state.playing = false;
    Object.assign(state, { prompt: doc.prompt, chat: doc.chat, generated: [], commits: [], views: [] });
    $("journey-prompt").value = doc.prompt;
    $("journey-out").replaceChildren();
    for (const v of doc.steps) {
      state.commits.push({ ...v.commitment, token: v.choice.token });
      state.views.push(v);
      state.generated.push(v.choice.id);
      const chip = tokenEl(v.choice, true, false);  // (no branching: the file has no model behind it)
      chip.dataset.journeyTokenId = String(v.choice.id);
      $("journey-out").append(chip);
    }
    render(doc.steps[doc.steps.length - 1]);
    $("journey-meta").textContent = `opened from a file: ${doc.model?.name ?? "?"} (sha256 ${String(doc.model?.digest ?? "?").slice(0, 12)}…), ${doc.steps.length} steps`;
  } catch (e) { showError("journey", e); }
}

export function journey() {
  const stages = STAGES.map(([name, title, note]) => h("div", { class: "stage", "data-stage": name },
    h("h3", {}, title, " ", badge(PROVENANCE[name])), h("p", { class: "note" }, note), h("div", { class: "body" })));
  $("journey-stages").replaceChildren(...stages);
  $("journey-out").after(h("div", { class: "stage branch", "data-stage": "branch" }, h("h3", {}, "Branch: what else could have come ", badge("measured")),
    h("p", { class: "note" }, "Click a generated token: the sampler's most likely alternatives there, each with the engine's greedy preview; click one to generate its trajectory (greedy and sampled, side by side with the journey's own), the prefix served from the KV cache."),
    h("div", { class: "body" }, h("div", { class: "note" }, "No branch yet."))));
  $("journey-stages").after(ablationStage(), patchingStage(), quantDiffStage());
  $("journey-start").addEventListener("click", start);
  $("journey-next").addEventListener("click", () => (state.prompt ? step() : start()));
  $("journey-play").addEventListener("click", play);
  $("journey-export").addEventListener("click", exportJourney);
  $("journey-import").addEventListener("change", (e) => e.target.files[0] && importJourney(e.target.files[0]));
  $("journey").dataset.ready = "1";  // the stages say data-ready="true" once a step has drawn them
}
