"""A model fault in one request (its pass produces NaN logits) fails that request with a clear
error and leaves the others of its batch exactly as they are alone: offline, through `stream`,
and over HTTP (500 for the faulty request, 200 for the others, an error event mid-stream).

The fault is real, not a patched sampler: the tiny qwen2 model's embedding row of one token is
set to NaN before it is written to GGUF, so every pass over a prompt holding that token computes
NaN hidden states, and only that sequence's (attention never mixes sequences). qwen2's head is
untied, so the NaN row does not reach the other prompts' logits."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.errors import RequestFailed
from tests.helpers.server import LiveServer
from tests.tiny_models import tiny_hf_model, write_gguf

POISON = 77
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CLEAN = [[5, 17, 200, 33, 41], [9, 8, 7, 6, 5, 4, 3, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130],
         [250, 251, 252], [40, 41, 42, 43, 44, 45]]
FAULTY = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, POISON, 30]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    hf = tiny_hf_model("qwen2", seed=3)
    assert not hf.config.tie_word_embeddings
    with torch.no_grad():
        hf.model.embed_tokens.weight[POISON] = float("nan")
    path = tmp_path_factory.mktemp("fault") / "poisoned.gguf"
    write_gguf(hf, path, "qwen2")
    return path


@pytest.fixture(scope="module", params=[("float32", False), ("bfloat16", False), ("float32", True)],
                ids=["float32", "bfloat16", "float32-async"])
def llm(poisoned, request):
    """float32 (PyTorch layers), bf16 (our kernels: the C prefill and decode paths), and float32
    with async scheduling (the fault is read back a step after its pass)."""
    dtype, async_scheduling = request.param
    return LLM(str(poisoned), dtype=dtype, block_size=4, async_scheduling=async_scheduling)


def test_faulty_request_fails_and_the_batch_goes_on(llm):
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in CLEAN]
    outs = llm.generate(CLEAN[:2] + [FAULTY] + CLEAN[2:], GREEDY)
    bad = outs[2]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "non-finite logits" in bad.error and bad.request_id in bad.error
    good = outs[:2] + outs[3:]
    assert [o.outputs[0].token_ids for o in good] == alone
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in good)
    eng = llm.engine
    assert not eng.has_unfinished_requests() and all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    assert eng.stats()["num_failed"] >= 1
    # the faulty pass's blocks are not offered to later prompts with the same prefix
    assert not any(b.token_ids and POISON in b.token_ids for b in eng.kv.pool.cached.values())


def test_parallel_samples_fail_together(llm):
    out = llm.generate([FAULTY], SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=1))[0]
    assert out.error and [c.finish_reason for c in out.outputs] == ["error"] * 3


def test_stream_raises_request_failed(llm):
    with pytest.raises(RequestFailed, match="non-finite logits"):
        list(llm.stream(FAULTY, GREEDY))
    assert llm.generate([CLEAN[0]], GREEDY)[0].error is None  # the engine is fine afterwards


@pytest.fixture(scope="module")
def server(poisoned):
    srv = LiveServer(LLM(str(poisoned), dtype="float32"), "tiny")
    yield srv
    srv.stop()


def test_http_faulty_request_is_500_and_others_are_served(server):
    c = server.client()
    want = c.completions.create(model="tiny", prompt=CLEAN[1], max_tokens=8, temperature=0).choices[0].text
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="tiny", prompt=FAULTY, max_tokens=8, temperature=0)
    assert "non-finite logits" in e.value.message
    assert c.completions.create(model="tiny", prompt=CLEAN[1], max_tokens=8, temperature=0).choices[0].text == want
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    assert server.idle()


def test_http_stream_ends_with_an_error_event(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": FAULTY, "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200  # the stream had started: the error comes as an event
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "non-finite logits" in err["message"] and err["code"] == 500
    assert server.idle()


def test_beam_search_raises_request_failed(llm):
    with pytest.raises(RequestFailed, match="non-finite logits"):
        llm.beam_search([FAULTY], 2, 4)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_scoring_fails_the_faulty_request(llm):
    """Scoring alone (max_tokens=0, as `nextoken perplexity` and echo do) samples nothing, so the
    prompt log-probabilities are what must be checked; a clean prompt scored with it is kept."""
    score = SamplingParams(max_tokens=0, prompt_logprobs=1)
    alone = llm.generate([CLEAN[1]], score)[0].prompt_logprobs
    bad, good = llm.generate([FAULTY, CLEAN[1]], score)
    assert bad.error and "prompt log-probabilities" in bad.error and bad.outputs[0].finish_reason == "error"
    assert good.error is None and good.prompt_logprobs == alone
    eng = llm.engine
    assert not eng.has_unfinished_requests() and all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)


def test_perplexity_refuses_a_faulty_text(llm):
    from nextoken.evaluate.perplexity import perplexity

    text = llm.tokenizer.decode(FAULTY * 4)
    assert POISON in llm.tokenizer.encode(text, add_bos=False, parse_special=False)
    with pytest.raises(RequestFailed, match="non-finite"):
        perplexity(llm.engine, text, ctx=16, progress=False)


# -- a fault in one row's processing, not the model -------------------------------------------
FAULT_SEED = 666  # the request whose logits processing raises
MIXED = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=2, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=0.7, top_k=20, presence_penalty=0.5, seed=3, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=0, frequency_penalty=0.4, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=1.2, min_p=0.05, seed=4, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=0.9, seed=5, min_tokens=3, max_tokens=8, ignore_eos=True)]


def faulty_processing(monkeypatch):
    """Make the logits processors raise for any row of the request seeded `FAULT_SEED` (on its
    fourth token: after some output), as a buggy processor or grammar would."""
    import nextoken.sample.sampler as sampler

    real = sampler.process_rows

    def process_rows(work, edits, *args, **kwargs):
        if any(e.params.seed == FAULT_SEED and len(e.output_ids) >= 3 for e in edits):
            raise RuntimeError("injected processor fault")
        return real(work, edits, *args, **kwargs)

    monkeypatch.setattr(sampler, "process_rows", process_rows)


def test_a_raising_processor_ends_only_its_own_request(tiny_gguf, monkeypatch):
    """Among 8 running requests (greedy, sampled, penalized), one whose logits processor raises
    finishes with finish_reason "error", its request id in the log and the error, its blocks
    freed and the failure counted; the other 7 give exactly the tokens of a run without it."""
    from tests.helpers.engine import assert_no_leak

    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", block_size=4)
    faulty = SamplingParams(temperature=0.9, repetition_penalty=1.2, seed=FAULT_SEED, max_tokens=8, ignore_eos=True)
    prompts = [[5 + i, 17, 200 - i, 33] for i in range(8)]
    params = MIXED[:4] + [faulty] + MIXED[4:]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    before = llm.engine.stats()["num_failed"]
    steps = []
    llm.engine.subscribe(steps.append)  # the engine's one observability channel
    faulty_processing(monkeypatch)
    outs = llm.generate(prompts, params)
    bad = outs[4]
    assert [rid for s in steps for rid in s.failed] == [bad.request_id]
    assert sorted(g.request_id for s in steps for g, _ in s.finished) == sorted(o.request_id for o in outs)
    assert bad.outputs[0].finish_reason == "error" and "injected processor fault" in bad.error
    assert bad.request_id in bad.error and bad.outputs[0].token_ids == clean[4][:3]
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 4] == clean[:4] + clean[5:]
    assert all(o.error is None for i, o in enumerate(outs) if i != 4)
    assert llm.engine.stats()["num_failed"] == before + 1
    assert_no_leak(llm)


def test_a_raising_processor_is_a_500_for_its_request_and_counted_in_metrics(tiny_gguf, monkeypatch):
    """Over HTTP the faulty request alone gets a 500 naming the fault; the server keeps serving,
    and /metrics counts the failure."""
    faulty_processing(monkeypatch)  # in this process: the live server runs in a thread here
    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny")
    try:
        body = {"model": "tiny", "prompt": [5, 17, 200, 33], "max_tokens": 8, "ignore_eos": True,
                "temperature": 0.9, "repetition_penalty": 1.2}
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "seed": FAULT_SEED}, timeout=60)
        assert r.status_code == 500 and "injected processor fault" in r.text
        ok = httpx.post(f"{srv.url}/v1/completions", json={**body, "seed": 1}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert "nextoken_request_failures_total 1.0" in metrics
        assert srv.idle()
    finally:
        srv.stop()
