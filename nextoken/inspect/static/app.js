// The inspector page: loads each widget from the server and feeds the live ones from one event stream.
import { $, api, liveUrl, showError, badge, WIDGET_PROVENANCE } from "./lib.js";
import { tokenizer, embeddings, positions, architecture } from "./text_widgets.js";
import { attention, timeline, sampling, beam } from "./run_widgets.js";
import { kvStatic, kvLive, kvContrast, batchingLive, specLive, specDemand, requestsLive, quantization, quantKl } from "./engine_widgets.js";
import { journey } from "./journey.js";

async function main() {
  let info;
  try {
    info = await api("info");
  } catch (e) {
    $("model-info").textContent = "cannot reach the inspector API: " + e.message;
    return;
  }
  $("model-info").textContent = `${info.model} · ${info.name} (${info.architecture}) · vocabulary ${info.vocab_size}`;
  document.body.dataset.model = info.model;
  journey();
  for (const [id, kinds] of Object.entries(WIDGET_PROVENANCE)) $(id)?.querySelector("h2")?.append(" ", ...kinds.map(badge));
  tokenizer();
  embeddings();
  const pending = [positions(), architecture(), kvStatic(), quantization(info.gguf)];
  sampling();
  // the engine runs one request at a time for these: chain them
  await attention();
  await timeline();
  await beam();
  await Promise.all(pending);
  architecture();  // now with the trace's time per layer
  const es = new EventSource(liveUrl());
  es.onmessage = (ev) => {
    const st = JSON.parse(ev.data);
    kvLive(st);
    batchingLive(st);
    specLive(st);
    requestsLive(st);
  };
  es.onerror = () => showError("w-batching", new Error("the live stream was interrupted; it reconnects by itself"));
  $("kv-contrast-go").addEventListener("click", kvContrast);
  $("spec-go").addEventListener("click", specDemand);
  $("qkl-go").addEventListener("click", quantKl);
  $("demo-go").addEventListener("click", () => api("demo", { count: 6, max_tokens: 48 }).catch((e) => showError("w-batching", e)));
  document.body.dataset.loaded = "1";
}

main();
