"""The inspector's third-round views (branch, commitment, ablation, patching, quantization diff)
on the catalog's Qwen2.5-Coder-0.5B and Gemma 3 270M, through the server, each against a fresh
request or its own definition (slow: two real models; `pytest -m slow`)."""

from __future__ import annotations

import httpx
import pytest

from nextoken import LLM
from nextoken.sampling_params import SamplingParams
from tests.helpers.server import LiveServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def served(request):
    from nextoken.catalog import pull

    llm = LLM(str(pull(request.param, progress=False)), max_num_seqs=4)
    srv = LiveServer(llm, request.param)
    yield srv, llm
    srv.stop()
    llm.close()


def post(srv, path, body):
    r = httpx.post(f"{srv.url}/inspect/api/{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_new_view_on_the_model(served):
    srv, llm = served
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt)
    greedy = list(llm.generate(ids, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids)
    step = post(srv, "journey/step", {"prompt": prompt, "generated": greedy[:1]})
    c = step["commitment"]
    assert step["choice"]["id"] == greedy[1] and c["ranks"][-1] == 0 and c["top1"] is not None
    branch = post(srv, "journey/branch", {"prompt": prompt, "generated": greedy[:1], "alternatives": 3, "preview": 4})
    alt = branch["alternatives"][1]["id"]
    assert branch["alternatives"][0]["id"] == greedy[1]
    t = post(srv, "journey/trajectory", {"prompt": prompt, "generated": greedy[:1], "token": alt, "max_tokens": 6})
    fresh = llm.generate(ids + greedy[:1] + [alt], SamplingParams(temperature=0, max_tokens=6))[0]
    assert t["token_ids"] == [alt] + list(fresh.outputs[0].token_ids)
    ab = post(srv, "ablate", {"prompt": prompt, "layer": 0, "kind": "attention", "continue_tokens": 2})
    assert ab["kl"] >= 0 and ab["plain"]["continuation_ids"] == greedy[:2]
    clean, corrupt = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
    if len(llm.tokenizer.encode(clean)) == len(llm.tokenizer.encode(corrupt)):
        patch = post(srv, "patch", {"clean": clean, "corrupt": corrupt})
        assert patch["layers"][-1]["restored"] == pytest.approx(1.0, abs=1e-3)
    quant = post(srv, "quant/layers", {"prompt": prompt})
    assert len(quant["layers"]) == llm.engine.config.num_layers and all(l["cos"] > 0.8 for l in quant["layers"])


def test_the_page_runs_every_new_view_on_the_model(served):
    """In the browser (playwright + chromium), on Qwen2.5-0.5B and Gemma 3 270M: a journey of three
    tokens, its commitment strip, a branch and its trajectories, an ablation, the patch lens
    (when the two prompts tokenize to as many tokens) and the quantization diff, each view drawn
    (data-ready), with no console error and no request leaving the host."""
    from tests.inspector.test_inspect_browser import CHROMIUM, shoot, sync_playwright, watched_page

    if CHROMIUM is None or sync_playwright is None:
        pytest.skip("needs Debian's chromium and playwright, as tests/inspector/test_inspect_browser.py")
    srv, llm = served
    prompt = "The capital of France is"
    want = list(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids)
    same_length = len(llm.tokenizer.encode("The Eiffel Tower is in the city of")) == \
        len(llm.tokenizer.encode("The Colosseum is in the city of"))
    errors, outside = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = watched_page(browser, errors, outside)
        page.goto(f"{srv.url}/inspect")
        page.wait_for_selector("#journey[data-ready]", state="attached", timeout=60_000)
        page.fill("#journey-prompt", prompt)
        page.click("#journey-start")
        for n in (1, 2, 3):
            if n > 1:
                page.click("#journey-next")
            page.wait_for_function("n => document.querySelectorAll('[data-journey-token-id]').length >= n", arg=n,
                                   timeout=120_000)
        got = [int(x) for x in page.eval_on_selector_all("[data-journey-token-id]", "els => els.map(e => e.dataset.journeyTokenId)")]
        commits = page.eval_on_selector_all("[data-commit-layer]", "els => els.length")
        page.click("[data-journey-token-id] >> nth=1")
        page.wait_for_selector("[data-branch-alt]", timeout=120_000)
        page.click("[data-branch-alt] >> nth=1")
        page.wait_for_function("document.querySelectorAll('[data-branch-trajectory]').length === 3", timeout=120_000)
        page.select_option("#ablate-kind", "attention")
        page.click("#ablate-go")
        views = ["ablation", "quantization-diff"] + (["patching"] if same_length else [])
        if same_length:
            page.click("#patch-go")
        page.click("#quantdiff-go")
        for view in views:
            page.wait_for_selector(f'[data-stage="{view}"][data-ready="true"]', state="attached", timeout=300_000)
        shoot(page.locator("#journey"), f"journey-{srv.llm.engine.config.architecture}.png")
        browser.close()
    assert got == want and commits == 3
    assert not errors and not outside, (errors, outside)
