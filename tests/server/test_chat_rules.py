"""The rules every chat API shares (`server.chat.rules`): declared once, checked once on the
chat core's spec, each API's error naming its own field, and each API's published schema
stating them in its own names (so the contract fuzzer never sends a body that breaks one)."""

from __future__ import annotations

import httpx
import pytest
from jsonschema import Draft202012Validator

from nextoken.server.anthropic.protocol import MessagesRequest
from nextoken.server.openai.protocol import ChatCompletionRequest
from nextoken.server.openai.responses import ResponsesRequest
from tests.server.test_answers import ASK, WEATHER, srv  # noqa: F401 - the shared live server

FORCING_WITHOUT_TOOLS = [
    ("/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 4, "tool_choice": "required"},
     ChatCompletionRequest),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4,
                       "tool_choice": {"type": "function", "name": "get_weather"}}, ResponsesRequest),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}},
     MessagesRequest),
]
FORCED_WITH_A_FORMAT = [
    ("/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 4, "tool_choice": "required",
                              "tools": [{"type": "function", "function": WEATHER}],
                              "response_format": {"type": "json_object"}}, ChatCompletionRequest),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4, "tool_choice": "required",
                       "tools": [{"type": "function", **WEATHER}], "text": {"format": {"type": "json_object"}}},
     ResponsesRequest),
]


def breaks_published(model, body: dict) -> bool:
    """Whether `body` breaks a rule the model's published schema states (its ``not``)."""
    schema = model.model_json_schema()
    return Draft202012Validator(schema["not"]).is_valid(body)


@pytest.mark.parametrize("path,body,model", FORCING_WITHOUT_TOOLS + FORCED_WITH_A_FORMAT)
def test_a_shared_rule_is_one_400_in_each_apis_names_and_in_its_schema(srv, path, body, model):  # noqa: F811
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    text = r.text
    assert "tool_choice" in text and ("needs tools" in text or "cannot be combined with" in text), text
    if "response_format" in body:
        assert "response_format" in text
    if "text" in body:
        assert "text.format" in text
    assert breaks_published(model, body)  # the schema says so in the API's own names
    fine = {k: v for k, v in body.items() if k not in ("tool_choice",)}
    assert not breaks_published(model, fine)
    assert httpx.post(srv.url + path, json=fine, timeout=60).status_code == 200


def test_auto_without_tools_is_a_plain_answer_on_every_api(srv):  # noqa: F811
    """Only a forcing choice needs tools: "auto" (the default) and "none" without tools answer."""
    for choice in ("auto", "none"):
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 3,
                                                               "tool_choice": choice}, timeout=60)
        assert r.status_code == 200, r.text
