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
