"""OpenAI's Responses API (`nextoken.server.openai.responses`) with the real `openai` SDK
(``client.responses``) against a live server on SmolLM2: the chat route's answers, the stream's
events joined, structured output, a function-call round trip, the store with
previous_response_id, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from nextoken import LLM
from tests.helpers.server import LiveServer

TEMPLATE = Path(__file__).parents[1] / "data" / "chatml_tools.jinja"
ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}


@pytest.fixture(scope="module")
def srv(smollm2_path):
    s = LiveServer(LLM(str(smollm2_path), max_num_seqs=8, chat_template=str(TEMPLATE)), "smollm2",
                   responses_store=3)
    yield s
    s.stop()


def test_response_equals_the_chat_route(srv):
    c = srv.client()
    r = c.responses.create(model="smollm2", input=ASK, instructions="Be brief.", temperature=0, max_output_tokens=24)
    chat = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert r.object == "response" and r.output[0].type == "message"
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens


def test_stream_joins_to_the_response(srv):
    c = srv.client()
    kw = dict(model="smollm2", input=ASK, temperature=0, max_output_tokens=20)
    whole = c.responses.create(**kw)
    events = list(c.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_logprobs_equal_the_chat_routes(srv):
    """``include: ["message.output_text.logprobs"]`` with `top_logprobs`: the output_text part
    carries each token's log-probability and alternatives, equal to the chat route's
    ``logprobs.content``, unstreamed and streamed (in the final response); without it, none."""
    c = srv.client()
    kw = dict(model="smollm2", input=ASK, temperature=0, max_output_tokens=12)
    chat = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=12, logprobs=True, top_logprobs=3,
                                     messages=[{"role": "user", "content": ASK}])
    want = [e.model_dump() for e in chat.choices[0].logprobs.content]
    r = c.responses.create(include=["message.output_text.logprobs"], top_logprobs=3, **kw)
    got = [e.model_dump() for e in r.output[0].content[0].logprobs]
    assert got == want and len(got) == chat.usage.completion_tokens and len(got[0]["top_logprobs"]) == 3
    events = list(c.responses.create(stream=True, include=["message.output_text.logprobs"], top_logprobs=3, **kw))
    assert [e.model_dump() for e in events[-1].response.output[0].content[0].logprobs] == want
    assert not c.responses.create(**kw).output[0].content[0].logprobs


def test_structured_output_through_text_format(srv):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = srv.client().responses.create(model="smollm2", input="Name a city in JSON.", temperature=0,
                                      max_output_tokens=40, text={"format": {"type": "json_schema", "name": "city",
                                                                             "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_function_call_round_trip_and_the_store(srv):
    """A forced call (a grammar), its output sent back as a function_call_output item through
    previous_response_id (the stored conversation), and the stored response read and deleted."""
    c = srv.client()
    first = c.responses.create(model="smollm2", input="Weather in Paris?", tools=[WEATHER], temperature=0,
                               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "unit"}
    second = c.responses.create(model="smollm2", previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                max_output_tokens=20, input=[{"type": "function_call_output",
                                                              "call_id": calls[0].call_id, "output": "21 C"}])
    assert second.status in ("completed", "incomplete") and second.output
    assert c.responses.retrieve(first.id).id == first.id
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


def test_store_is_bounded_and_errors_name_the_field(srv):
    c = srv.client()
    ids = [c.responses.create(model="smollm2", input=f"Say {i}.", temperature=0, max_output_tokens=2).id
           for i in range(4)]
    with pytest.raises(openai.NotFoundError):  # the store keeps 3: the oldest is gone
        c.responses.retrieve(ids[0])
    assert c.responses.retrieve(ids[-1]).id == ids[-1]
    for body, param in [({"input": ASK, "tool_choice": "required"}, "tool_choice"),
                        ({"input": ASK, "temperature": 3}, "temperature"),
                        ({"input": []}, "input"), ({"input": ASK, "bogus": 1}, "bogus")]:
        r = httpx.post(f"{srv.url}/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_previous_response_id_without_a_store_is_a_clear_400(tiny_gguf):
    s = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny", responses_store=0)
    try:
        r = httpx.post(f"{s.url}/v1/responses", json={"input": "hi", "previous_response_id": "resp_x"})
        assert r.status_code == 400 and "store" in r.json()["error"]["message"]
    finally:
        s.stop()
