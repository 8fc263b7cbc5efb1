"""Scoring text: prompt log-probabilities against `transformers` on the tiny models (chunked
prefill, n > 1, preemption-free and prefix-cache-free), and `max_tokens=0` scoring."""

from __future__ import annotations

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.errors import InvalidRequest

PROMPT = [5, 17, 3, 99, 42, 7, 7, 61, 8, 23, 77, 14, 2, 90, 33, 1, 64, 18, 5, 12, 40]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_prompt_logprobs_equal_transformers(tiny_gguf, arch):
    path, hf = tiny_gguf[arch]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8)  # the prompt in 3 chunks
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == []
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[p]
        assert list(entry)[0] == PROMPT[p]
        assert entry[PROMPT[p]] == pytest.approx(float(ref[p - 1, PROMPT[p]]), abs=1e-4)
        top = ref[p - 1].topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-4)


def test_prompt_logprobs_with_generation_and_n_and_a_cached_prefix(tiny_gguf):
    path, hf = tiny_gguf["llama"]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    llm = LLM(str(path), dtype="float32", block_size=4)
    llm.generate([PROMPT], SamplingParams(max_tokens=2))  # fills the prefix cache with this prompt
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, n=2))[0]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, n=2, prompt_logprobs=0))[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]
    got = [e[PROMPT[p]] for p, e in enumerate(out.prompt_logprobs) if e is not None]
    want = [float(ref[p - 1, PROMPT[p]]) for p in range(1, len(PROMPT))]
    assert got == pytest.approx(want, abs=1e-4)  # every position scored, though the prefix was cached
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=0).validate()
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(max_tokens=1, prompt_logprobs=21).validate()
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()


def test_echo_scores_the_prompt_through_the_server(tiny_gguf):
    """/v1/completions with echo, logprobs and max_tokens 0 (or 1, as lm-evaluation-harness
    asks): the prompt's token_logprobs equal LLM's prompt_logprobs, the first is null; the same
    in a stream."""
    import httpx

    from tests.test_server import LiveServer

    path, _ = tiny_gguf["llama"]
    llm = LLM(str(path), dtype="float32")
    oracle = LLM(str(path), dtype="float32")
    want = oracle.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=2))[0].prompt_logprobs
    srv = LiveServer(llm, "tiny")
    try:
        for max_tokens in (0, 1):
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "echo": True, "logprobs": 2, "temperature": 0}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()
            lp = r["choices"][0]["logprobs"]
            assert len(lp["token_logprobs"]) == len(PROMPT) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["token_logprobs"][1:len(PROMPT)] == pytest.approx(
                [want[p][PROMPT[p]] for p in range(1, len(PROMPT))], abs=1e-5)
            assert all(len(t) >= 2 for t in lp["top_logprobs"][1:])
            assert r["choices"][0]["finish_reason"] == "length"
            assert r["usage"]["completion_tokens"] == max_tokens
            chunks = []
            with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(__import__("json").loads(line[6:]))
            streamed = [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
            assert streamed == lp["token_logprobs"]
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1},
                       timeout=30).json()
        pl = r["choices"][0]["prompt_logprobs"]
        assert pl[0] is None and pl[3][str(PROMPT[3])]["logprob"] == pytest.approx(want[3][PROMPT[3]], abs=1e-5)
    finally:
        srv.stop()
