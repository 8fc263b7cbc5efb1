"""Scoring text: prompt log-probabilities against `transformers` on the tiny models (chunked
prefill, n > 1, preemption-free and prefix-cache-free), and `max_tokens=0` scoring."""

from __future__ import annotations

from pathlib import Path

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

    from tests.helpers.server import LiveServer

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


def _text(llm, n_tokens: int) -> str:
    """Text of about `n_tokens` tokens of the tiny vocabulary."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 200, (n_tokens,), generator=g).tolist()
    return llm.engine.tokenizer.decode(ids)


def test_perplexity_equals_transformers_on_the_same_chunks(tiny_gguf, capsys):
    """llama-perplexity's method: chunks of ctx tokens, the second half scored; against the
    negative log-likelihoods `transformers` gives for the same chunks."""
    import json
    import math

    from nextoken import cli
    from nextoken.evaluate.perplexity import chunk_tokens, perplexity

    path, hf = tiny_gguf["llama"]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=40)
    tok = llm.engine.tokenizer
    text = _text(llm, 300)
    ctx = 64
    res = perplexity(llm.engine, text, ctx, progress=False)
    ids = tok.encode(text, add_bos=False, parse_special=False)
    chunks = chunk_tokens(ids, ctx, tok.bos_token_id if tok.add_bos else None)
    nll = []
    with torch.no_grad():
        for c in chunks:
            lp = hf(torch.tensor([c])).logits[0].float().log_softmax(-1)
            nll += [-float(lp[j - 1, c[j]]) for j in range(ctx // 2 + 1, ctx)]
    assert res.num_chunks == len(chunks) == len(ids) // ctx and res.num_tokens_scored == len(nll)
    assert res.ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)
    assert 0 < res.ppl_uncertainty < res.ppl
    # the same path as its own reference: no divergence; bfloat16 against float32: a little
    same = perplexity(llm.engine, text, ctx, reference=LLM(str(path), dtype="float32").engine, progress=False)
    assert abs(same.kl_mean) < 1e-6 and same.top1_agreement == 1.0
    bf16 = perplexity(LLM(str(path), dtype="bfloat16").engine, text, ctx,
                      reference=LLM(str(path), dtype="float32", enforce_eager=True, reference_attention=True).engine,
                      progress=False)
    assert 0 < bf16.kl_mean < 0.05 and bf16.top1_agreement > 0.8
    f = Path(str(path) + ".txt")
    f.write_bytes(text.encode())
    assert cli.main(["perplexity", str(f), "--model", str(path), "--ctx", "64", "--dtype", "float32", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["ppl"] == pytest.approx(res.ppl, rel=1e-5)
    assert cli.main(["perplexity", str(f), "--model", str(path), "--ctx", "4096"]) == 1
    # --kl-divergence: against the float32 reference with a float32 cache, whatever this run's cache
    kl = {}
    for cache in ("auto", "int8"):
        assert cli.main(["perplexity", str(f), "--model", str(path), "--ctx", "64", "--dtype", "float32", "--json",
                         "--kl-divergence", "--kv-cache-dtype", cache]) == 0
        kl[cache] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kl_mean"]
    # measured: auto 0.0, int8 1.1e-7 (this random model's flat distributions); with the int8 cache
    # in the reference too, as before 2026-12-01, int8 gave 0.0: the cost it was asked for, unseen
    assert abs(kl["auto"]) < 1e-9 and kl["int8"] > 1e-8


def test_chunks_drop_the_remainder_and_start_with_bos():
    from nextoken.evaluate.perplexity import chunk_tokens

    assert chunk_tokens(list(range(10)), 4, 99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert chunk_tokens(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(InvalidRequest, match="fewer than one chunk"):
        chunk_tokens([1, 2], 4, None)


def test_wrong_method_is_405_with_allow(tiny_gguf):
    import httpx

    from tests.helpers.server import LiveServer

    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny")
    try:
        r = httpx.get(srv.url + "/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["code"] == 405
        r = httpx.delete(srv.url + "/v1/models")
        assert r.status_code == 405 and "GET" in r.headers["allow"]
    finally:
        srv.stop()
