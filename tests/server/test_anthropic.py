"""Anthropic's Messages API (`nextoken.server.anthropic`) with the real `anthropic` SDK against a
live server on SmolLM2: the same answers as the chat route, the SDK's own stream accumulation,
token counting, tool use with a forced grammar and its round trip, and errors in Anthropic's
shape."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from nextoken import LLM
from tests.helpers.server import LiveServer

TEMPLATE = Path(__file__).parents[1] / "data" / "chatml_tools.jinja"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def srv(smollm2_path):
    s = LiveServer(LLM(str(smollm2_path), max_num_seqs=8, chat_template=str(TEMPLATE)), "smollm2", api_key="k3y")
    yield s
    s.stop()


def client(srv, key="k3y") -> anthropic.Anthropic:
    import anthropic  # here: the SDK takes ~3 s to import, and every worker collects this module

    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0)


def test_message_equals_the_chat_route_and_counts_its_tokens(srv):
    msg = client(srv).messages.create(model="smollm2", max_tokens=24, messages=ASK, system="Be brief.",
                                      extra_body=GREEDY)
    chat = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": "Bearer k3y"}, json={
        "model": "smollm2", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, *ASK]}).json()
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "smollm2"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    counted = client(srv).messages.count_tokens(model="smollm2", messages=ASK, system="Be brief.")
    assert counted.input_tokens == msg.usage.input_tokens


def test_stream_equals_the_message_and_follows_the_event_sequence(srv):
    kw = dict(model="smollm2", max_tokens=20, messages=ASK, extra_body=GREEDY)
    whole = client(srv).messages.create(**kw)
    with client(srv).messages.stream(**kw) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds[1:3] == ["content_block_start", "content_block_delta"] or kinds[1] == "ping"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


def test_stop_sequence_and_max_tokens(srv):
    msg = client(srv).messages.create(model="smollm2", max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    full = client(srv).messages.create(model="smollm2", max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    word = full.split()[2]
    cut = client(srv).messages.create(model="smollm2", max_tokens=24, messages=ASK, stop_sequences=[word],
                                      extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word and word not in cut.content[0].text


def test_forced_tool_use_and_its_round_trip(srv):
    """tool_choice "tool": the grammar forces a call whose input follows the schema, streamed as
    input_json_delta pieces that join to the same input; the tool's result goes back as a
    tool_result block and the model answers in text."""
    c = client(srv)
    kw = dict(model="smollm2", max_tokens=60, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    msg = c.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    assert set(uses[0].input) == {"city", "unit"} and uses[0].input["unit"] in ("celsius", "fahrenheit")
    with c.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [uses[0].input]
    history = [kw["messages"][0], {"role": "assistant", "content": [u.model_dump() for u in uses]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": json.dumps({"temperature": 21})}]}]
    answer = c.messages.create(model="smollm2", max_tokens=20, messages=history, tools=[WEATHER],
                               extra_body=GREEDY)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body,status,kind", [
    ({"model": "smollm2", "messages": ASK}, 400, "invalid_request_error"),  # max_tokens is required
    ({"model": "smollm2", "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "invalid_request_error"),
    ({"model": "smollm2", "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error"),
    ({"model": "other", "max_tokens": 5, "messages": ASK}, 404, "not_found_error"),
    ({"model": "smollm2", "max_tokens": 5, "messages": ASK, "bogus": 1}, 400, "invalid_request_error"),
])
def test_errors_have_anthropics_shape(srv, body, status, kind):
    r = httpx.post(f"{srv.url}/v1/messages", headers={"x-api-key": "k3y"}, json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]


@pytest.mark.parametrize("message,where,says", [
    ({"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
     "messages.0.content.0", "'tool_use'"),
    ({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}, "messages.0.content.0",
     "'tool_result'"),
    ({"role": "system", "content": "x"}, "messages.0", "role must be one of 'user', 'assistant'"),
])
def test_each_role_takes_its_own_blocks_and_the_error_names_the_block(srv, message, where, says):
    """A user's turn holds text and tool_result blocks, an assistant's text and tool_use (the
    published schema says so per role): another block is a 400 naming it, not a "should be a
    valid string" from the other member of the content's union."""
    r = httpx.post(f"{srv.url}/v1/messages", headers={"x-api-key": "k3y"},
                   json={"model": "smollm2", "max_tokens": 5, "messages": [message]})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith(where + ":") and says in msg and "valid string" not in msg, msg


def test_x_api_key_is_the_servers_key(srv):
    import anthropic

    with pytest.raises(anthropic.AuthenticationError) as e:
        client(srv, key="wrong").messages.create(model="smollm2", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert httpx.post(f"{srv.url}/v1/chat/completions", headers={"x-api-key": "k3y"},
                      json={"max_tokens": 2, "messages": ASK}).status_code == 200


def test_a_final_assistant_message_is_continued(srv):
    """A prefill (the conversation ends with an assistant's text): the answer continues it, on
    Anthropic's API and Ollama's, and on OpenAI chat with vLLM's ``continue_final_message``, as
    /v1/completions continues the prompt that `transformers`' renderer makes with
    ``continue_final_message``; an empty final assistant message is a new turn, and trailing
    whitespace is refused as Anthropic refuses it."""
    import ollama
    from transformers.utils.chat_template_utils import render_jinja_template

    prefill = [*ASK, {"role": "assistant", "content": "The capital of France"}]
    text = render_jinja_template([prefill], chat_template=TEMPLATE.read_text(), continue_final_message=True)[0][0]
    assert text.endswith("<|im_start|>assistant\nThe capital of France")
    want = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": "Bearer k3y"}, json={
        "model": "smollm2", "prompt": text, "max_tokens": 12, "temperature": 0}).json()
    msg = client(srv).messages.create(model="smollm2", max_tokens=12, messages=prefill, extra_body=GREEDY)
    assert msg.content[0].text == want["choices"][0]["text"] and msg.usage.input_tokens == want["usage"]["prompt_tokens"]
    o = ollama.Client(host=srv.url, headers={"Authorization": "Bearer k3y"}).chat(
        model="smollm2", messages=prefill, options={"temperature": 0, "num_predict": 12})
    assert o.message.content == want["choices"][0]["text"]
    chat = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": "Bearer k3y"}, json={
        "model": "smollm2", "messages": prefill, "max_tokens": 12, "temperature": 0, "continue_final_message": True,
        "add_generation_prompt": False}).json()
    assert chat["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    empty = client(srv).messages.create(model="smollm2", max_tokens=12, messages=[*ASK, {"role": "assistant",
                                                                                       "content": ""}], extra_body=GREEDY)
    assert empty.content[0].text == client(srv).messages.create(model="smollm2", max_tokens=12, messages=ASK,
                                                                extra_body=GREEDY).content[0].text
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client(srv).messages.create(model="smollm2", max_tokens=4, messages=[*ASK, {"role": "assistant",
                                                                                   "content": "The capital "}])
