"""The one tool loop under the Responses API's MCP tools and Anthropic's connector
(`server.chat.tool_loop.ToolLoop`), driven with a scripted fake engine (one answer per pass) and a
fake MCP call: what it runs, in which order, within which budget, what the next pass sees, and
what ends it. The API-level behaviour (items, blocks, a real MCP server) is `test_mcp.py`'s."""

from __future__ import annotations

import asyncio
import json

import pytest

from nextoken.errors import InvalidRequest
from nextoken.sampling_params import SamplingParams
from nextoken.server.chat import tool_loop
from nextoken.server.chat.core import Prepared
from nextoken.server.chat.events import Finish, Text
from nextoken.server.chat.mcp_tools import Limits, MCPTool
from nextoken.server.chat.tool_loop import CallArgs, CallOpened, CallRan, CallsCut, LoopFailed, PassStarted, \
    Servers, ToolLoop
from tests.server.test_chat_core import FakeEngine, serving_with

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


class ScriptedEngine(FakeEngine):
    """One scripted answer per request: (pieces, finish reason of the last)."""

    def __init__(self, tok, cfg, script: list[tuple[list[str], str]]):
        super().__init__(tok, cfg, [])
        self.script = list(script)

    async def stream(self, rid):
        self.pieces, finish = self.script.pop(0)
        async for out in super().stream(rid):
            if out.finished:
                out.outputs[0].finish_reason = finish
            yield out


def server(approval: str = "never") -> Servers:
    tool = MCPTool(type="mcp", server_label="weather", server_url="http://mcp.test/mcp", require_approval=approval)
    return Servers(Limits(("*",), 1.0, 1 << 20), [], {"get_weather": tool, "add": tool})


@pytest.fixture
def harness(monkeypatch, smollm2_llm):
    """(loop factory, the specs each pass was prepared from, the calls run)."""
    tok = smollm2_llm.engine.tokenizer
    specs, ran = [], []

    async def fake_prepare(serving, spec):
        specs.append(spec)
        if getattr(serving, "refuse_after", None) is not None and len(specs) > serving.refuse_after:
            raise InvalidRequest("the conversation outgrew the context", "input")
        return Prepared(tok.encode("q"), SamplingParams(max_tokens=64), spec.tools, frozenset({"get_weather", "add"}))

    async def fake_call(tool, name, arguments, limits):
        ran.append((name, json.loads(arguments)))
        return f"21 C in {json.loads(arguments)['city']}", None

    monkeypatch.setattr(tool_loop, "prepare", fake_prepare)
    monkeypatch.setattr(tool_loop, "run_call", fake_call)

    def make(script, budget=8, approval="never", refuse_after=None):
        serving = serving_with(ScriptedEngine(tok, smollm2_llm.engine.config, script))
        serving.refuse_after = refuse_after
        spec = lambda conv, first: tool_loop.ChatSpec(list(conv), [{"type": "function"}],  # noqa: E731
                                                      "required" if first else "auto")
        return ToolLoop(serving, None, None, server(approval), [{"role": "user", "content": "q"}], spec, budget,
                        "resp_")
    return make, specs, ran


def events_of(loop: ToolLoop, approved=()) -> list:
    async def go():
        await loop.start(list(approved))
        return [ev async for ev in loop.events()]
    return asyncio.run(go())


def kinds(events) -> list[str]:
    return [type(e).__name__ for e in events if not type(e).__name__ == "Tokens"]


def test_a_call_runs_and_the_next_pass_sees_its_result(harness):
    """Pass one calls the tool (streamed as CallOpened / CallArgs / CallClosed), the call runs
    after the pass ends, its call and result join the conversation, and pass two answers;
    tool_choice forces the first pass only; usage adds both passes."""
    make, specs, ran = harness
    call = CALL.format(name="get_weather", city="Paris")
    loop = make([([call[:25], call[25:]], "stop"), (["It is ", "21 C."], "stop")])
    events = events_of(loop)
    k = kinds(events)
    assert k[:2] == ["PassStarted", "CallOpened"] and "CallArgs" in k
    assert k.index("CallClosed") < k.index("Finish") < k.index("CallsCut") < k.index("CallRan")
    assert k[k.index("CallRan") + 1] == "PassStarted" and k[-2:] == ["Finish", "CallsCut"]
    args = "".join(e.text for e in events if isinstance(e, CallArgs))
    assert json.loads(args) == {"city": "Paris"} and ran == [("get_weather", {"city": "Paris"})]
    (done,) = [e.call for e in events if isinstance(e, CallRan)]
    assert done.output == "21 C in Paris" and done.error is None and done.status == "completed"
    assert [s.tool_choice for s in specs] == ["required", "auto"]
    second = specs[1].messages
    assert second[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert second[-1] == {"role": "tool", "tool_call_id": done.id, "content": "21 C in Paris"}
    assert "".join(e.text for e in events if isinstance(e, Text)) == "It is 21 C."
    finishes = [e for e in events if isinstance(e, Finish)]
    assert loop.usage.completion_tokens == sum(f.usage.completion_tokens for f in finishes) > 0
    assert loop.finish == "stop" and loop.error is None


def test_the_budget_bounds_the_calls_and_the_pass_after_it_ends_the_answer(harness):
    """With a budget of one call and a model that calls on every pass: the first call runs, the
    second pass's call is not run (its error says why) and the loop ends there."""
    make, specs, ran = harness
    calls = [([CALL.format(name="get_weather", city=c)], "stop") for c in ("Paris", "Rome", "Oslo")]
    events = events_of(make(calls, budget=1))
    done = [e.call for e in events if isinstance(e, CallRan)]
    assert ran == [("get_weather", {"city": "Paris"})] and len(specs) == 2
    assert done[0].error is None and "not run" in done[1].error and "limit of 1" in done[1].error
    assert kinds(events).count("PassStarted") == 2


def test_a_call_needing_approval_ends_the_answer_and_runs_nothing(harness):
    """A call of a tool that needs approval is not run, nor is a call beside it in the same pass;
    the answer ends after that pass (the client approves in a later request)."""
    make, specs, ran = harness
    two = CALL.format(name="get_weather", city="Paris") + "\n" + CALL.format(name="add", city="x")
    events = events_of(make([([two], "stop")], approval="always"))
    opened = [e.call for e in events if isinstance(e, CallOpened)]
    assert [c.approval for c in opened] == [True, True] and ran == [] and len(specs) == 1
    assert not [e for e in events if isinstance(e, CallRan)]


def test_approved_calls_run_before_the_first_pass(harness):
    """Calls the client approved run in `start` (before any answer goes out): their results are
    in the first pass's conversation, and they come first in the events; a declined one is not
    run and the model sees why."""
    make, specs, ran = harness
    loop = make([(["Done."], "stop")])
    tool = server().owners["get_weather"]
    ok = tool_loop.ServerCall("mcp_a", "get_weather", tool, '{"city": "Lima"}', approval_request_id="mcpr_1")
    no = tool_loop.ServerCall("mcp_b", "get_weather", tool, '{"city": "Kyiv"}', error="the user declined this call")
    events = events_of(loop, [ok, no])
    assert [type(e) for e in events[:3]] == [CallRan, CallRan, PassStarted]
    assert ran == [("get_weather", {"city": "Lima"})]
    tool_msgs = [m for m in specs[0].messages if m["role"] == "tool"]
    assert tool_msgs == [{"role": "tool", "tool_call_id": "mcp_a", "content": "21 C in Lima"},
                         {"role": "tool", "tool_call_id": "mcp_b", "content": "error: the user declined this call"}]


def test_a_call_cut_by_the_token_limit_is_not_run(harness):
    """A pass that stops at max_tokens inside a call: CallsCut names it, nothing runs, and the
    answer ends with the length finish."""
    make, specs, ran = harness
    cut = CALL.format(name="get_weather", city="Paris")[:58]
    events = events_of(make([(["Checking. ", cut], "length")]))
    (c,) = [e for e in events if isinstance(e, CallsCut)]
    assert len(c.ids) == 1 and [s.name for s in c.server_calls] == ["get_weather"]
    assert ran == [] and loop_finish(events) == "length"


def loop_finish(events) -> str:
    return [e for e in events if isinstance(e, Finish)][-1].reason


def test_a_failure_after_the_first_pass_is_an_event_not_an_exception(harness):
    """A later pass that cannot be prepared (the conversation outgrew the context) ends the
    loop with LoopFailed naming the field, and `error` holds it; the call before it ran."""
    make, specs, ran = harness
    loop = make([([CALL.format(name="get_weather", city="Paris")], "stop"), (["x"], "stop")], refuse_after=1)
    events = events_of(loop)
    assert isinstance(events[-1], LoopFailed) and events[-1].field == "input"
    assert events[-1].code == "invalid_request_error" and isinstance(loop.error, InvalidRequest)
    assert ran == [("get_weather", {"city": "Paris"})]
    assert kinds(events).count("PassStarted") == 1  # the second pass never began
