"""Typed answers: every API route declares its 200 body (`bodies.Answer` models in each API's
``protocol``), so /openapi.json publishes it and the server checks what it sends; and every
event of every API's stream is one of the stream models its protocol declares. The tiny model
is forced to call tools (tool_choice "required", a grammar), and asked for log-probabilities,
so each kind of chunk occurs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from pydantic import TypeAdapter

from nextoken import LLM
from nextoken.server.anthropic import protocol as anthropic
from nextoken.server.ollama import protocol as ollama
from nextoken.server.openai import protocol as openai
from tests.helpers.server import LiveServer

TEMPLATE = Path(__file__).parents[1] / "data" / "chatml_tools.jinja"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                          "additionalProperties": False}}  # (an enum: the random model ends its call)
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tiny_gguf, tmp_path_factory):
    from tests.tiny_models import write_gguf

    path = tmp_path_factory.mktemp("answers") / "tiny-long.gguf"  # (tools' schemas make long prompts)
    write_gguf(tiny_gguf["llama"][1], path, "llama", context_length=2048)
    llm = LLM(str(path), dtype="float32", chat_template=str(TEMPLATE))
    s = LiveServer(llm, "tiny")
    yield s
    s.stop()


def sse(r: httpx.Response) -> list:
    """The JSON of each ``data:`` line of a server-sent event stream (but ``[DONE]``)."""
    return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and line != "data: [DONE]"]


def post(srv, path: str, body: dict, stream: bool) -> list:
    """The answer's body (one), or its stream's events."""
    body = {**body, "stream": stream}
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        if not stream:
            return [json.loads(r.read())]
        if path.startswith("/api/"):
            return [json.loads(line) for line in r.iter_lines() if line]
        return sse(r)


def check(model, items: list) -> None:
    adapter = TypeAdapter(model)
    for item in items:
        adapter.validate_python(item)


def test_every_routes_200_body_is_published(srv):
    """Each route of the APIs declares its answer: /openapi.json gives the 200 a schema (a
    reference to its model), not an empty one; the inspector's own views are the exception."""
    schema = httpx.get(srv.url + "/openapi.json").json()
    bare = []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            content = op["responses"].get("200", {}).get("content", {})
            json_schema = content.get("application/json", {}).get("schema")
            if path.startswith("/inspect") or path == "/metrics" or json_schema is None and content:
                continue  # the inspector's views; /metrics is Prometheus text
            if not json_schema:
                bare.append(f"{method.upper()} {path}")
    assert not bare, bare
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletion"}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_and_completions_answers_follow_their_models(srv, stream):
    plain = {"model": "tiny", "messages": ASK, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    forced = {"model": "tiny", "messages": ASK, "max_tokens": 120, "tools": [{"type": "function", "function": WEATHER}],
              "tool_choice": "required", "stream_options": {"include_usage": True} if stream else None}
    model = openai.ChatCompletionChunk if stream else openai.ChatCompletion
    for body in (plain, {k: v for k, v in forced.items() if v is not None}):
        events = post(srv, "/v1/chat/completions", body, stream)
        check(model, events)
    if stream:
        deltas = [c["delta"] for e in events for c in e["choices"]]
        assert any(d.get("tool_calls") for d in deltas) and events[-1]["usage"] is not None
    events = post(srv, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "logprobs": 2,
                                           "echo": True}, stream)
    check(openai.Completion, events)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_answers_follow_their_models(srv, stream):
    # greedy, so that the events a run yields do not depend on a draw
    body = {"model": "tiny", "input": "Weather in Paris?", "max_output_tokens": 120, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"], "temperature": 0}
    forced = {"model": "tiny", "input": "Weather in Paris?", "max_output_tokens": 120, "tool_choice": "required",
              "tools": [{"type": "function", **WEATHER}], "temperature": 0}
    model = openai.ResponseStreamEvent if stream else openai.ResponseObject
    kinds = set()
    for b in (body, forced):
        events = post(srv, "/v1/responses", b, stream)
        check(model, events)
        kinds |= {e.get("type") for e in events}
    if stream:
        assert {"response.output_text.delta", "response.function_call_arguments.delta",
                "response.output_item.done"} <= kinds, kinds
        # a run that reaches max_output_tokens ends incomplete (the Responses API's own terminal event)
        assert kinds & {"response.completed", "response.incomplete"}, kinds
    stored = httpx.get(f"{srv.url}/v1/responses/{events[-1]['response']['id'] if stream else events[0]['id']}")
    check(openai.ResponseObject, [stored.json()])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_answers_follow_their_models(srv, stream):
    # greedy, as the Responses test: a draw (Anthropic's default temperature is 1) now and then ends
    # the tiny model's answer at once, with no text_delta to check
    plain = {"model": "tiny", "max_tokens": 6, "messages": ASK, "temperature": 0}
    forced = {"model": "tiny", "max_tokens": 120, "messages": ASK, "tool_choice": {"type": "any"}, "temperature": 0,
              "tools": [{"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}]}
    model = anthropic.StreamEvent if stream else anthropic.MessageAnswer
    kinds = set()
    for body in (plain, forced):
        events = post(srv, "/v1/messages", body, stream)
        check(model, events)
        kinds |= {e["type"] for e in events} | {e.get("delta", {}).get("type") for e in events}
    if stream:
        assert {"message_start", "content_block_start", "text_delta", "input_json_delta", "message_delta",
                "message_stop"} <= kinds, kinds
    count = httpx.post(srv.url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": ASK}).json()
    check(anthropic.TokenCount, [count])


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_answers_follow_their_models(srv, stream):
    # (greedy: sampled, the random model can end at once or say only tokens without text, and an
    # empty answer streams as one line, the last; it did once in a clean-clone run)
    chat = post(srv, "/api/chat", {"model": "tiny", "messages": ASK, "options": {"num_predict": 6, "temperature": 0}},
                stream)
    check(ollama.ChatAnswer, chat)
    tools = post(srv, "/api/chat", {"model": "tiny", "messages": ASK, "options": {"num_predict": 120},
                                    "tools": [{"type": "function", "function": WEATHER}]}, stream)
    check(ollama.ChatAnswer, tools)
    gen = post(srv, "/api/generate", {"model": "tiny", "prompt": "Hello", "options": {"num_predict": 6}}, stream)
    check(ollama.GenerateAnswer, gen)
    assert chat[-1]["done"] and gen[-1]["done"] and (not stream or not chat[0]["done"])
    for path, model in (("/api/tags", ollama.ModelList), ("/api/ps", ollama.ModelList),
                        ("/api/version", ollama.VersionAnswer)):
        check(model, [httpx.get(srv.url + path).json()])
    check(ollama.ShowAnswer, [httpx.post(srv.url + "/api/show", json={"model": "tiny"}).json()])
