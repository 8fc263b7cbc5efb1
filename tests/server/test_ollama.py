"""Ollama's API (`nextoken.server.ollama`) with the real `ollama` client against a live server on
SmolLM2: chat and generate equal the OpenAI routes' answers, streamed lines join to the whole,
options and format reach the sampler, tools round-trip, the model listings, real counts and
durations, and errors in Ollama's shape."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import ollama
import pytest

from nextoken import LLM
from tests.helpers.server import LiveServer

TEMPLATE = Path(__file__).parents[1] / "data" / "chatml_tools.jinja"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 20}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


@pytest.fixture(scope="module")
def srv(smollm2_path):
    s = LiveServer(LLM(str(smollm2_path), max_num_seqs=8, chat_template=str(TEMPLATE)), "smollm2")
    yield s
    s.stop()


def test_chat_equals_the_chat_route_with_real_counts(srv):
    r = ollama.Client(host=srv.url).chat(model="smollm2:latest", messages=ASK, options=GREEDY)
    chat = srv.client().chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=20)
    assert r.message.role == "assistant" and r.message.content == chat.choices[0].message.content
    assert r.done and r.done_reason == {"stop": "stop", "length": "length"}[chat.choices[0].finish_reason]
    assert r.prompt_eval_count == chat.usage.prompt_tokens and r.eval_count == chat.usage.completion_tokens
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration > 0 and r.load_duration == 0


def test_streamed_lines_join_to_the_whole(srv):
    c = ollama.Client(host=srv.url)
    whole = c.chat(model="smollm2", messages=ASK, options=GREEDY)
    parts = list(c.chat(model="smollm2", messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == whole.eval_count
    gen = c.generate(model="smollm2", prompt="The capital of France is", raw=True, options=GREEDY)
    comp = srv.client().completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                           max_tokens=20)
    assert gen.response == comp.choices[0].text
    assert "".join(p.response for p in c.generate(model="smollm2", prompt="The capital of France is", raw=True,
                                                 options=GREEDY, stream=True)) == gen.response


def test_a_token_text_with_a_line_separator_stays_in_its_line(srv):
    """U+2028, U+0085 and U+2029 are not line ends of newline-delimited JSON, but the Ollama
    client reads the stream with httpx's ``iter_lines``, which splits at them: they are written as
    ``\\u`` escapes, and the streamed text is whole (the JSON schema's one value forces them)."""
    text = "a\u2028b\u0085c\u2029d"
    parts = list(ollama.Client(host=srv.url).chat(model="smollm2", messages=ASK, stream=True, options=GREEDY,
                                                   format={"type": "string", "enum": [text]}))
    assert json.loads("".join(p.message.content for p in parts)) == text


def test_options_and_format(srv):
    c = ollama.Client(host=srv.url)
    r = c.chat(model="smollm2", messages=ASK, options={"num_predict": 3, "temperature": 0})
    assert r.eval_count == 3 and r.done_reason == "length"
    seeded = [c.chat(model="smollm2", messages=ASK, options={"temperature": 1.0, "seed": 5, "num_predict": 12,
                                                            "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1})
              .message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    out = c.chat(model="smollm2", messages=[{"role": "user", "content": "Name a city in JSON."}], format=schema,
                 options={"temperature": 0, "num_predict": 40})
    assert set(json.loads(out.message.content)) == {"city"}


def test_tool_call_round_trip(srv):
    """A call the model makes comes back as message.tool_calls with its arguments as an object;
    sent back with the tool's answer, the chat goes on."""
    c = ollama.Client(host=srv.url)
    msgs = [{"role": "system", "content": "Call get_weather for weather questions."},
            {"role": "user", "content": "What is the weather in Paris in celsius?"}]
    r = c.chat(model="smollm2", messages=msgs, tools=[WEATHER], options={"temperature": 0, "num_predict": 60})
    calls = r.message.tool_calls or []
    if calls:  # the small model may answer in text; the parser and the history are what is tested
        assert calls[0].function.name == "get_weather" and isinstance(calls[0].function.arguments, dict)
    history = msgs + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "content": "21 C"}]
    again = c.chat(model="smollm2", messages=history, tools=[WEATHER], options={"temperature": 0, "num_predict": 20})
    assert again.done and (again.message.content or again.message.tool_calls)


def test_listings_and_errors(srv):
    c = ollama.Client(host=srv.url)
    assert [m.model for m in c.list().models] == ["smollm2"]
    assert [m.model for m in c.ps().models] == ["smollm2"]
    shown = c.show("smollm2")
    assert shown.modelinfo["general.architecture"] == "llama" and "tools" in shown.capabilities
    assert httpx.get(f"{srv.url}/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="other", messages=ASK)
    assert e.value.status_code == 404 and "other" in e.value.error
    for body in ({"model": "smollm2", "messages": ASK, "options": {"top_p": 2.0, "num_predict": 2}},
                 {"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]}):
        r = httpx.post(f"{srv.url}/api/chat", json={**body, "stream": False})
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text


def test_an_empty_prompt_loads_and_a_bad_option_names_options(srv):
    """Ollama's clients load a model by sending no prompt (generate) or no messages (chat); an
    option the sampler does not take is a 400 naming ``options``."""
    for path, body, key in (("/api/generate", {"model": "smollm2"}, "response"),
                            ("/api/chat", {"model": "smollm2", "messages": []}, "message")):
        r = httpx.post(f"{srv.url}{path}", json={**body, "stream": False})
        assert r.status_code == 200 and r.json()["done_reason"] == "load" and r.json()["done"], r.text
    r = httpx.post(f"{srv.url}/api/generate", json={"model": "smollm2", "prompt": "hi", "stream": False,
                                                     "options": {"top_p": "high", "num_predict": 2}})
    assert r.status_code == 400 and r.json()["error"].startswith("options"), r.text


def test_curl_bodies_and_old_clients(srv):
    """`curl URL/api/generate -d '{...}'`, as Ollama's API docs show it, sends the JSON as
    application/x-www-form-urlencoded: Ollama reads any body as JSON, and so do these routes.
    /api/show takes `name` (what older clients, LiteLLM among them, send) as well as `model`."""
    body = json.dumps({"model": "smollm2", "prompt": "The capital of France is", "stream": False,
                       "options": {"temperature": 0, "num_predict": 4}})
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(srv.url + "/api/generate", content=body, headers=form)
    want = httpx.post(srv.url + "/api/generate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["response"] == want.json()["response"] != ""
    show = [httpx.post(srv.url + "/api/show", content=json.dumps({k: "smollm2"}), headers=form) for k in ("model", "name")]
    assert [s.status_code for s in show] == [200, 200] and show[0].json() == show[1].json()
    bad = httpx.post(srv.url + "/api/generate", content="model=smollm2&prompt=hi", headers=form)
    assert bad.status_code == 400 and "error" in bad.json()
    missing = httpx.post(srv.url + "/api/pull", json={"model": "smollm2"})  # not served: Ollama's shape still
    assert missing.status_code == 404 and isinstance(missing.json()["error"], str)
