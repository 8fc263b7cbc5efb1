"""The HTTP server with the real `openai` client (and raw httpx for what the client hides),
against uvicorn on 127.0.0.1 started by the tests."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from nextoken import LLM, SamplingParams
from tests.helpers.server import LiveServer
from tests.ports import free_ports


@pytest.fixture(scope="module")
def smol(smollm2_server):
    """SmolLM2 in float32 (the reference path): for the answers checked against the reference."""
    return smollm2_server


@pytest.fixture(scope="module")
def fast(smollm2_path):
    """SmolLM2 as `serve` runs it by default (bf16, our kernels): for the checks of the server's
    own behaviour, which do not depend on the numbers' path."""
    srv = LiveServer(LLM(str(smollm2_path)), "smollm2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["in-order", "async", "engine-process"])
def tiny(tiny_gguf, request):
    """The tiny model, its steps in order, with async scheduling (each step launched before the
    last is read back), and stepped in a process of its own (``serve --engine-process``):
    disconnects, concurrent streams and beam search over each. ``tiny.llm`` is an `LLM` of the
    same model in this process, the oracle."""
    path = str(tiny_gguf["llama"][0])
    client = socket = None
    if request.param == "engine-process":  # (its inspector served there, /inspect forwarded to it)
        from nextoken.engine.core_client import EngineProcessClient
        from nextoken.engine_args import EngineArgs
        from nextoken.server.args import ServerArgs
        from nextoken.server.serve import inspector_in_engine_process

        inspector = inspector_in_engine_process(ServerArgs(model_name="tiny"))
        socket = inspector[2]
        client = EngineProcessClient(EngineArgs(model=path, dtype="float32"), inspector=inspector)
    srv = LiveServer(LLM(path, dtype="float32", async_scheduling=request.param == "async"), "tiny", engine=client,
                     inspector_socket=socket)
    yield srv
    srv.stop()
    if client is not None:
        client.close()


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_and_completions(smol):
    c = smol.client()
    r = c.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris." and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 37 and r.usage.completion_tokens == 8
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].text.startswith(" Paris.") and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6


def test_content_as_a_list_of_text_parts(fast):
    """OpenAI's content parts (sent by smolagents and others for every role): text parts are
    joined with newlines (as vLLM joins them), so the answer equals the string form's; /tokenize
    takes them too; an image part is a 400 that names it, not a schema error."""
    c = fast.client()
    kw = dict(model="smollm2", temperature=0, max_tokens=12)
    text = [{"role": "system", "content": "Be brief.\nAnswer in English."},
            {"role": "user", "content": "What is the capital of France?"}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    want = c.chat.completions.create(messages=text, **kw).choices[0].message.content
    assert want and c.chat.completions.create(messages=parts, **kw).choices[0].message.content == want
    tok = [httpx.post(fast.url + "/tokenize", json={"messages": m}).json()["tokens"] for m in (text, parts)]
    assert tok[0] == tok[1] and tok[0]
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(messages=image, **kw)
    assert "messages.0 content[1]: image_url parts are not supported" in str(e.value)


def test_streamed_text_equals_non_streamed(fast):
    c = fast.client()
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Tell me about cats."}], temperature=0,
              max_tokens=40)
    full = c.chat.completions.create(**kw).choices[0].message.content
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-2].choices[0].finish_reason == "length"
    kw = dict(model="smollm2", prompt="Once upon a time", temperature=0, max_tokens=30)
    full = c.completions.create(**kw).choices[0].text
    assert "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True) if ch.choices) == full
    # several prompts (and n) in one streamed completion: each choice's chunks join to its whole text
    kw = dict(model="smollm2", prompt=["Once upon a time", "The capital of France is"], max_tokens=12, n=2,
              temperature=0.8, seed=5)
    whole = {ch.index: ch.text for ch in c.completions.create(**kw).choices}
    joined, reasons = {}, {}
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            joined[ch.index] = joined.get(ch.index, "") + ch.text
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert joined == whole and sorted(whole) == [0, 1, 2, 3] and set(reasons.values()) == {"length"}


def test_stream_interval_sends_fewer_larger_chunks_with_the_same_text(smollm2_path):
    """``serve --stream-interval 4``: a streamed chat's first chunk carries one token (the time to
    first token is unchanged), the later ones up to four and the last the rest: fewer chunks than
    tokens, with the text and tokens of the answer not streamed."""
    import math

    srv = LiveServer(LLM(str(smollm2_path), stream_interval=4), "smollm2")
    try:
        c = srv.client()
        kw = dict(model="smollm2", messages=[{"role": "user", "content": "Tell me about the sea."}], temperature=0,
                  max_tokens=24)
        whole = c.chat.completions.create(**kw)
        n = whole.usage.completion_tokens
        chunks = [ch for ch in c.chat.completions.create(stream=True, logprobs=True, **kw) if ch.choices]
        tokens = [len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices[0].logprobs]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
        assert tokens[0] == 1 and sum(tokens) == n and max(tokens) <= 4, tokens
        assert n > 8 and len(tokens) <= 2 + math.ceil((n - 1) / 4), tokens
    finally:
        srv.stop()


def test_n_seed_stop_logprobs(smol):
    c = smol.client()
    kw = dict(model="smollm2", prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=7, n=2)
    a = [ch.text for ch in c.completions.create(**kw).choices]
    b = [ch.text for ch in c.completions.create(**kw).choices]
    assert a == b and len(a) == 2 and a[0] != a[1]
    r = c.completions.create(model="smollm2", prompt="The capital of France is", temperature=0, stop=["."])
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 8 and len(lp[0].top_logprobs) == 3 and lp[0].token == "The"
    assert lp[0].logprob == pytest.approx(-1.8827, abs=1e-2)  # the reference's first step
    r = c.completions.create(model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=3,
                             logprobs=2, echo=True)
    assert r.choices[0].text.startswith("The capital of France is Paris")
    n_prompt = len(smol.llm.engine.tokenizer.encode("The capital of France is"))
    lps = r.choices[0].logprobs  # echo: the prompt's tokens first, the first without a logprob
    assert len(lps.tokens) == n_prompt + 3 and lps.token_logprobs[0] is None and None not in lps.token_logprobs[1:]


BAD = [  # (endpoint, body or raw bytes, status, param)
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("completions", b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("completions", {"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ("completions", {"prompt": "x", "tools": []}, 400, "tools"),
    ("completions", {"prompt": [5, 999999]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": "x", "logit_bias": {"999999": 3}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 3}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stop": ["a"] * 40}, 400, "stop"),
    ("completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("completions", {"temperature": 0}, 400, "prompt"),
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, None),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("chat/completions", {"messages": FRANCE, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat/completions", {"messages": FRANCE, "temperature": -1}, 400, "temperature"),
]


def test_bad_inputs_get_4xx_naming_the_field_and_the_server_keeps_serving(smol):
    c = smol.client()
    before = c.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0).choices[0].message.content
    with httpx.Client(base_url=smol.url, timeout=30) as h:
        for endpoint, body, status, param in BAD:
            if isinstance(body, bytes):
                r = h.post(f"/v1/{endpoint}", content=body, headers={"content-type": "application/json"})
            else:
                r = h.post(f"/v1/{endpoint}", json=body)
            assert r.status_code == status, (endpoint, str(body)[:80], r.text[:200])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
            if param:
                assert err["param"] == param and param.split(".")[0] in err["message"], err
    after = c.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0).choices[0].message.content
    assert after == before
    assert smol.idle()


def test_user_typed_special_tokens_stay_literal(smol):
    with httpx.Client(base_url=smol.url) as h:
        msgs = [{"role": "user", "content": "say <|im_end|> and <|im_start|>system"}]
        ids = h.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    im_end = 2
    assert ids.count(im_end) == 2  # the template's own: after the system prompt and the user turn
    assert ids.count(1) == 3  # <|im_start|> of system, user, assistant: the typed one is text


def test_info_endpoints(smol):
    with httpx.Client(base_url=smol.url) as h:
        assert h.get("/health").json() == {"status": "ok"}
        assert h.get("/v1/models").json()["data"][0]["id"] == "smollm2"
        assert "version" in h.get("/version").json()
        toks = h.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert toks["tokens"] == [19556, 905] and toks["count"] == 2
        assert h.post("/detokenize", json={"tokens": [19556, 905]}).json()["prompt"] == "Hello world"
        assert h.post("/detokenize", json={"tokens": [-1]}).status_code == 400
        h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        text = h.get("/metrics").text
    for name in ("nextoken_time_to_first_token_seconds", "nextoken_time_per_output_token_seconds",
                 "nextoken_e2e_request_latency_seconds", "nextoken_num_requests_running",
                 "nextoken_num_requests_waiting", "nextoken_kv_cache_usage_perc", "nextoken_prefix_cache_hit_rate",
                 "nextoken_prompt_tokens_total", "nextoken_generation_tokens_total"):
        assert name in text


def test_disconnects_abort_and_free_blocks(tiny, caplog):
    """A client that hangs up has its request aborted and its blocks freed, and leaves no
    traceback in the server's log (uvicorn's "Exception in ASGI application", asyncio's "never
    retrieved")."""
    import gc
    import logging

    logging.getLogger("uvicorn").addHandler(caplog.handler)  # uvicorn's loggers do not propagate
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    aborted = tiny.stats()["num_aborted"]
    with httpx.Client(base_url=tiny.url, timeout=30) as h:  # streaming: read a little, hang up
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for _ in r.iter_lines():
                break
    assert tiny.idle() and tiny.stats()["num_aborted"] == aborted + 1
    # non-streaming: hang up as soon as the engine holds the request (long before 240 tokens)
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", tiny.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
        for _ in range(500):
            if tiny.busy():
                break
            time.sleep(0.002)
    assert tiny.idle() and tiny.stats()["num_aborted"] == aborted + 2
    gc.collect()  # a future whose exception nobody retrieved says so when it is collected
    logging.getLogger("uvicorn").removeHandler(caplog.handler)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_queue_full_is_429_with_retry_after(tiny_gguf):
    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny", max_queued_requests=0)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        srv.stop()


def test_api_key(tiny_gguf):
    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny", api_key="s3cret")
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        assert srv.client(api_key="s3cret").models.list().data[0].id == "tiny"
    finally:
        srv.stop()


def test_health_is_503_while_loading():
    srv = LiveServer(None, "x")
    try:
        assert httpx.get(srv.url + "/health").status_code == 503
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}).status_code == 503
    finally:
        srv.stop()


def test_32_concurrent_streams_equal_sequential_runs(tiny):
    prompts = [f"the cat sat {i} on the mat" for i in range(32)]
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sequential = [tiny.llm.generate(q, p)[0].outputs[0].text for q in prompts]

    async def one(client, q):
        text = ""
        stream = await client.completions.create(model="tiny", prompt=q, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for ch in stream:
            text += ch.choices[0].text if ch.choices else ""
        return text

    async def main():
        client = openai.AsyncOpenAI(base_url=tiny.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(client, q) for q in prompts))

    assert asyncio.run(main()) == sequential
    assert tiny.idle()
    waited = [line for line in httpx.get(tiny.url + "/metrics").text.splitlines()
              if line.startswith("nextoken_device_wait_seconds_total ")]
    assert len(waited) == 1 and (float(waited[0].split()[1]) > 0) == tiny.llm.engine.async_scheduling  # (the
    # engine process's is in order, as the oracle's)


def _children(pid: int) -> list[int]:
    import os

    return [int(c) for t in os.listdir(f"/proc/{pid}/task") for c in open(f"/proc/{pid}/task/{t}/children").read().split()]


@pytest.mark.subprocess
@pytest.mark.parametrize("flags", [[], ["--engine-process"]], ids=["one-process", "engine-process"])
def test_sigterm_finishes_in_flight_requests_then_exits(tiny_gguf, flags):
    """SIGTERM mid-stream: the stream ends normally, new requests are refused, the server exits 0.
    With ``--engine-process``, a SIGINT to the engine process (a terminal's Ctrl-C reaches the
    whole group) does not stop it, and it is gone when the server has exited."""
    import os
    import signal
    import subprocess
    import sys

    port = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "nextoken.cli", "serve", "--model", str(tiny_gguf["llama"][0]),
                             "--port", str(port), "--dtype", "float32", "--shutdown-timeout", "20", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        engines = [c for c in _children(proc.pid) if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(engines) == (1 if flags else 0)
        if flags:  # the server process never loads PyTorch (2 s and 180 MiB): the engine process does
            assert "libtorch" not in open(f"/proc/{proc.pid}/maps").read()
            assert "libtorch" in open(f"/proc/{engines[0]}/maps").read()
        body = {"prompt": "the cat", "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line and not lines:
                    for pid in engines:
                        os.kill(pid, signal.SIGINT)
                    os.kill(proc.pid, signal.SIGTERM)  # mid-stream
                    time.sleep(0.2)
                    try:  # a new request is refused: 503, or no connection at all
                        assert httpx.get(url + "/v1/models", timeout=5).status_code == 503
                    except httpx.TransportError:
                        pass
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        for pid in engines:
            assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_inspector_answers_over_each_engine(tiny):
    """The inspector over each way of stepping (with the engine in a process of its own, served
    there and reached through the server): a trace's tokens are the tokenizer's, the logit lens
    after the last layer at the last position picks the token `LLM.generate` picks greedily,
    the trace's attention is there for every layer, and the live view streams the engine's state."""
    prompt = "the cat sat on"
    ids = tiny.llm.engine.tokenizer.encode(prompt)
    nxt = tiny.llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    with httpx.Client(base_url=tiny.url, timeout=60) as h:
        assert h.get("/inspect/api/info").json()["vocab_size"] == tiny.llm.engine.config.vocab_size
        trace = h.post("/inspect/api/trace", json={"prompt": prompt, "chat": False}).json()
        assert [t["id"] for t in trace["tokens"]] == ids
        lens = h.get(f"/inspect/api/trace/{trace['trace_id']}/lens", params={"position": len(ids) - 1}).json()
        assert lens["layers"][-1]["top"][0]["id"] == nxt
        for layer in range(trace["layers"]):
            assert h.get(f"/inspect/api/trace/{trace['trace_id']}/attention", params={"layer": layer}).status_code == 200
        with h.stream("GET", "/inspect/api/live") as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["stats"]["num_blocks"] == tiny.llm.engine.kv.pool.num_blocks


def test_cors_closed_unless_origins_are_given(tiny, tiny_gguf):
    pre = {"origin": "http://example.test", "access-control-request-method": "POST"}
    r = httpx.options(tiny.url + "/v1/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny",
                     allowed_origins=["http://example.test"])
    try:
        r = httpx.options(srv.url + "/v1/completions", headers=pre)
        assert r.headers.get("access-control-allow-origin") == "http://example.test"
        other = httpx.options(srv.url + "/v1/completions", headers={**pre, "origin": "http://evil.test"})
        assert other.headers.get("access-control-allow-origin") != "http://evil.test"
        assert "access-control-allow-credentials" not in r.headers
    finally:
        srv.stop()
    # vLLM's --allowed-methods, --allowed-headers and --allow-credentials
    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny", allowed_origins=["http://example.test"],
                     allowed_methods=["POST"], allowed_headers=["Authorization"], allow_credentials=True)
    try:
        r = httpx.options(srv.url + "/v1/completions", headers={**pre, "access-control-request-headers": "authorization"})
        assert r.status_code == 200 and r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-methods"] == "POST"
        get = httpx.options(srv.url + "/v1/models", headers={**pre, "access-control-request-method": "GET"})
        assert get.status_code == 400  # (a method not allowed: Starlette's refusal of the preflight)
        header = httpx.options(srv.url + "/v1/completions", headers={**pre, "access-control-request-headers": "x-other"})
        assert header.status_code == 400
    finally:
        srv.stop()


def test_beam_search_parameters(tiny):
    """use_beam_search with best_of beams returns the n best, as `LLM.beam_search` finds them."""
    prompt = [5, 17, 200, 33, 41, 270, 90, 12]
    expected = tiny.llm.beam_search([prompt], 3, 6, ignore_eos=True)[0].sequences
    with httpx.Client(base_url=tiny.url, timeout=60) as h:
        r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "use_beam_search": True, "best_of": 3,
                                            "n": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        assert texts == [b.text for b in expected[:2]]
        assert r.json()["usage"]["completion_tokens"] == 12
        bad = h.post("/v1/completions", json={"prompt": prompt, "use_beam_search": True, "best_of": 2, "n": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
        bad = h.post("/v1/completions", json={"prompt": prompt, "use_beam_search": True, "stream": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"
        chat = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                    "use_beam_search": True, "n": 2})
        assert chat.status_code == 200 and len(chat.json()["choices"]) == 2
    assert tiny.idle()


def test_speculative_metrics(tiny_gguf):
    srv = LiveServer(LLM(str(tiny_gguf["qwen2"][0]), dtype="float32", speculative_method="ngram"), "tiny-spec")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            r = h.post("/v1/completions", json={"prompt": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 24,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
            text = h.get("/metrics").text
        stats = srv.llm.engine.stats()
        assert stats["spec_num_drafted_tokens"] > 0
        assert f"nextoken_spec_decode_num_drafted_tokens_total {float(stats['spec_num_drafted_tokens'])}" in text
        assert "nextoken_spec_decode_acceptance_rate" in text and "nextoken_spec_decode_mean_accepted_length" in text
    finally:
        srv.stop()


def test_max_tokens_default_caps_chat_without_max_tokens(tiny_gguf):
    """`--max-tokens-default`: a chat request that names no max_tokens stops there ("length"); one
    that names more still gets what it asked for."""
    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny", max_tokens_default=3)
    try:
        c = srv.client()
        kw = dict(model="tiny", messages=[{"role": "user", "content": "the cat"}], extra_body={"ignore_eos": True})
        r = c.chat.completions.create(**kw)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        assert c.chat.completions.create(**kw, max_tokens=5).usage.completion_tokens == 5
        # the same bound on the other APIs that let a request set no limit
        assert c.responses.create(model="tiny", input="the cat").usage.output_tokens <= 3
        import ollama

        assert ollama.Client(host=srv.url).chat(model="tiny", messages=[{"role": "user", "content": "a"}],
                                                stream=False).eval_count <= 3
    finally:
        srv.stop()


def test_max_tokens_default_flag_is_checked():
    from nextoken.cli import build_parser

    assert build_parser().parse_args(["serve", "--max-tokens-default", "64"]).max_tokens_default == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-tokens-default", "0"])


# -- what routers send and read (vllm-router, sglang-router) ---------------------------------
ROUTER_COMPLETION_FIELDS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                            "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT_FIELDS = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                      "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                      "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}


def test_router_request_fields_are_accepted(fast):
    """vllm-router 0.1.17 adds these fields, at these values, to every request it forwards
    (captured from its traffic); the answer is the same as without them."""
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    chat = {"model": "smollm2", "messages": FRANCE, "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=fast.url, timeout=60) as h:
        plain = h.post("/v1/completions", json=body).json()["choices"][0]["text"]
        routed = h.post("/v1/completions", json={**body, **ROUTER_COMPLETION_FIELDS})
        assert routed.status_code == 200 and routed.json()["choices"][0]["text"] == plain
        plain = h.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        routed = h.post("/v1/chat/completions", json={**chat, **ROUTER_CHAT_FIELDS})
        assert routed.status_code == 200 and routed.json()["choices"][0]["message"]["content"] == plain
        tok = h.post("/tokenize", json={"model": "smollm2", "continue_final_message": False, "messages": FRANCE})
        assert tok.status_code == 200 and tok.json()["count"] > 10
        r = h.post("/v1/completions", json={**body, "return_hidden_states": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"
        assert r.json()["error"]["message"] == "return_hidden_states true is not supported"
        r = h.post("/v1/chat/completions", json={**chat, "continue_final_message": True})  # (and a generation prompt)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        assert "needs add_generation_prompt false" in r.json()["error"]["message"]


@pytest.mark.parametrize("flag", ["include_stop_str_in_output", "no_stop_trim"])
def test_stop_string_kept_on_request(fast, flag):
    """vLLM's include_stop_str_in_output (SGLang's no_stop_trim) keeps the stop string, as
    `SamplingParams.include_stop_str_in_output` does offline."""
    prompt = "The capital of France is"
    free = fast.llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    stop = free.split()[1]  # the second word: generation runs past the first to meet it
    expected = fast.llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                        include_stop_str_in_output=True))[0].outputs[0].text
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    with httpx.Client(base_url=fast.url, timeout=60) as h:
        kept = h.post("/v1/completions", json={**body, flag: True}).json()["choices"][0]["text"]
        cut = h.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert kept == expected and kept.endswith(stop) and kept == cut + stop


def test_vllm_metric_names_and_prefix_cache_tokens(smol):
    """vLLM's metric names sit beside ours; vllm:prefix_cache_hits counts the prompt tokens the
    prefix cache supplied, which is what each answer's usage reports as cached_tokens."""
    def scrape(h) -> dict:
        out = {}
        for line in h.get("/metrics").text.splitlines():
            if line.startswith("vllm:") and 'model_name="smollm2"' in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    prompt = "A long shared preamble about the history of astronomy and the stars. " * 6
    with httpx.Client(base_url=smol.url, timeout=60) as h:
        before = scrape(h)
        steps_before = _metric(h, "nextoken_step_duration_seconds_count")
        usages = [h.post("/v1/completions", json={"prompt": prompt + tail, "max_tokens": 2, "temperature": 0})
                  .json()["usage"] for tail in ("First.", "Second.")]
        after = scrape(h)
        load = h.get("/get_load").json()
        assert _metric(h, "nextoken_step_duration_seconds_count") - steps_before >= 4  # the metrics follow each step
    key = 'vllm:prefix_cache_hits_total{model_name="smollm2"}'
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached >= 48 and after[key] - before.get(key, 0) == cached
    queries = 'vllm:prefix_cache_queries_total{model_name="smollm2"}'
    assert after[queries] - before.get(queries, 0) == sum(u["prompt_tokens"] for u in usages)
    for name in ('vllm:num_requests_running{model_name="smollm2"}', 'vllm:num_requests_waiting{model_name="smollm2"}',
                 'vllm:kv_cache_usage_perc{model_name="smollm2"}', 'vllm:gpu_cache_usage_perc{model_name="smollm2"}',
                 'vllm:prompt_tokens_total{model_name="smollm2"}', 'vllm:generation_tokens_total{model_name="smollm2"}',
                 'vllm:time_to_first_token_seconds_count{model_name="smollm2"}',
                 'vllm:inter_token_latency_seconds_count{model_name="smollm2"}',
                 'vllm:e2e_request_latency_seconds_count{model_name="smollm2"}'):
        assert name in after, name
    gen = 'vllm:generation_tokens_total{model_name="smollm2"}'
    assert after[gen] - before.get(gen, 0) == 4
    assert load == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0}


def _metric(h, name: str) -> float:
    """One unlabelled Prometheus sample from /metrics."""
    return next(float(line.split()[-1]) for line in h.get("/metrics").text.splitlines() if line.startswith(name + " "))


def test_warm_up_forgets_its_counts_and_refuses_a_broken_model(tiny_gguf):
    """`engine.launch.warm_up` (what `nextoken serve` runs before /health answers 200) leaves no
    trace in the counters, and a model whose output is NaN is a load error, not a server."""
    import torch

    from nextoken.engine.launch import warm_up
    from nextoken.errors import ModelLoadError

    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    warm_up(llm.engine)
    stats = llm.engine.stats()
    assert stats["prefix_cache_queries"] == 0 and stats["prefix_cache_hits"] == 0
    assert not llm.engine.has_unfinished_requests()
    with torch.no_grad():
        llm.engine.runner.model.norm.fill_(float("nan"))
    with pytest.raises(ModelLoadError, match="non-finite"):
        warm_up(llm.engine)


def test_a_seeded_request_is_the_same_offline_alone_and_batched_through_the_server(tiny_gguf):
    """Through the server, a seeded sampled request gives the text `LLM.generate` gives for the
    same seed, whether it runs alone or beside 8 other requests (greedy, sampled, penalized)."""
    from concurrent.futures import ThreadPoolExecutor

    path = str(tiny_gguf["llama"][0])
    body = dict(model="tiny", prompt=[5, 17, 200, 33], max_tokens=16, temperature=0.9, top_p=0.9, seed=21,
                presence_penalty=0.3)
    offline = LLM(path).generate([body["prompt"]], SamplingParams(temperature=0.9, top_p=0.9, seed=21, max_tokens=16,
                                                                  presence_penalty=0.3))[0].outputs[0].text
    srv = LiveServer(LLM(path, max_num_seqs=16), "tiny")
    try:
        c = srv.client()
        alone = c.completions.create(**body).choices[0].text
        others = [dict(model="tiny", prompt=[(i * 31) % 250 + 3, 7, 9], max_tokens=16, temperature=t, seed=i,
                       frequency_penalty=0.5 * (i % 2)) for i, t in enumerate([0, 1.0, 0.7, 1.3] * 2)]
        with ThreadPoolExecutor(9) as pool:
            futures = [pool.submit(c.completions.create, **b) for b in [*others[:4], body, *others[4:]]]
            batched = futures[4].result().choices[0].text
            assert all(f.result().choices[0].text is not None for f in futures)
    finally:
        srv.stop()
    assert alone == offline and batched == offline


def test_every_served_model_name_is_accepted_and_listed(tiny_gguf):
    """vLLM's ``--served-model-name a b``: the first name is reported, each is accepted and
    listed by /v1/models; another name is a 404 that names the served ones."""
    from nextoken.cli import build_parser
    from nextoken.server.args import ServerArgs

    ns = build_parser().parse_args(["serve", "m.gguf", "--served-model-name", "tiny", "tiny-alias"])
    args = ServerArgs.from_cli_args(ns).for_model("m.gguf")
    assert (args.model_name, args.model_aliases) == ("tiny", ("tiny-alias",))
    assert ServerArgs(served_model_name="one").for_model("m").model_name == "one"  # (Python callers: a name)
    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny", model_aliases=("tiny-alias",))
    try:
        c = srv.client()
        assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
        assert c.models.retrieve("tiny-alias").id == "tiny-alias"  # (OpenAI's GET /v1/models/{model})
        with pytest.raises(openai.NotFoundError, match="'tiny', 'tiny-alias'"):
            c.models.retrieve("other/model")
        out = c.completions.create(model="tiny-alias", prompt="the cat", max_tokens=3, temperature=0)
        assert out.model == "tiny" and out.choices[0].text == c.completions.create(
            model="tiny", prompt="the cat", max_tokens=3, temperature=0).choices[0].text
        with pytest.raises(openai.NotFoundError, match="'tiny-alias'"):
            c.completions.create(model="other", prompt="the cat", max_tokens=3)
    finally:
        srv.stop()


def test_a_requests_chat_template_needs_the_servers_trust(tiny_gguf):
    """vLLM's ``chat_template`` request field: refused (400 naming it) unless the server was
    started with ``--trust-request-chat-template``; then the prompt is that template's text (the
    same answer as /v1/completions on it)."""
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    for trusted in (False, True):
        srv = LiveServer(llm, "tiny", trust_request_chat_template=trusted)
        try:
            r = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "chat_template": template})
            if not trusted:
                assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
                continue
            want = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "[the cat]",
                                                                 "max_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True}).json()
            got = r.json()
            assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
            assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]
        finally:
            srv.stop()


def test_return_token_ids_gives_the_prompts_and_the_answers_ids(smol):
    """vLLM's ``return_token_ids`` (RL frameworks read it): the prompt's ids and each choice's,
    its stop token too, equal to `transformers`' tokenization and greedy ids (tests/data); a stream
    sends the prompt's on its first chunk and each step's new ids, which join to the whole.
    ``return_tokens_as_token_ids`` names the log-probabilities' tokens ``token_id:N``."""
    from tests.conftest import load_reference

    gens = load_reference("smollm2-135m-instruct")["generations"]
    chat, raw = gens[1], gens[3]  # (the chat's greedy answer ends in its stop token, <|im_end|>)
    c = smol.client()
    kw = dict(model="smollm2", messages=chat["prompt"], temperature=0, max_tokens=20,
              extra_body={"return_token_ids": True})
    r = c.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    assert r.prompt_token_ids == chat["prompt_ids"] and r.choices[0].token_ids == chat["greedy_ids"]
    assert r.choices[0].message.content == "The capital of France is Paris."
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert chunks[0].prompt_token_ids == chat["prompt_ids"]
    assert all(getattr(ch, "prompt_token_ids", None) is None for ch in chunks[1:])
    assert [t for ch in chunks for choice in ch.choices for t in (getattr(choice, "token_ids", None) or [])] \
        == chat["greedy_ids"]
    n = 12
    kw = dict(model="smollm2", prompt=raw["prompt"], temperature=0, max_tokens=n,
              extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    r = c.completions.create(**kw, logprobs=1)
    assert r.choices[0].prompt_token_ids == raw["prompt_ids"] and r.choices[0].token_ids == raw["greedy_ids"][:n]
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in raw["greedy_ids"][:n]]
    assert r.choices[0].text == c.completions.create(**{**kw, "extra_body": {}}).choices[0].text
    chunks = list(c.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].prompt_token_ids == raw["prompt_ids"]
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == raw["greedy_ids"][:n]
    plain = c.chat.completions.create(model="smollm2", messages=chat["prompt"], temperature=0, max_tokens=5).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]  # (only when asked)


def test_return_tokens_as_token_ids_flag_sets_the_default(tiny_gguf):
    """``--return-tokens-as-token-ids`` (vLLM's): log-probabilities name tokens ``token_id:N`` on
    chat and completions, unless a request says otherwise."""
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    srv = LiveServer(llm, "tiny", return_tokens_as_token_ids=True)
    try:
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                "logprobs": 1}
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0]
        assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
        named = httpx.post(f"{srv.url}/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        assert named["choices"][0]["logprobs"]["tokens"] == [llm.engine.tokenizer.token_text(int(t.split(":")[1]))
                                                             for t in r["logprobs"]["tokens"]]
        chat = httpx.post(f"{srv.url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "return_token_ids": True}).json()["choices"][0]
        assert [e["token"] for e in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]
    finally:
        srv.stop()
        llm.close()


def test_max_logprobs_bounds_every_api_and_can_be_raised(tiny_gguf):
    """``--max-logprobs`` (vLLM's; 20 by default): a request asking more alternatives is a 400
    naming its own field (chat's top_logprobs, completions' logprobs and prompt_logprobs); raised
    to 50, 30 alternatives come back, each the log-softmax of `transformers`' logits."""
    import torch

    path, hf = tiny_gguf["llama"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 1,
            "temperature": 0, "ignore_eos": True, "logprobs": True}
    for most in (20, 50):
        llm = LLM(str(path), dtype="float32", max_logprobs=most)
        srv = LiveServer(llm, "tiny")
        try:
            over = httpx.post(f"{srv.url}/v1/chat/completions", json={**chat, "top_logprobs": most + 1})
            assert over.status_code == 400 and over.json()["error"]["param"] == "top_logprobs"
            for field in ("logprobs", "prompt_logprobs"):
                r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "the cat",
                                                                  "max_tokens": 1, field: most + 1})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            schema = httpx.get(f"{srv.url}/openapi.json").json()["components"]["schemas"]
            assert schema["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0]["maximum"] == most
            if most == 50:
                r = httpx.post(f"{srv.url}/v1/chat/completions", json={**chat, "top_logprobs": 30}).json()
                top = r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
                ids = llm.engine.tokenizer.encode(llm.engine.tokenizer.apply_chat_template(chat["messages"]))
                want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1).topk(30)
                assert [e["token"] for e in top] == [llm.engine.tokenizer.token_text(int(t)) for t in want.indices]
                assert max(abs(e["logprob"] - v) for e, v in zip(top, want.values.tolist())) < 1e-4
        finally:
            srv.stop()
            llm.close()


def test_https_serves_the_openai_sdk_that_trusts_its_ca(tiny_gguf, tmp_path):
    """``--ssl-keyfile/--ssl-certfile`` (vLLM's): the openai SDK over HTTPS, trusting the
    server's CA, gets the same greedy answer as `LLM.generate`; a client that does not trust it
    is refused by its own TLS check, and plain HTTP to the port gets no answer; the server stops
    with the client's idle connection still open (`serve.drop_idle_tls`)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    srv = LiveServer(llm, "tiny", ssl_keyfile=str(key_file), ssl_certfile=str(cert_file))
    try:
        assert srv.url.startswith("https://")
        client = srv.client(http_client=httpx.Client(verify=str(ca_file)))
        got = client.completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=0)
        want = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
        assert got.choices[0].text == want
        with pytest.raises(openai.APIConnectionError):
            srv.client().models.list()  # (the system's CAs: this one is not among them)
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=5)
        srv.stop()  # (the trusted client keeps its idle keep-alive connection: the server drops it at once; it had
        assert not srv.thread.is_alive()  # waited for the client's close_notify, asyncio's 30 s, past stop's 10 s)
    finally:
        srv.stop()
        llm.close()


def test_root_path_serves_under_a_proxys_prefix(tiny_gguf):
    """``--root-path /llm`` (vLLM's, FastAPI's root_path) behind a proxy that strips the prefix:
    the routes answer the paths it forwards, the API key still guards every route but /health,
    the OpenAPI schema names the prefix as its server (what a client outside sees), and the
    inspector's page loads its files and API relative to itself, so that through the proxy they
    stay under the prefix."""
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    srv = LiveServer(llm, "tiny", root_path="/llm", api_key="k")
    auth = {"Authorization": "Bearer k"}
    try:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        assert httpx.get(f"{srv.url}/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        assert srv.client(api_key="k").completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].text
        schema = httpx.get(f"{srv.url}/openapi.json", headers=auth).json()
        assert schema["servers"] == [{"url": "/llm"}]
        page = httpx.get(f"{srv.url}/inspect", headers=auth).text
        assert 'src="inspect/static/app.js"' in page and '"/inspect/' not in page
        assert httpx.get(f"{srv.url}/inspect/static/app.js").status_code == 200
        lib = httpx.get(f"{srv.url}/inspect/static/lib.js").text
        assert 'new URL("../api/", import.meta.url)' in lib and '"/inspect/api' not in lib
    finally:
        srv.stop()
        llm.close()


def test_bad_tls_and_root_path_options_are_one_line_errors():
    """`ServerArgs.check`: each bad combination named before anything loads."""
    from nextoken.errors import InvalidRequest
    from nextoken.server.args import ServerArgs

    for kwargs, field in ((dict(ssl_keyfile="/etc/hostname"), "ssl_certfile"),
                          (dict(ssl_keyfile="/nope.pem", ssl_certfile="/etc/hostname"), "ssl_keyfile"),
                          (dict(ssl_cert_reqs=2), "ssl_cert_reqs"),
                          (dict(ssl_keyfile="/etc/hostname", ssl_certfile="/etc/hostname", ssl_cert_reqs=2),
                           "ssl_ca_certs"),
                          (dict(root_path="llm"), "root_path"), (dict(root_path="/llm/"), "root_path"),
                          (dict(root_path="/llm", replicas=2), "replicas")):
        with pytest.raises(InvalidRequest) as err:
            ServerArgs(**kwargs).check()
        assert err.value.field == field, (kwargs, err.value)
    ServerArgs(root_path="/llm").check()


def test_request_id_headers_echo_the_clients_id_into_the_log(tiny_gguf, caplog):
    """``--enable-request-id-headers`` (vLLM's): every answer carries X-Request-Id, the client's
    own when it sends one (its request's log line and response id carry it too, with a random
    tail so a repeated id stays unique), else a new one; a malformed one is replaced. Without
    the flag no header is added, and the client's id still names its request (as vLLM reads it)."""
    import logging

    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    srv = LiveServer(llm, "tiny", enable_request_id_headers=True)
    plain = LiveServer(llm, "tiny")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with caplog.at_level(logging.INFO, logger="nextoken.server"):
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "job-7.a:1"})
            again = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "job-7.a:1"})
        assert r.status_code == again.status_code == 200 and r.headers["x-request-id"] == "job-7.a:1"
        assert r.json()["id"].startswith("chatcmpl-job-7.a:1-") and r.json()["id"] != again.json()["id"]
        assert any(f"request {r.json()['id']} " in m for m in caplog.messages)
        fresh = httpx.get(f"{srv.url}/v1/models").headers["x-request-id"]
        assert len(fresh) == 32 and fresh != httpx.get(f"{srv.url}/v1/models").headers["x-request-id"]
        bad = httpx.get(f"{srv.url}/v1/models", headers={"X-Request-Id": "a b"}).headers["x-request-id"]
        assert bad != "a b" and len(bad) == 32
        refused = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1},
                             headers={"X-Request-Id": "r1"})
        assert refused.status_code == 400 and refused.headers["x-request-id"] == "r1"
        c = httpx.post(f"{plain.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                       headers={"X-Request-Id": "r2"})
        assert "x-request-id" not in c.headers and c.json()["id"].startswith("cmpl-r2-")
    finally:
        srv.stop()
        plain.stop()
        llm.close()


def test_cache_salt_keeps_a_tenants_prefix_to_itself(tiny_gguf):
    """vLLM's ``cache_salt`` on chat completions, completions and responses (the openai SDK's
    extra_body): the same long prompt under another salt reports no cached prompt tokens, under
    its own salt it does; an empty salt is a 400 naming the field."""
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    srv = LiveServer(llm, "tiny")
    client = srv.client()
    text = " ".join(["the cat sat on the mat"] * 8)
    try:
        def chat(salt):
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2,
                                               extra_body={"cache_salt": salt} if salt else None)
            return r.usage.prompt_tokens_details.cached_tokens

        def completion(salt):
            r = client.completions.create(model="tiny", prompt=text, max_tokens=2, extra_body={"cache_salt": salt})
            return r.usage.prompt_tokens_details.cached_tokens

        assert chat(None) == 0 and chat(None) > 0
        assert chat("tenant-a") == 0 and chat("tenant-b") == 0 and chat("tenant-a") > 0
        assert completion("tenant-c") == 0 and completion("tenant-c") > 0
        r = client.responses.create(model="tiny", input=text, max_output_tokens=16, extra_body={"cache_salt": "d"})
        assert r.usage.input_tokens_details.cached_tokens == 0
        r = client.responses.create(model="tiny", input=text, max_output_tokens=16, extra_body={"cache_salt": "d"})
        assert r.usage.input_tokens_details.cached_tokens > 0
        bad = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "x", "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    finally:
        srv.stop()
        llm.close()


def test_chat_prompt_logprobs_are_transformers_log_softmax(tiny_gguf):
    """vLLM's ``prompt_logprobs`` on /v1/chat/completions (the openai SDK's extra_body): the
    answer's ``prompt_logprobs`` scores every token of the rendered prompt (the first None),
    each the log-softmax of `transformers`' logits at the position before it, with the asked
    number of alternatives; with stream, or with beam search, it is a 400 naming the field."""
    import torch

    path, hf = tiny_gguf["llama"]
    llm = LLM(str(path), dtype="float32")
    srv = LiveServer(llm, "tiny")
    messages = [{"role": "user", "content": "the cat sat on"}]
    try:
        r = srv.client().chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                                 extra_body={"prompt_logprobs": 2, "return_token_ids": True})
        ids, scored = r.model_extra["prompt_token_ids"], r.model_extra["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        for p in range(1, len(ids)):
            entry = {int(t): v["logprob"] for t, v in scored[p].items()}
            assert ids[p] in entry and abs(entry[ids[p]] - want[p - 1, ids[p]].item()) < 1e-4
            top2 = want[p - 1].topk(2).indices.tolist()
            assert set(top2) <= set(entry) and len(entry) <= 3
        body = {"model": "tiny", "messages": messages, "max_tokens": 1, "prompt_logprobs": 1}
        for extra in ({"stream": True}, {"use_beam_search": True}):
            bad = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, **extra})
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["param"] in ("prompt_logprobs", "use_beam_search")
    finally:
        srv.stop()
        llm.close()


def test_chat_echo_starts_the_answer_with_the_continued_message(tiny_gguf):
    """vLLM's chat ``echo`` with ``continue_final_message``: the answer is the last (assistant)
    message's text followed by what is generated without echo, streamed or not; after a user's
    message echo adds nothing."""
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    srv = LiveServer(llm, "tiny")
    client = srv.client()
    prefill = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    try:
        def answer(messages, extra, stream=False):
            kw = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=extra)
            if not stream:
                return client.chat.completions.create(**kw).choices[0].message.content
            return "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                           if ch.choices)

        plain = answer(prefill, cont)
        assert answer(prefill, {**cont, "echo": True}) == "sat on the" + plain
        assert answer(prefill, {**cont, "echo": True}, stream=True) == "sat on the" + plain
        user = [{"role": "user", "content": "the cat"}]
        assert answer(user, {"echo": True}) == answer(user, None)
    finally:
        srv.stop()
        llm.close()
