"""MCP tools run by the server (``/v1/responses`` ``{"type": "mcp"}`` tools), with an MCP server
made by the `mcp` package (its ``MCPServer``, streamable HTTP on loopback) and OpenAI's own
client: the listing, the call and its output as items in order, streamed and not; approvals
through ``previous_response_id``; and the failures (a URL not allowed, a server that is down, a
tool that hangs, one that returns 10 MB) each a clear error that leaves the server serving.

The tiny random model is forced to call (tool_choice "required", a grammar), so the mechanics
are exact; whether a real model uses the output is the slow test on Qwen2.5-Coder-0.5B."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from nextoken import LLM
from tests.helpers.server import LiveServer
from tests.ports import free_ports

TEMPLATE = Path(__file__).parents[1] / "data" / "chatml_tools.jinja"
HUGE = 10 * 1024 * 1024


def expected_output(name: str, args: dict) -> str:
    return f"21 C and sunny in {args['city']}" if name == "get_weather" else str(args["a"] + args["b"])


@pytest.fixture(scope="module")
def mcp_url():
    """An MCP server with get_weather and add (and slow, huge: the failures) on loopback."""
    from mcp.server.mcpserver import MCPServer

    srv = MCPServer("weather")

    @srv.tool()
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"21 C and sunny in {city}"

    @srv.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @srv.tool()
    async def slow() -> str:  # (no arguments: the random model cannot write them without end)
        """Takes a minute."""
        import anyio

        await anyio.sleep(60)
        return "late"

    @srv.tool()
    def huge() -> str:
        """Returns 10 MB."""
        return "x" * HUGE

    port = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(srv.streamable_http_app(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/mcp"
    server.should_exit = True


@pytest.fixture(scope="module")
def long_tiny(tiny_gguf, tmp_path_factory):
    """The tiny llama with a 2048-token context (tools' schemas make long prompts in its vocabulary)."""
    from tests.tiny_models import write_gguf

    path = tmp_path_factory.mktemp("mcp") / "tiny-long.gguf"
    write_gguf(tiny_gguf["llama"][1], path, "llama", context_length=2048)
    return path


@pytest.fixture(scope="module")
def srv(long_tiny, mcp_url):
    llm = LLM(str(long_tiny), dtype="float32", chat_template=str(TEMPLATE))
    port = mcp_url.split(":")[2].split("/")[0]
    s = LiveServer(llm, "tiny", allow_mcp_url=[f"http://127.0.0.1:{port}/*"], mcp_timeout=3.0,
                   mcp_max_output_bytes=1 << 20)
    yield s
    s.stop()


def mcp_tool(url: str, **kw) -> dict:
    return {"type": "mcp", "server_label": "weather", "server_url": url, "require_approval": "never",
            "allowed_tools": ["get_weather"], **kw}  # (the random model writes add's integers without end)


def check_call(item) -> None:
    assert item.type == "mcp_call" and item.server_label == "weather" and item.error is None
    assert item.name in ("get_weather", "add")
    assert item.output == expected_output(item.name, json.loads(item.arguments))


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_lists_calls_and_answers(srv, mcp_url, stream):
    c = srv.client()
    kw = dict(model="tiny", input="What is the weather in Paris?", tools=[mcp_tool(mcp_url)], tool_choice="required",
              max_tool_calls=1, max_output_tokens=120, temperature=0)
    if stream:
        events = list(c.responses.create(**kw, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert kinds.index("response.mcp_list_tools.completed") < kinds.index("response.mcp_call.completed")
        # token by token, as generated: the call's arguments in pieces before it runs, then the answer's text
        args = [e.delta for e in events if e.type == "response.mcp_call_arguments.delta"]
        assert len(args) > 1 and kinds.index("response.mcp_call_arguments.done") < kinds.index(
            "response.mcp_call.completed")
        done = next(e for e in events if e.type == "response.mcp_call_arguments.done")
        assert "".join(args) == done.arguments
        r = events[-1].response
    else:
        r = c.responses.create(**kw)
    listing, call, *rest = r.output
    assert listing.type == "mcp_list_tools" and [t.name for t in listing.tools] == ["get_weather"]
    assert listing.tools[0].input_schema["required"] == ["city"]
    check_call(call)
    assert rest and all(item.type == "message" for item in rest)  # the answer after the result (calls spent)
    assert r.usage.output_tokens > len(json.loads(call.arguments))  # two generations: the call, then the answer


def test_the_listing_follows_allowed_tools(srv, mcp_url):
    c = srv.client()
    for allowed, names in ((None, {"get_weather", "add", "slow", "huge"}), (["add"], {"add"}),
                           ({"tool_names": ["add", "huge"]}, {"add", "huge"})):
        r = c.responses.create(model="tiny", input="hi", tools=[mcp_tool(mcp_url, allowed_tools=allowed)],
                               tool_choice="none", max_output_tokens=4)
        assert r.output[0].type == "mcp_list_tools" and {t.name for t in r.output[0].tools} == names
        assert {t.name: t.description for t in r.output[0].tools}.get("add", "Add two integers.") == "Add two integers."


def test_approval_through_previous_response_id(srv, mcp_url):
    c = srv.client()
    tools = [mcp_tool(mcp_url, require_approval="always")]
    first = c.responses.create(model="tiny", input="Weather in Paris?", tools=tools, tool_choice="required",
                               max_output_tokens=120, temperature=0)
    ask = first.output[-1]
    assert [o.type for o in first.output] == ["mcp_list_tools", "mcp_approval_request"] and ask.name in ("get_weather",
                                                                                                   "add")
    second = c.responses.create(model="tiny", previous_response_id=first.id, tools=tools, max_tool_calls=1,
                                max_output_tokens=8, temperature=0,
                                input=[{"type": "mcp_approval_response", "approval_request_id": ask.id, "approve": True}])
    call = next(o for o in second.output if o.type == "mcp_call")
    check_call(call)
    assert call.approval_request_id == ask.id and call.arguments == ask.arguments
    declined = c.responses.create(model="tiny", previous_response_id=first.id, tools=tools, max_tool_calls=1,
                                  max_output_tokens=8, temperature=0, input=[
                                      {"type": "mcp_approval_response", "approval_request_id": ask.id,
                                       "approve": False}])
    call = next(o for o in declined.output if o.type == "mcp_call")
    assert call.output is None and "declined" in call.error


def test_failures_are_clear_and_the_server_keeps_serving(srv, mcp_url):
    h = httpx.Client(base_url=srv.url, timeout=60)
    base = {"model": "tiny", "input": "hi", "max_output_tokens": 120, "tool_choice": "required", "max_tool_calls": 1}
    r = h.post("/v1/responses", json={**base, "tools": [mcp_tool("http://example.com/mcp")]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].server_url"
    assert "not allowed" in r.json()["error"]["message"]
    port = free_ports(1)  # allowed (the pattern is by port), but nothing listens there
    down = mcp_url.replace(mcp_url.split(":")[2].split("/")[0], str(port))
    r = h.post("/v1/responses", json={**base, "tools": [mcp_tool(down)]})
    assert r.status_code in (400, 424)  # the port differs from the allowed pattern's, or the server is down
    for name, words in (("slow", "within 3 s"), ("huge", "over this server's limit")):
        t0 = time.time()
        r = h.post("/v1/responses", json={**base, "tools": [mcp_tool(mcp_url, allowed_tools=[name])]})
        assert r.status_code == 200, r.text
        call = next((o for o in r.json()["output"] if o["type"] == "mcp_call"), None)
        assert call is not None, (name, r.json()["output"])
        assert call["status"] == "failed" and words in call["error"] and call["output"] is None
        assert time.time() - t0 < 30
    assert h.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 4}).status_code == 200


def test_a_server_that_is_down_is_a_424_naming_the_tool(long_tiny):
    """A URL the allow-list takes where no MCP server listens."""
    port = free_ports(1)
    llm = LLM(str(long_tiny), dtype="float32", chat_template=str(TEMPLATE))
    s = LiveServer(llm, "tiny", allow_mcp_url=["http://127.0.0.1:*"], mcp_timeout=2.0)
    try:
        r = httpx.post(f"{s.url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": "hi", "tools": [mcp_tool(f"http://127.0.0.1:{port}/mcp")]})
        assert r.status_code == 424 and r.json()["error"]["param"] == "tools[0]", r.text
        assert "could not list its tools" in r.json()["error"]["message"]
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_without_tool_support_is_a_400_before_any_listing(long_tiny, stream):
    """The tiny model's own template renders no tools: MCP tools are a 400 naming "tools", streamed
    or not, on the Responses API and the Anthropic connector, before the server is contacted (the
    URL has nothing listening: a listing would be a 424)."""
    port = free_ports(1)
    s = LiveServer(LLM(str(long_tiny), dtype="float32"), "tiny", allow_mcp_url=["http://127.0.0.1:*"], mcp_timeout=2.0)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        r = httpx.post(f"{s.url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": "hi", "stream": stream, "tools": [mcp_tool(url)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        r = httpx.post(f"{s.url}/v1/messages", timeout=60, headers={"anthropic-beta": "mcp-client-2025-04-04"}, json={
            "model": "tiny", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "hi"}],
            "mcp_servers": [{"type": "url", "url": url, "name": "weather"}]})
        assert r.status_code == 400 and "tool-call support" in r.json()["error"]["message"], r.text
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_qwen_calls_an_mcp_tool_and_answers_with_its_output(mcp_url, stream):
    """Qwen2.5-Coder-0.5B, tool_choice auto: it calls get_weather on its own, the server runs it,
    and the answer carries the tool's output (21 C)."""
    from nextoken.catalog import pull

    port = mcp_url.split(":")[2].split("/")[0]
    s = LiveServer(LLM(str(pull("qwen2.5-coder-0.5b-instruct", progress=False))), "qwen",
                   allow_mcp_url=[f"http://127.0.0.1:{port}/*"])
    try:
        kw = dict(model="qwen", input="What is the weather in Paris right now? Use the tool.", temperature=0,
                  tools=[mcp_tool(mcp_url)], max_output_tokens=80)
        if stream:
            events = list(s.client().responses.create(**kw, stream=True))
            r = [e for e in events if e.type == "response.completed"][0].response
            texts = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert texts and "".join(texts) == r.output_text  # (held whole where it opens like an untagged call)
        else:
            r = s.client().responses.create(**kw)
        kinds = [o.type for o in r.output]
        assert kinds[:2] == ["mcp_list_tools", "mcp_call"] and kinds[-1] == "message", kinds
        check_call(r.output[1])
        assert "21" in r.output_text, r.output_text
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_mcp_connector_runs_the_same_calls(srv, mcp_url, stream):
    """Anthropic's ``mcp_servers`` (its SDK's beta Messages API, as users send them): the call and
    its result as mcp_tool_use and mcp_tool_result blocks before the answer, streamed and not. The
    server's name is Anthropic's (any string; not OpenAI's server_label pattern, once a 500)."""
    import anthropic

    c = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    kw = dict(model="tiny", max_tokens=120, messages=[{"role": "user", "content": "Weather in Paris?"}],
              betas=["mcp-client-2025-04-04"], tool_choice={"type": "any"}, extra_body={"temperature": 0},
              mcp_servers=[{"type": "url", "url": mcp_url, "name": "Météo · Paris",
                            "tool_configuration": {"allowed_tools": ["get_weather"]}}])
    if stream:
        with c.beta.messages.stream(**kw) as s:
            msg = s.get_final_message().model_dump()
    else:
        msg = c.beta.messages.create(**kw).model_dump()
    use, result = msg["content"][:2]
    assert use["type"] == "mcp_tool_use" and use["name"] == "get_weather" and use["server_name"] == "Météo · Paris"
    assert result["type"] == "mcp_tool_result" and result["tool_use_id"] == use["id"] and not result["is_error"]
    assert result["content"][0]["text"] == expected_output("get_weather", use["input"])
    r = httpx.post(f"{srv.url}/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "mcp_servers": [{"type": "url", "url": "http://example.com/mcp", "name": "x"}]})
    assert r.status_code == 400 and "mcp_servers[0].url" in r.json()["error"]["message"]
