"""The inspector page in a real browser: Playwright for Python driving Debian's `chromium`
(Playwright's own browser download cannot work here). Each widget must render with the server's
numbers, the console must stay free of errors, and no request may leave 127.0.0.1. With
``NEXTOKEN_SCREENSHOTS=1`` a screenshot of each widget, journey stage and page width is saved under
build/test-output/inspector/ for a person to look at (about 40 of them: 10 s a run, so off by default).

Without chromium or Playwright these tests skip with one line saying what to install."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from nextoken import LLM, SamplingParams
from tests.helpers.server import LiveServer

CHROMIUM = os.environ.get("NEXTOKEN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
OUT = Path(__file__).resolve().parents[2] / "build" / "test-output" / "inspector"
SCREENSHOTS = os.environ.get("NEXTOKEN_SCREENSHOTS", "") not in ("", "0")
WIDGETS = ["w-tokenizer", "w-embeddings", "w-positions", "w-architecture", "w-attention", "w-lens", "w-timeline",
           "w-sampling", "w-beam", "w-kv", "w-batching", "w-spec", "w-quant", "w-requests"]

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None

pytestmark = [pytest.mark.browser, pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="browser tests need Debian's chromium (apt-get install chromium) and playwright (pip install playwright)")]


def shoot(target, name: str, **kw) -> None:
    """Save `target`'s screenshot (a page's or a locator's) as OUT/`name` when
    ``NEXTOKEN_SCREENSHOTS=1`` (the module's comment)."""
    if SCREENSHOTS:
        OUT.mkdir(parents=True, exist_ok=True)
        target.screenshot(path=str(OUT / name), **kw)


def watched_page(browser, errors: list, outside: list, width: int = 1280):
    """A page that aborts any request leaving the host (recorded in `outside`) and records its
    console errors and uncaught exceptions in `errors`."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.route("**/*", lambda route: route.continue_() if urlparse(route.request.url).hostname == "127.0.0.1"
               else (outside.append(route.request.url), route.abort()))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page


@pytest.fixture(scope="module")
def srv(smollm2_path):
    s = LiveServer(LLM(str(smollm2_path)), "smollm2", api_key="secret")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    """One chromium for the module's pages."""
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def page_run(srv, browser):
    """Open the page once, wait for every widget, click the demo button; what was seen, and the
    page, left open (the journey test goes on on it rather than loading every widget again)."""
    outside, errors = [], []
    page = browser.new_page(viewport={"width": 1300, "height": 900})

    def guard(route):
        host = urlparse(route.request.url).hostname
        if host not in ("127.0.0.1",) and not route.request.url.startswith("data:"):
            outside.append(route.request.url)
            return route.abort()
        return route.continue_()

    page.route("**/*", guard)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    start = time.perf_counter()
    page.goto(f"{srv.url}/inspect?key=secret")
    page.wait_for_selector("body[data-loaded='1']", timeout=90_000, state="attached")
    page.wait_for_function("[...document.querySelectorAll('section')].every(s => s.dataset.ready)", timeout=60_000)
    load_s = time.perf_counter() - start
    before = _finished_ids(srv)
    with page.expect_response(lambda r: "/inspect/api/demo" in r.url, timeout=30_000) as demo:
        page.click("#demo-go")
    assert demo.value.ok, demo.value.text()
    sent = demo.value.json()["sent"]
    end = time.time() + 120
    while len(_finished_ids(srv) - before) < sent and time.time() < end:
        time.sleep(0.1)
    assert len(_finished_ids(srv) - before) >= sent, "the demo requests did not finish"
    # the live view has caught up once it lists the newest finished request
    newest = max((i for i in _finished_ids(srv) if re.search(r"-\d+$", i)),  # (a beam's steps: <id>/beam<k>.<i>)
                 key=lambda i: int(i.rsplit("-", 1)[1]))
    page.wait_for_function("id => new RegExp('\\\\b' + id + '\\\\b').test(document.querySelector('#w-requests').innerText)",
                           arg=newest, timeout=30_000)
    seen = {w: page.get_attribute(f"#{w}", "data-ready") for w in WIDGETS}
    texts = {w: page.inner_text(f"#{w}") for w in WIDGETS}
    recent = _finished_ids(srv)  # before the on-demand views send their own requests
    boxes = {w: page.locator(f"#{w}").bounding_box() for w in WIDGETS}
    for w in WIDGETS:
        shoot(page.locator(f"#{w}"), f"{w}.png")
    shoot(page, "page.png", full_page=True)
    on_demand = _drive_on_demand_views(page)
    layout = _layout_at_widths(page, (1280, 800))
    print(f"inspector page loaded (every widget drawn) in {load_s:.2f} s")
    return {"ready": seen, "texts": texts, "boxes": boxes, "errors": errors, "outside": outside, "on_demand": on_demand,
            "layout": layout, "recent": recent, "page": page}


GRAMMAR_PROMPT, GRAMMAR_REGEX = "The year it happened was", "(19|20)[0-9]{2}"


def _drive_on_demand_views(page) -> dict:
    """Use the views that run on demand as a learner would (a diagram block from the keyboard,
    the grammar mask, quantization's cost, speculation, the KV cache on and off); their texts."""
    page.focus('#arch-svg g[data-part="mlp"]')  # a clickable chart part works from the keyboard too
    page.keyboard.press("Enter")
    seen = {"arch": page.inner_text("#arch-detail")}
    page.fill("#smp-prompt", GRAMMAR_PROMPT)
    page.select_option("#smp-kind", "regex")
    page.fill("#smp-constraint", GRAMMAR_REGEX)
    waits = {"w-sampling": ("#smp-constraint", None, "#smp-meta", "the grammar allows"),
             "w-quant": ("#qkl-go", "click", "#qkl-meta", "mean KL"),
             "w-spec": ("#spec-go", "click", "#spec-meta", "target passes"),
             "w-kv": ("#kv-contrast-go", "click", "#kv-contrast-meta", "ms per token")}
    for widget, (control, action, meta, done) in waits.items():
        if action == "click":
            page.click(control)
        page.wait_for_function("([m, d]) => document.querySelector(m).textContent.includes(d)", arg=[meta, done],
                               timeout=120_000)
        seen[widget] = page.inner_text(f"#{widget}")
        shoot(page.locator(f"#{widget}"), f"{widget}-on-demand.png")
    seen["kv_series"] = page.eval_on_selector_all("#kv-contrast polyline",
                                                  "els => els.map(e => e.getAttribute('points').trim().split(' ').length)")
    return seen


def _layout_at_widths(page, widths) -> dict:
    """At each viewport width (the charts' sizes do not depend on it): the overlapping SVG texts
    and the horizontal scroll (a full-page screenshot with ``NEXTOKEN_SCREENSHOTS=1``)."""
    out = {}
    for width in widths:
        page.set_viewport_size({"width": width, "height": 900})
        page.wait_for_timeout(200)  # the reflow
        out[width] = page.evaluate(OVERLAPS_JS)
        shoot(page, f"page-{width}.png", full_page=True)
    return out


def _finished_ids(srv) -> set[str]:
    state = httpx.get(f"{srv.url}/inspect/api/state", headers={"Authorization": "Bearer secret"}).json()
    return {r["request_id"] for r in state["requests"]}


def test_every_widget_renders_without_console_errors(page_run):
    assert not page_run["errors"], page_run["errors"]
    assert not page_run["outside"], page_run["outside"]
    missing = [w for w, r in page_run["ready"].items() if not r]
    assert not missing, missing
    for w, box in page_run["boxes"].items():  # each drawn at a size a reader can see
        assert box and box["width"] > 300 and box["height"] > 150, (w, box)


def test_widgets_show_the_servers_numbers(page_run, srv):
    auth = {"Authorization": "Bearer secret"}
    api = f"{srv.url}/inspect/api"
    t = page_run["texts"]
    tok = httpx.post(f"{api}/tokenize", json={"text": "Tokenization is unbelievable: artificial intelligence 😀"},
                     headers=auth).json()
    assert f"{tok['count']} tokens" in t["w-tokenizer"]
    kv = httpx.get(f"{api}/kv", headers=auth).json()
    assert f"= {kv['bytes_per_token']} B" in t["w-kv"]
    an = httpx.post(f"{api}/analogy", json={}, headers=auth).json()
    assert f"ranks #{an['target']['rank']}" in t["w-embeddings"]
    arch = httpx.get(f"{api}/architecture", headers=auth).json()
    assert f"× {arch['layers']} layers" in t["w-architecture"]
    assert "30 layers × 9 heads" in t["w-attention"] and "embedding" in t["w-lens"]
    assert "TTFT" in t["w-timeline"] and "seeded draw" in t["w-sampling"] and "best beam" in t["w-beam"]
    assert "Q4_1" in t["w-quant"] and "without speculative decoding" in t["w-spec"]
    state = httpx.get(f"{api}/state", headers=auth).json()
    assert f"{state['stats']['num_blocks']} blocks" in t["w-kv"]
    # the table shows the requests finished when it was drawn; widgets drawn later ran more, so
    # every id it shows is among the server's recent requests (not necessarily the newest)
    shown = set(re.findall(r"async-\d+", t["w-requests"]))
    assert shown and shown <= page_run["recent"]


def test_journey_follows_greedy_generate_stage_by_stage(page_run, srv, smollm2_llm, browser, tmp_path):
    """The journey view, on the page whose widgets have all drawn: Start then Next token four
    times gives greedy `LLM.generate`'s five ids (as data-journey-token-id), every stage drawn
    (data-ready) with the step's numbers, no console error and no outside request (a screenshot
    of each stage with ``NEXTOKEN_SCREENSHOTS=1``)."""
    prompt = "The capital of France is"
    want = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids
    page, errors, outside = page_run["page"], page_run["errors"], page_run["outside"]
    page.set_viewport_size({"width": 1280, "height": 900})  # (the layout check left it at 800)
    page.wait_for_selector("#journey[data-ready]", state="attached", timeout=60_000)
    page.wait_for_selector("body[data-loaded='1']", timeout=90_000, state="attached")  # the widgets' own runs done
    widget_provenance = page.eval_on_selector_all("section.card[id^='w-']", "els => els.map(e => [e.id, "
                                                  "[...e.querySelectorAll('h2 [data-provenance]')].map(p => p.dataset.provenance)])")
    page.fill("#journey-prompt", prompt)
    page.click("#journey-start")
    page.wait_for_selector("[data-journey-token-id]", timeout=60_000)
    for n in range(2, 6):
        page.click("#journey-next")
        page.wait_for_function("n => document.querySelectorAll('[data-journey-token-id]').length >= n", arg=n,
                               timeout=60_000)
    got = [int(x) for x in page.eval_on_selector_all("[data-journey-token-id]",
                                                      "els => els.map(e => e.dataset.journeyTokenId)")]
    stages = page.eval_on_selector_all("#journey [data-stage]", "els => els.map(e => [e.dataset.stage, e.dataset.ready])")
    commits = page.eval_on_selector_all('[data-stage="commitment"] [data-commit-layer]',
                                        "els => els.map(e => e.dataset.commitLayer)")
    provenance = page.eval_on_selector_all("#journey [data-stage]", "els => els.map(e => [e.dataset.stage, "
                                           "[...e.querySelectorAll('[data-provenance]')].map(p => p.dataset.provenance)])")
    page.click("[data-journey-token-id] >> nth=1")  # branch at the second generated token
    page.wait_for_selector('[data-stage="branch"] [data-branch-alt]', timeout=60_000)
    alts = page.eval_on_selector_all("[data-branch-alt]", "els => els.map(e => [+e.dataset.tokenId, +e.dataset.prob])")
    page.click("[data-branch-alt] >> nth=1")
    page.wait_for_function("document.querySelectorAll('[data-branch-trajectory]').length === 3", timeout=60_000)
    trajectories = page.eval_on_selector_all("[data-branch-trajectory]", "els => els.map(e => "
                                             "[e.dataset.tokenIds.split(',').map(Number), +e.dataset.prefixReused])")
    branch_ready = page.get_attribute('[data-stage="branch"]', "data-ready")
    shoot(page.locator('[data-stage="branch"]'), "journey-branch.png")
    page.fill("#ablate-layer", "0")
    page.select_option("#ablate-kind", "mlp")
    page.click("#ablate-go")
    page.wait_for_selector('[data-stage="ablation"][data-ready="true"]', state="attached", timeout=60_000)
    ablation_text = page.inner_text('[data-stage="ablation"]')
    shoot(page.locator('[data-stage="ablation"]'), "journey-ablation.png")
    page.click("#patch-go")
    page.wait_for_selector('[data-stage="patching"][data-ready="true"]', state="attached", timeout=90_000)
    restored = page.eval_on_selector_all('[data-stage="patching"] [data-restored]', "els => els.map(e => +e.dataset.restored)")
    shoot(page.locator('[data-stage="patching"]'), "journey-patching.png")
    page.click("#quantdiff-go")
    page.wait_for_selector('[data-stage="quantization-diff"][data-ready="true"]', state="attached", timeout=120_000)
    rels = page.eval_on_selector_all('[data-stage="quantization-diff"] [data-rel]', "els => els.map(e => +e.dataset.rel)")
    page.click('#journey [data-stage="tokens"] [role="button"] >> nth=1')  # " capital": its BPE merges
    page.wait_for_function("document.querySelector('#journey .bpe').textContent.includes('rank')", timeout=30_000)
    texts = {name: page.inner_text(f'#journey [data-stage="{name}"]') for name, _ in stages}
    for name, _ in stages:
        shoot(page.locator(f'#journey [data-stage="{name}"]'), f"journey-{name}.png")
    shoot(page.locator("#journey"), "journey.png")
    with page.expect_download() as dl:  # the journey as one file ...
        page.click("#journey-export")
    exported = tmp_path / "journey.json"
    dl.value.save_as(exported)
    fresh_page = watched_page(browser, errors, outside)  # ... shown again from it alone
    fresh_page.goto(f"{srv.url}/inspect?key=secret")
    fresh_page.wait_for_selector("#journey[data-ready]", state="attached", timeout=60_000)
    asked = []
    fresh_page.on("request", lambda r: asked.append(r.url) if "/journey" in r.url else None)
    fresh_page.set_input_files("#journey-import", str(exported))
    fresh_page.wait_for_function("document.querySelectorAll('#journey-out [data-journey-token-id]').length === 5",
                                 timeout=30_000)
    reopened = [int(x) for x in fresh_page.eval_on_selector_all("[data-journey-token-id]",
                                                                 "els => els.map(e => e.dataset.journeyTokenId)")]
    reopened_text = fresh_page.inner_text('#journey [data-stage="detokenizer"]')
    big = fresh_page.evaluate("""async () => {  // an answer over 1 MiB shows its bytes as they arrive
        const { api } = await import('/inspect/static/lib.js');
        const t = await api('trace', { prompt: 'word '.repeat(400) });
        const a = await api(`trace/${t.trace_id}/attention?layer=0`);
        return [JSON.stringify(a).length, Number(document.getElementById('progress').dataset.bytes || 0)];
    }""")
    fresh_page.close()
    assert got == want
    assert [n for n, _ in stages] == ["branch", "tokens", "embedding", "positions", "layers", "final", "sampler",
                                      "choice", "commitment", "detokenizer", "kv", "ablation", "patching",
                                      "quantization-diff"]
    assert len(rels) == 30 and all(r > 0 for r in rels)
    assert len(restored) == 30 and restored[-1] == pytest.approx(1.0, abs=1e-3)
    ablated = httpx.post(f"{srv.url}/inspect/api/ablate", json={"prompt": prompt, "generated": want, "layer": 0,
                                                               "kind": "mlp", "continue_tokens": 6},
                         headers={"Authorization": "Bearer secret"}, timeout=120).json()
    assert f"KL(plain ‖ ablated) = {ablated['kl']} nats" in ablation_text
    assert len(commits) == len(want) and all(c.isdigit() and int(c) < 30 for c in commits)  # greedy: all settle
    assert all(kinds and set(kinds) <= {"measured", "derived", "illustrative"} for _, kinds in provenance), provenance
    assert dict(provenance)["positions"] == ["derived"] and dict(provenance)["commitment"] == ["measured"]
    assert [w for w, _ in widget_provenance] == WIDGETS and all(kinds for _, kinds in widget_provenance), widget_provenance
    used = ("branch", "ablation", "patching", "quantization-diff")  # these are drawn once used
    assert all(ready == "true" for n, ready in stages if n not in used), stages
    assert branch_ready == "true" and alts[0] == [want[1], 1.0]  # greedy: the journey's own token first
    ids = smollm2_llm.tokenizer.encode(prompt)
    fresh = smollm2_llm.generate(ids + [want[0], alts[1][0]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert trajectories[0][0] == [alts[1][0]] + list(fresh.outputs[0].token_ids)  # greedy first, as a fresh request
    assert all(t[1] >= 0 for t in trajectories)
    doc = json.loads(exported.read_text())
    assert doc["format"] == "nextoken-journey/1" and doc["generated"] == want and len(doc["steps"]) == 5
    assert doc["model"]["digest"] == hashlib.sha256(Path(srv.llm.engine.model_path).read_bytes()).hexdigest()
    assert reopened == want and not asked and texts["detokenizer"] == reopened_text
    assert big[0] > 2**20 and big[1] >= big[0] - 4096  # the whole answer went through the progress reader
    assert not errors and not outside, (errors, outside)
    text = smollm2_llm.tokenizer.decode(want)
    assert text[:8] in texts["detokenizer"] or text.strip()[:8] in texts["detokenizer"]
    assert texts["layers"].count("\n") >= 30  # a row per layer
    merges = httpx.post(f"{srv.url}/inspect/api/bpe", json={"word": " capital"},
                        headers={"Authorization": "Bearer secret"}).json()
    last = merges["pieces"][-1]["steps"][-1]
    assert f"rank {last['rank']}" in texts["tokens"]


def test_on_demand_views_show_the_apis_numbers(page_run, srv):
    """The grammar mask in the sampling view, quantization's cost on a prompt and speculation on
    demand, driven by their controls on the open page: each shows what its API returns for the
    same input; a diagram block opens from the keyboard."""
    auth = {"Authorization": "Bearer secret"}
    api = f"{srv.url}/inspect/api"
    seen = page_run["on_demand"]
    assert seen["arch"].startswith("mlp")
    g = httpx.post(f"{api}/sample", json={"prompt": GRAMMAR_PROMPT, "regex": GRAMMAR_REGEX, "temperature": 0.8},
                   headers=auth).json()
    assert f"the grammar allows {g['kept_counts']['grammar']}" in seen["w-sampling"] and "refused" in seen["w-sampling"]
    kl = httpx.post(f"{api}/quant/kl", json={"prompt": "The quick brown fox jumps over the lazy dog. The quick brown fox"},
                    headers=auth).json()
    js_exp = f"{kl['kl_mean']:.3e}".replace("e-0", "e-").replace("e+0", "e+")  # JavaScript's toExponential(3)
    assert f"mean KL {js_exp}" in seen["w-quant"]
    assert f"same top token at {kl['top1_agreement'] * 100:.1f}% of {len(kl['positions'])} positions" in seen["w-quant"]
    sp = httpx.post(f"{api}/spec/run", json={"prompt": "one two three four five, one two three four five, one two",
                                             "num_speculative_tokens": 4, "temperature": 0, "max_tokens": 24},
                    headers=auth).json()
    assert f"ngram: {len(sp['token_ids'])} tokens in {sp['target_passes']} target passes" in seen["w-spec"]
    assert f"accepted {sp['accepted']}" in seen["w-spec"] and sp["text"].strip()[:10] in seen["w-spec"]
    # the KV cache on and off: the page asks for 24 tokens, so 23 decode steps each way after the prompt
    prompt = httpx.post(f"{api}/tokenize", json={"text": "The history of the printing press began"}, headers=auth).json()
    assert f"23 steps after a {prompt['count']}-token prompt" in seen["w-kv"]
    assert seen["kv_series"] == [23, 23]


OVERLAPS_JS = """() => {
  const bad = [];
  for (const svg of document.querySelectorAll("svg")) {
    const boxes = [...svg.querySelectorAll("text")].filter((t) => t.textContent.trim()).map((t) => {
      const b = t.getBoundingClientRect();
      return { text: t.textContent, x: b.x, y: b.y, w: b.width, h: b.height };
    });
    for (let i = 0; i < boxes.length; i++)
      for (let j = i + 1; j < boxes.length; j++) {
        const a = boxes[i], b = boxes[j];
        if (a.x + 0.5 < b.x + b.w && b.x + 0.5 < a.x + a.w && a.y + 0.5 < b.y + b.h && b.y + 0.5 < a.y + a.h)
          bad.push([svg.id, a.text, b.text]);
      }
  }
  const doc = document.documentElement;
  return { bad, scroll: doc.scrollWidth - doc.clientWidth };
}"""


@pytest.mark.parametrize("width", [1280, 800])
def test_no_overlapping_chart_text_and_no_horizontal_scroll(page_run, width):
    """After every widget has drawn, the on-demand charts included: no two text elements of one
    chart (SVG) overlap (by their bounding boxes), and the page needs no horizontal scroll at
    this width."""
    seen = page_run["layout"][width]
    assert seen["bad"] == [], seen["bad"][:10]
    assert seen["scroll"] <= 0, f"{seen['scroll']} px of horizontal scroll at {width} px"
