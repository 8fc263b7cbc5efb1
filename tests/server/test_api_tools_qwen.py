"""Tool calls the model chooses itself (tool_choice auto) on Qwen2.5-Coder-0.5B, whose own chat
template renders tools, through Anthropic's Messages API, OpenAI's Responses API and Ollama's
chat, each with its own client: the call comes back in that API's shape with valid arguments,
and the tool's result sent back gets the answer the chat route gives for the same history (what
the small model then says is its business). Slow: a model larger than the default one."""

from __future__ import annotations

import json

import httpx
import pytest

from nextoken import LLM
from tests.helpers.server import LiveServer

pytestmark = pytest.mark.slow

ASK = "What is the weather in Paris, in celsius? Use the tool."
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"]}


def chat_answer(srv, call_args: dict, tools: list[dict], max_tokens: int = 40) -> tuple[str, list]:
    """The chat route's answer (content, [(name, arguments)]) after the call and its result."""
    msgs = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(call_args)}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"}]
    m = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
        "model": "qwen", "messages": msgs, "tools": tools, "temperature": 0, "max_tokens": max_tokens}).json()
    m = m["choices"][0]["message"]
    return m["content"] or "", [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                for c in m.get("tool_calls") or []]


OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                  "parameters": PARAMS}}]


@pytest.fixture(scope="module")
def srv():
    from nextoken.catalog import pull

    s = LiveServer(LLM(str(pull("qwen2.5-coder-0.5b-instruct", progress=False)), max_num_seqs=4), "qwen")
    yield s
    s.stop()


def test_messages_tool_use_round_trip(srv):
    import anthropic  # the SDKs are imported where used: every worker collects this module

    c = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMS}]
    msg = c.messages.create(model="qwen", max_tokens=80, tools=tools, messages=[{"role": "user", "content": ASK}],
                            extra_body={"temperature": 0})
    use = next(b for b in msg.content if b.type == "tool_use")
    assert msg.stop_reason == "tool_use" and use.name == "get_weather" and use.input["city"] == "Paris"
    answer = c.messages.create(model="qwen", max_tokens=40, tools=tools, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}]}])
    text, calls = chat_answer(srv, use.input, OPENAI_TOOLS)
    assert "".join(b.text for b in answer.content if b.type == "text") == text
    assert [(b.name, b.input) for b in answer.content if b.type == "tool_use"] == calls


def test_responses_function_call_round_trip(srv):
    c = srv.client()
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}]
    first = c.responses.create(model="qwen", input=ASK, tools=tools, temperature=0, max_output_tokens=80)
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "get_weather" and "Paris" in call.arguments
    second = c.responses.create(model="qwen", previous_response_id=first.id, tools=tools, temperature=0,
                                max_output_tokens=40, input=[{"type": "function_call_output",
                                                              "call_id": call.call_id, "output": "21 C, sunny"}])
    text, calls = chat_answer(srv, json.loads(call.arguments), OPENAI_TOOLS)
    assert second.output_text == text
    assert [(o.name, json.loads(o.arguments)) for o in second.output if o.type == "function_call"] == calls


def test_ollama_tool_call_round_trip(srv):
    import ollama

    c = ollama.Client(host=srv.url)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": PARAMS}}]
    msgs = [{"role": "user", "content": ASK}]
    r = c.chat(model="qwen", messages=msgs, tools=tools, options={"temperature": 0, "num_predict": 80})
    call = r.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments["city"] == "Paris"
    again = c.chat(model="qwen", tools=tools, options={"temperature": 0, "num_predict": 40}, messages=msgs + [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "content": "21 C, sunny"}])
    text, calls = chat_answer(srv, call.function.arguments, OPENAI_TOOLS)
    assert (again.message.content or "") == text
    assert [(c.function.name, c.function.arguments) for c in again.message.tool_calls or []] == calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_leaks_no_markup_in_any_api(srv, stream):
    """The model starts its call (``<tool_call>\\n{"``) and meets max_tokens 3: every API ends as
    cut (length / max_tokens / incomplete / done_reason length) with no text and no call, not the
    markup as text."""
    import anthropic
    import ollama

    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}]
    msgs = [{"role": "user", "content": ASK}]
    if stream:
        chunks = list(srv.client().chat.completions.create(model="qwen", messages=msgs, tools=OPENAI_TOOLS,
                                                            temperature=0, max_tokens=3, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    else:
        m = srv.client().chat.completions.create(model="qwen", messages=msgs, tools=OPENAI_TOOLS, temperature=0,
                                                 max_tokens=3).choices[0]
        text, finish = m.message.content or "", m.finish_reason
    assert (text, finish) == ("", "length")
    a = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    kw = dict(model="qwen", max_tokens=3, messages=msgs, extra_body={"temperature": 0},
              tools=[{"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMS}])
    if stream:
        with a.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = a.messages.create(**kw)
    assert msg.stop_reason == "max_tokens" and not [b for b in msg.content if b.type == "text" and b.text]
    r = srv.client().responses.create(model="qwen", input=ASK, tools=tools, temperature=0, max_output_tokens=3,
                                      stream=stream)
    if stream:
        r = [e for e in r if e.type == "response.incomplete"][0].response
    assert r.status == "incomplete" and r.output_text == ""
    o = ollama.Client(host=srv.url).chat(model="qwen", messages=msgs, tools=OPENAI_TOOLS, stream=False,
                                         options={"temperature": 0, "num_predict": 3})
    assert o.done_reason == "length" and (o.message.content or "") == "" and not o.message.tool_calls
