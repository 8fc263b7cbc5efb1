"""Tool calling and structured output through the HTTP server (the real `openai` client), and
the tool-call stream parser fed at every split point."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from nextoken import LLM
from nextoken.server.chat.events import Text, ToolCallArgs, ToolCallStart
from nextoken.server.chat.tools import ToolCallParser, messages_for_template, parse
from tests.helpers.server import LiveServer

TEMPLATE = Path(__file__).parents[1] / "data" / "chatml_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

TEXTS = [
    "Hello there", "  Hi  ", "a < b <tool_call> junk </tool_call> end", "x <tool_c",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "d": {"x": [1, 2]}}}\n</tool_call>',
    'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
    '{"name": "b", "arguments": {"q": "x}</tool_call"}}\n</tool_call>\n',
    '<tool_call>\n{"name": "f", "arguments": {"k": 1}}\n</tool',
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
    '{"name": "get_weather", "arguments": {"a": 1}}', '{"name": "other", "arguments": {}}', '{"a": 1} and more',
]


def _events_to_result(events):
    content = "".join(e.text for e in events if isinstance(e, Text))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.call for s in starts] == list(range(len(starts)))  # numbered in order, each once
    args = ["".join(e.text for e in events if isinstance(e, ToolCallArgs) and e.call == i) for i in range(len(starts))]
    return content, [s.name for s in starts], args


@pytest.mark.parametrize("text", TEXTS)
def test_stream_parser_gives_the_whole_text_result_at_every_split(text):
    names = {"get_weather", "f", "a", "b"}
    whole = parse(text, names)
    expected = (whole.content, [c.name for c in whole.calls], [c.arguments for c in whole.calls])
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1, 5):
            p = ToolCallParser(names)
            events = p.feed(text[:cut]) + p.feed(text[cut:cut2]) + p.feed(text[cut2:]) + p.finish()
            assert _events_to_result(events) == expected, (cut, cut2)
    for call in whole.calls:  # what it calls arguments is JSON
        json.loads(call.arguments)


def test_parser_results():
    r = parse(TEXTS[5])
    assert r.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in r.calls] == [("a", {}), ("b", {"q": "x}</tool_call"})]
    assert parse(TEXTS[2]).content == TEXTS[2] and not parse(TEXTS[2]).calls
    assert parse(TEXTS[7], {"get_weather"}).calls[0].name == "get_weather"
    assert not parse(TEXTS[9], {"get_weather"}).calls  # not one of the tools: plain content


@pytest.mark.parametrize("tail", ['<tool_call>\n{"', '<tool_call>\n{"name": "b", "arguments": {"q": "Par',
                                  "<tool_", "<tool_call>"])
def test_a_call_cut_by_the_token_limit_leaves_no_markup(tail):
    """A text stopped at max_tokens inside a call: the complete calls only, and none of the cut
    call's markup as content, whole or streamed in any split (the same text that ended on its own
    keeps an unclosed tag that never named a tool as content, as before)."""
    whole = 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n' + tail
    r = parse(whole, {"a", "b"}, cut=True)
    assert r.content == "Sure." and [(c.name, json.loads(c.arguments)) for c in r.calls] == [("a", {"x": 1})]
    for split in range(len(whole) + 1):
        p = ToolCallParser({"a", "b"})
        events = p.feed(whole[:split]) + p.feed(whole[split:]) + p.finish(cut=True)
        assert "".join(e.text for e in events if isinstance(e, Text)) == "Sure.", split
        assert [c.name for c in p.calls] == ["a"]
    if tail == '<tool_call>\n{"':
        assert parse(whole, {"a", "b"}).content == 'Sure.\n<tool_call>\n{"'


def test_an_untagged_call_cut_by_the_token_limit_is_no_content():
    """Small models often write the call object without its tags: cut, it is dropped too."""
    for text in ('{"name":', '```json\n{"name": "a", "argu'):
        assert parse(text, {"a"}, cut=True).content == "" and parse(text, {"a"}).content == text
    assert parse('{"name": 1} is JSON', {"a"}, cut=True).content == '{"name": 1} is JSON'


def test_several_untagged_calls_and_a_cut_one():
    """Qwen2.5 often writes its calls as bare objects, one per line: each is a call, whole or
    streamed at any split; at the token limit the complete ones stay calls and the one cut short
    is dropped (before, the answer came back empty, with no calls); an object that is no call
    makes the whole answer content."""
    names = {"get_weather", "get_time"}
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_time", "arguments": {"tz": "CET"}}'
    want = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    for answer in (text, "```json\n" + text + "\n```"):
        r = parse(answer, names)
        assert r.content == "" and [(c.name, json.loads(c.arguments)) for c in r.calls] == want
        for split in range(0, len(answer) + 1, 3):
            p = ToolCallParser(names)
            events = p.feed(answer[:split]) + p.feed(answer[split:]) + p.finish()
            assert _events_to_result(events) == ("", [n for n, _ in want], [c.arguments for c in r.calls]), split
    cut = text + '\n{"name": "get_weather", "arguments": {"city": "Ly'
    for answer in (cut, "```json\n" + cut):
        r = parse(answer, names, cut=True)
        assert r.content == "" and [(c.name, json.loads(c.arguments)) for c in r.calls] == want
    mixed = text + '\n{"note": "done"}'
    assert parse(mixed, names).content == mixed and not parse(mixed, names).calls


def test_tool_call_arguments_go_back_to_the_template_as_objects():
    msgs = messages_for_template([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}])
    assert msgs[0]["content"] == "" and msgs[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


@pytest.fixture(scope="module")
def smol(smollm2_path):
    srv = LiveServer(LLM(str(smollm2_path), max_num_seqs=8), "smollm2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def smol_tools(smollm2_path):
    srv = LiveServer(LLM(str(smollm2_path), max_num_seqs=8, chat_template=str(TEMPLATE)), "smollm2")
    yield srv
    srv.stop()


def _streamed_calls(stream):
    names, args, content, finish = {}, {}, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.function.name:
                assert tc.index not in names  # the name comes once
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    return content, [names[i] for i in sorted(names)], [args[i] for i in sorted(args)], finish


def test_a_template_without_tools_refuses_tools_unless_one_is_given(smol, smol_tools):
    with pytest.raises(openai.BadRequestError, match="no tool-call support") as e:
        smol.client().chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=5)
    assert e.value.body["param"] == "tools"
    r = smol.client().chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="none",
                                              max_tokens=5)
    assert r.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        smol.client().chat.completions.create(model="smollm2", messages=ASK, tool_choice="required", max_tokens=5)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid_and_streams_equal_the_whole(smol_tools, choice):
    client = smol_tools.client()
    kw = dict(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
              max_tokens=120, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    calls = c.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
    if isinstance(choice, dict):
        assert calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])
    content, names, args, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert (names, args, finish) == ([calls[0].function.name], [calls[0].function.arguments], "tool_calls")
    assert content == (c.message.content or "")
    # the second turn: the call and its result go back through the template
    follow = ASK + [c.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21}'}]
    r2 = client.chat.completions.create(model="smollm2", messages=follow, tools=[WEATHER, TIME], temperature=0,
                                        max_tokens=20)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = smol_tools.llm.engine.tokenizer.apply_chat_template(
        messages_for_template(follow), tools=[WEATHER, TIME])
    assert json.dumps(json.loads(calls[0].function.arguments)) in prompt  # an object, not a string
    assert '"{\\"' not in prompt


def test_response_format_and_guided_fields(smol):
    client = smol.client()

    class Person(BaseModel):
        name: str
        age: int

    schema = Person.model_json_schema()
    schema["properties"]["name"]["maxLength"] = 12
    schema["properties"]["age"].update(minimum=0, maximum=99)
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Invent a person."}], temperature=1.0, seed=3,
        max_tokens=60, n=4, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    for c in r.choices:
        Person.model_validate_json(c.message.content)
    parsed = client.beta.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "A person."}],
                                                response_format=Person, temperature=0, max_tokens=60)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    with pytest.raises(openai.LengthFinishReasonError):
        client.beta.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "A person."}],
                                           response_format=Person, temperature=0, max_tokens=3)
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=30, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="smollm2", prompt="Answer:", max_tokens=5, temperature=1.0, n=6, seed=1,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in r.choices} <= {"yes", "no"}
    r = client.completions.create(model="smollm2", prompt="Code:", max_tokens=10, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    r = client.completions.create(model="smollm2", prompt="Pair:", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'start: "(" /[a-z]+/ ")"'})
    assert r.choices[0].text.startswith("(") and r.choices[0].text.endswith(")")


def test_streamed_events_read_whole_by_a_line_splitting_client(smol):
    """A client that reads the event stream with httpx's ``iter_lines`` (hand-written clients,
    the serving benchmark's) gets each event whole when the text holds U+2028, U+0085 or U+2029,
    at which that reader splits lines though server-sent events do not (the regex forces them)."""
    text = "a\u2028b\u0085c\u2029d"
    body = {"model": "smollm2", "messages": ASK, "stream": True, "max_tokens": 20, "temperature": 0,
            "structured_outputs": {"regex": text}}
    with httpx.stream("POST", smol.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    got = "".join(c["delta"].get("content") or "" for e in events for c in json.loads(e)["choices"])
    assert got == text


@pytest.mark.parametrize("splitter", ["\u2028\u0085\u2029", "\u2028", "\u0085", "\u2029"])
@pytest.mark.parametrize("write", ["openai", "responses", "anthropic", "ollama"])
def test_every_stream_escapes_the_line_splitting_characters(write, splitter):
    """Each API's streamed writer: the three characters, together or each alone, as JSON escapes,
    the event's JSON the same."""
    from nextoken.server.anthropic.render import event
    from nextoken.server.ollama.serving import _line
    from nextoken.server.openai.render import sse
    from nextoken.server.openai.responses_render import ResponseRenderer

    data = {"delta": f"x{splitter}y\u00e9"}
    out = {"openai": lambda: sse(data), "anthropic": lambda: event("content_block_delta", data),
           "ollama": lambda: _line(data), "responses": lambda: ResponseRenderer(True).emit("delta", data)}[write]()
    assert len(out.strip("\n").splitlines()) == out.strip("\n").count("\n") + 1  # no line breaks but the format's
    assert "\u00e9" in out and all(f"\\u{ord(c):04x}" in out for c in splitter)  # (other text stays as written)
    payload = out.strip("\n").split("data: ")[-1]
    assert json.loads(payload)["delta"] == data["delta"]


@pytest.mark.parametrize("body,param", [
    ({"guided_json": {"type": "objekt"}}, "json_schema"),
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "use_beam_search": True}, "guided_regex"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "json": {"type": "object"}}}, "structured_outputs"),
])
def test_bad_constraints_are_400_naming_the_field(smol, body, param):
    r = httpx.post(smol.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert httpx.get(smol.url + "/health").status_code == 200


def test_watermark_through_the_api(smol):
    client = smol.client()
    r = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=120, temperature=1.0,
                                  seed=9, extra_body={"watermark": True, "min_tokens": 120})
    scored = httpx.post(smol.url + "/v1/watermark/detect", json={"text": r.choices[0].text}).json()
    assert scored["z_score"] > 4 and scored["num_tokens_scored"] > 100 and scored["gamma"] == 0.5
    r = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=120, temperature=1.0,
                                  seed=9, extra_body={"min_tokens": 120})
    plain = httpx.post(smol.url + "/v1/watermark/detect", json={"text": r.choices[0].text}).json()
    assert plain["z_score"] < 4 and not plain["watermarked"]
    bad = httpx.post(smol.url + "/v1/watermark/detect", json={"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.slow
def test_qwen_tool_calls_in_its_native_format_round_trip():
    """Qwen2.5-Coder-0.5B with its own template: required, named and auto calls are valid, the
    stream equals the whole answer, and a second turn with the results renders and answers."""
    from nextoken.catalog import pull

    llm = LLM(str(pull("qwen2.5-coder-0.5b-instruct", progress=False)), max_num_seqs=4)
    tok = llm.engine.tokenizer
    pads = sorted(tok.unused_ids)
    assert len(pads) > 200  # [PAD151665] ...
    srv = LiveServer(llm, "qwen")
    try:
        client = srv.client()
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto"):
            kw = dict(model="qwen", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
                      max_tokens=100, parallel_tool_calls=False)
            c = client.chat.completions.create(**kw).choices[0]
            assert c.finish_reason == "tool_calls", (choice, c)
            call = c.message.tool_calls[0]
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            _, names, args, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
            assert (names, args, finish) == ([call.function.name], [call.function.arguments], "tool_calls")
        follow = ASK + [c.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
        r2 = client.chat.completions.create(model="qwen", messages=follow, tools=[WEATHER, TIME], temperature=0,
                                            max_tokens=60)
        assert r2.choices[0].message.content
        # inside structured output the reserved [PAD] ids are never allowed
        from nextoken.structured import StructuredOutputsParams

        g = llm.engine.grammars.sequence_grammar(StructuredOutputsParams(json={"type": "string"}))
        g.accept(tok.encode('"', add_bos=False)[0])
        allowed = g.allowed()
        assert allowed.shape[0] == llm.engine.config.vocab_size and allowed.sum() > 100000
        assert not allowed[pads].any()
    finally:
        srv.stop()
