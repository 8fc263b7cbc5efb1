"""The published OpenAPI schema against what the server answers.

`test_schemathesis_finds_no_failure` runs schemathesis (PyPI) as a user would: its CLI against a
live server on the tiny model, every route but the inspector's endless event stream (it takes
no input, and each case waits on it; `test_inspect` reads it), coverage and fuzzing phases, bounded in examples
(and a fixed seed, so that CI reruns the same cases); the inspector's routes and the four
generation routes with the largest bodies get the coverage phase in the slow run (``-m slow``),
fuzzing in both. Its checks: no 5xx, statuses, content
types and bodies as documented, schema-violating requests refused, and schema-valid requests
accepted except for the refusals JSON Schema cannot state (tests/openapi_contract_hooks.py).
The other tests pin the fixes that the fuzzer found, one by one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from nextoken import LLM, SamplingParams
from tests.helpers.semantic_refusals import semantic_reason
from tests.helpers.server import LiveServer

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = Path(__file__).parents[1] / "data" / "chatml_tools.jinja"
CONTEXT = 256


@pytest.fixture(scope="module")
def tiny_srv(tiny_gguf):
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", max_model_len=CONTEXT, chat_template=str(TEMPLATE))
    srv = LiveServer(llm, "tiny", max_tokens_default=8)
    yield srv
    srv.stop()


# Fuzzed only by default, the coverage phase added in the slow run:
# - the inspector's 29 operations: a third of the coverage phase's 6,300 cases and two thirds of
#   the server's time (journeys, ablations, cache contrasts);
# - chat completions, completions, responses and messages: 3,000 of the other 4,200 cases and 32 s
#   of the phase's 36 on a 2-core Zen 4 (schemathesis drawing values past the schemas' cross-field
#   `not` rules). Their fields, each alone at a sample and a neutral value, are
#   `test_every_published_field_alone_is_accepted_or_named`'s, and the fixes the phase found are
#   pinned below one by one.
FUZZED_ONLY = "".join(f'[[operations]]\ninclude-path-regex = "{regex}"\nphases.coverage.enabled = false\n'
                      for regex in ("^/inspect/", "^/v1/(chat/completions|completions|responses|messages)$"))


@pytest.mark.subprocess
@pytest.mark.parametrize("full_coverage", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_schemathesis_finds_no_failure(tiny_srv, tmp_path, full_coverage):
    config = tmp_path / "schemathesis.toml"
    config.write_text("" if full_coverage else FUZZED_ONLY)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", f"{tiny_srv.url}/openapi.json",
           "--phases", "coverage,fuzzing", "--max-examples", "10", "--seed", "1", "--workers", "1",
           "--request-timeout", "60", "--exclude-checks", "positive_data_acceptance", "--no-color",
           "--exclude-path", "/inspect/api/live",  # an endless event stream: test_inspect reads it directly
           "--output-sanitize", "false"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.openapi_contract_hooks", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-6000:]
    assert "Tested: 54" in report and " passed" in report, report[-2000:]
    assert tiny_srv.idle(timeout=30)


def test_semantic_reasons_are_narrow():
    ctx = ("prompt has 51 tokens and max_tokens is 32: 83 > the context length 64 (max_model_len); shorten the "
           "prompt, lower max_tokens, or truncate the prompt (truncate_prompt)")
    assert semantic_reason(ctx) == "context"
    assert semantic_reason(ctx.replace("83 > the context length 64", "83 > the context length 90")) is None
    assert semantic_reason(ctx.replace("83", "84")) is None
    assert semantic_reason("prompt has 700 tokens; traces take at most 512") == "trace cap"
    assert semantic_reason("prompt has 7 tokens; traces take at most 512") is None
    assert semantic_reason("max_tokens must be an integer >= 1, got 0") is None
    assert semantic_reason("stream: Input should be a valid boolean (got 0)") is None
    off = "priority -4 needs the priority scheduling policy (serve --scheduling-policy priority); this server schedules fcfs"
    assert semantic_reason(off) == "priority off"
    assert semantic_reason("priority must be an integer, got 1.5") is None
    assert semantic_reason("the prompts must have as many tokens: 44 and 42") == "patch prompts"
    assert semantic_reason("MCP server URL 'x' is not allowed on this server; none are allowed (serve "
                           "--allow-mcp-url PATTERN)") == "mcp url"
    assert semantic_reason("mcp_servers[0].url: MCP server URL 'x' is not allowed on this server; none are "
                           "allowed (serve --allow-mcp-url PATTERN)") == "mcp url"
    assert semantic_reason("tools[0].server_url: MCP server URL 'x' is not allowed on this server; none are "
                           "allowed (serve --allow-mcp-url PATTERN)") is None
    # an adapter path with whitespace in it (the fuzzer's, seed 11, on a server with LoRA on)
    missing = "is missing (a PEFT adapter folder has adapter_config.json and adapter_model.safetensors)"
    assert semantic_reason(f"adapter 'a': \x84\x0cF/adapter_config.json {missing}") == "adapter folder"
    assert semantic_reason(f"adapter 'a': {missing}") is None
    assert semantic_reason(f"adapter \"it's\": x/adapter_config.json {missing}") == "adapter folder"


def test_schema_states_the_models_limits(tiny_srv):
    schema = httpx.get(tiny_srv.url + "/openapi.json").json()
    comps = schema["components"]["schemas"]
    vocab = tiny_srv.llm.engine.config.vocab_size
    assert comps["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    max_tokens = comps["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert max_tokens["maximum"] == CONTEXT - 1 and max_tokens["minimum"] == 0
    layer = next(p for p in schema["paths"]["/inspect/api/trace/{trace_id}/attention"]["get"]["parameters"]
                 if p["name"] == "layer")
    assert layer["schema"]["maximum"] == tiny_srv.llm.engine.config.num_layers - 1
    top = comps["ChatCompletionRequest"]["properties"]["top_logprobs"]["anyOf"][0]
    assert top["maximum"] == tiny_srv.llm.engine.max_logprobs == 20 and top["minimum"] == 0
    assert "x-maximum" not in str(schema)
    sse = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(sse) == {"application/json", "text/event-stream"}
    with httpx.Client(base_url=tiny_srv.url) as h:  # the bounds are the server's
        assert h.post("/detokenize", json={"tokens": [vocab - 1]}).status_code == 200
        assert h.post("/detokenize", json={"tokens": [vocab]}).status_code == 400


@pytest.mark.parametrize("body, field", [
    ({"prompt": "hi", "stream": 0}, "stream"),
    ({"prompt": "hi", "n": "2"}, "n"),
    ({"prompt": "hi", "seed": False}, "seed"),
    ({"prompt": "hi", "temperature": True}, "temperature"),
    ({"prompt": "hi", "seed": 2**53}, "seed"),
    ({"prompt": "hi", "max_tokens": 0, "echo": True, "n": 2}, "n"),
    ({"prompt": "hi", "logit_bias": {"-5": 1}}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": CONTEXT}, "max_tokens"),
])
def test_types_are_not_coerced(tiny_srv, body, field):
    r = httpx.post(tiny_srv.url + "/v1/completions", json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_integral_numbers_are_integers(tiny_srv):
    r = httpx.post(tiny_srv.url + "/v1/completions", json={"prompt": [5.0, 6], "max_tokens": 2.0, "n": 2.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["prompt_tokens"] == 2


def test_one_of_bodies(tiny_srv, monkeypatch):
    tok = tiny_srv.llm.engine.tokenizer
    monkeypatch.setattr(tok, "add_bos", True)  # a model that adds BOS (the tiny one does not)
    with httpx.Client(base_url=tiny_srv.url) as h:
        assert h.post("/tokenize", json={}).json()["error"]["param"] == "prompt"
        both = h.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "a"}]})
        assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
        plain = h.post("/tokenize", json={"prompt": "the cat", "add_special_tokens": False}).json()["tokens"]
        with_bos = h.post("/tokenize", json={"prompt": "the cat"}).json()["tokens"]
        assert with_bos == [tok.bos_token_id] + plain and tok.bos_token_id not in plain
        dev = h.post("/tokenize", json={"messages": [{"role": "developer", "content": "be brief"}]}).json()["tokens"]
        sys_ = h.post("/tokenize", json={"messages": [{"role": "system", "content": "be brief"}]}).json()["tokens"]
        assert dev == sys_
        wm = h.post("/v1/watermark/detect", json={"text": "the cat", "tokens": [1, 2]})
        assert wm.status_code == 400 and wm.json()["error"]["param"] == "text"


def test_cross_field_rules_are_refused(tiny_srv):
    cases = [({"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "/v1/completions"),
             ({"prompt": "hi", "guided_regex": "a", "use_beam_search": True}, "/v1/completions"),
             ({"prompt": "hi", "use_beam_search": True, "echo": True}, "/v1/completions"),
             ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "/v1/chat/completions"),
             ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "/v1/chat/completions"),
             ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "/v1/completions"),
             ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT, "max_completion_tokens": 1},
              "/v1/chat/completions")]
    for body, path in cases:
        r = httpx.post(tiny_srv.url + path, json={"max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)


def test_tool_arguments_that_are_not_json_render_as_text(tiny_srv):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = httpx.post(tiny_srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_inspector_missing_resources_are_404(tiny_srv):
    with httpx.Client(base_url=tiny_srv.url) as h:
        assert h.get("/inspect/api/trace/t999/attention", params={"layer": 0}).status_code == 404
        tid = h.post("/inspect/api/trace", json={"prompt": "the cat"}).json()["trace_id"]
        assert h.get(f"/inspect/api/trace/{tid}/lens", params={"position": 0}).status_code == 200
        r = h.get(f"/inspect/api/trace/{tid}/lens", params={"position": 50})
        assert r.status_code == 404 and r.json()["error"]["param"] == "position"
        assert h.get("/inspect/api/quant/error", params={"tensor": "nope"}).status_code == 404
        assert h.get("/inspect/api/sinusoidal", params={"dims": 63}).status_code == 400
        demo = h.post("/inspect/api/demo", json={"count": 2, "max_tokens": CONTEXT - 1})
        assert demo.status_code == 400 and "context length" in demo.json()["error"]["message"]
        emb = h.post("/inspect/api/embeddings", json={"words": ["a", "a", "a"]})
        assert emb.status_code == 200 and all(0 <= v <= 1 for v in emb.json()["explained_variance"])  # not NaN
    assert tiny_srv.idle(timeout=10)


def test_tiny_repetition_penalty_keeps_the_engine_alive(tiny_srv):
    """A penalty of 5e-324 made positive logits infinite, the softmax NaN, and torch.multinomial
    raise inside the step: the engine loop stopped for every request."""
    from nextoken.sample.logits_processors import apply_repetition_penalty

    logits = torch.tensor([3.0, -2.0, 1.0, 0.5])
    out = apply_repetition_penalty(logits[:3], 5e-324)  # the seen tokens 0, 1, 2
    assert torch.isfinite(out).all() and out[0] > logits[3] and out[2] > logits[3] and out[1] <= 0
    with httpx.Client(base_url=tiny_srv.url, timeout=30) as h:
        for params in ({"repetition_penalty": 5e-324}, {"repetition_penalty": 5e-324, "temperature": 1e-5},
                       {"top_p": 5e-324}):
            r = h.post("/v1/completions", json={"prompt": "the cat the cat", "max_tokens": 3, **params})
            assert r.status_code == 200, (params, r.text)
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    # and offline: the same request through LLM
    out = tiny_srv.llm.generate(["the cat"], SamplingParams(max_tokens=3, repetition_penalty=5e-324, seed=0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_an_extreme_length_penalty_keeps_the_engine_alive(tiny_srv):
    """Beam search with length_penalty 2.8e16 (the fuzzer's, seed 4) raised OverflowError in the
    hypotheses' score, ``logprob / length ** penalty``, inside the step: the engine loop stopped
    for every request. Such penalties score as the formula's limit; any other fault of a search
    ends that search alone."""
    from nextoken.beam import length_score

    assert length_score(-2.0, 4, 1.0) == -0.5 and length_score(-2.0, 1, 1e300) == -2.0
    assert length_score(-2.0, 3, 2.775615471358809e16) == 0.0 and length_score(-2.0, 3, -1e16) == float("-inf")
    assert length_score(0.0, 3, -1e16) == 0.0
    with httpx.Client(base_url=tiny_srv.url, timeout=60) as h:
        for penalty in (2.775615471358809e16, -1e16):
            r = h.post("/v1/completions", json={"prompt": ["the cat", "a"], "max_tokens": 4, "temperature": 1.9,
                                                 "use_beam_search": True, "n": 2, "best_of": 2,
                                                 "length_penalty": penalty})
            assert r.status_code == 200 and len(r.json()["choices"]) == 4, (penalty, r.text)
        assert h.get("/health").status_code == 200
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert tiny_srv.idle(timeout=10)


# -- every field of each API's published request schema ---------------------------------------
def _sample(tp, depth: int = 0):
    """A value of type `tp` (a `typing` annotation of the SDKs' request types): the first
    Literal, the first member of a Union that is not None, a TypedDict's required keys, one
    element for a list, a plain "x", 1, 0.5 or True."""
    import collections.abc
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated or origin in (typing.Required, typing.NotRequired):
        return _sample(args[0], depth)
    if origin is typing.Literal:
        return args[0]
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)), depth)
    if depth > 4:
        return None
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        return {k: _sample(hints[k], depth + 1) for k in tp.__required_keys__}
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence, typing.List):
        return [_sample(args[0], depth + 1)]
    if origin in (dict, typing.Dict):
        return {"k": _sample(args[1], depth + 1)}
    if hasattr(tp, "model_fields"):  # a pydantic model (the ollama package's types)
        return {k: _sample(f.annotation, depth + 1) for k, f in tp.model_fields.items() if f.is_required()}
    return {str: "x", int: 1, float: 0.5, bool: True}.get(tp, "x")


def _published_fields():
    """(route, base body, field, sample value) for every optional top-level field of the `openai`,
    `anthropic` and `ollama` packages' request types, the route's required fields aside."""
    import typing

    import ollama._types as ot
    from anthropic.types import message_create_params as ant
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as resp

    msg = [{"role": "user", "content": "the cat"}]
    routes = [("/v1/chat/completions", {"model": "tiny", "messages": msg, "max_tokens": 2},
               typing.get_type_hints(chat.CompletionCreateParamsBase)),
              ("/v1/responses", {"model": "tiny", "input": "the cat", "max_output_tokens": 2},
               typing.get_type_hints(resp.ResponseCreateParamsBase)),
              ("/v1/messages", {"model": "tiny", "messages": msg, "max_tokens": 2},
               typing.get_type_hints(ant.MessageCreateParamsBase)),
              ("/api/chat", {"model": "tiny", "messages": msg, "stream": False, "options": {"num_predict": 2}},
               {k: f.annotation for k, f in ot.ChatRequest.model_fields.items()}),
              ("/api/generate", {"model": "tiny", "prompt": "the cat", "stream": False, "options": {"num_predict": 2}},
               {k: f.annotation for k, f in ot.GenerateRequest.model_fields.items()})]
    for route, base, hints in routes:
        for field, tp in sorted(hints.items()):
            if field not in base and field != "model":
                yield route, base, field, _sample(tp)


def test_every_published_field_alone_is_accepted_or_named(tiny_srv):
    """Each optional field of each API's published request schema (generated from the SDKs'
    request types, not a hand list), sent alone with a sample value: 200, or a 400 (404 for an id
    of something not stored) whose error names the field. The fields that change nothing here are accepted at the values that mean
    nothing (`server.api.published`): those answer 200 at their neutral value too."""
    from nextoken.server.app.routers import published_tables

    seen = 0
    with httpx.Client(base_url=tiny_srv.url, timeout=60) as h:
        for route, base, field, value in _published_fields():
            r = h.post(route, json={**base, field: value})
            text = r.text
            assert r.status_code == 200 or (r.status_code in (400, 404) and field in text), \
                (route, field, value, text[:300])
            seen += 1
        for route, table in published_tables().items():  # each at a value that means nothing here
            base = next(b for rt, b, _, _ in _published_fields() if rt == route.split(" ")[1])
            for field, entry in table.items():
                neutral = next(v for v in (None, False, 0, "", [], {}, ["text"], "disabled", "x", {"k": "x"})
                               if entry.allows(v))
                r = h.post(route.split(" ")[1], json={**base, field: neutral})
                assert r.status_code == 200, (route, field, neutral, r.text[:300])
    assert seen > 90


def test_a_published_field_at_a_value_not_honoured_names_field_and_value(tiny_srv):
    with httpx.Client(base_url=tiny_srv.url, timeout=60) as h:
        r = h.post("/v1/responses", json={"model": "tiny", "input": "hi", "background": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"
        assert r.json()["error"]["message"].startswith("background true is not supported")
        r = h.post("/v1/responses", json={"model": "tiny", "input": "hi", "include": ["file_search_call.results"]})
        assert r.status_code == 400 and "include" in r.json()["error"]["message"]
        r = h.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2, "include": [],
                                          "store": False, "text": {"verbosity": "low"}, "truncation": "disabled"})
        assert r.status_code == 200  # what an agent SDK sends


def test_ollama_reads_a_body_without_content_type_as_json(tiny_srv):
    """As Ollama does (an LLM gateway's provider posts so), with its message fields (images)."""
    import json

    body = json.dumps({"model": "tiny", "stream": False, "options": {"num_predict": 2},
                       "messages": [{"role": "user", "content": "the cat", "images": []}]})
    r = httpx.post(f"{tiny_srv.url}/api/chat", content=body.encode())  # httpx sends no Content-Type for bytes
    assert r.status_code == 200 and r.json()["done"] is True
