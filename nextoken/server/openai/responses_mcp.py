"""``/v1/responses`` with MCP tools: the server lists each MCP server's tools, lets the model
call them, runs the calls (`mcp_tools`), feeds each result back, and generates again until the
model answers without calling one (or the request's ``max_tool_calls``, default
`DEFAULT_MAX_CALLS`, is spent). The output items come in order:

    mcp_list_tools (one per server) -> [mcp_call ...] -> the answer (message, function_call)
    or, where a tool needs approval: ... -> mcp_approval_request (the response ends there; the
    client answers with an ``mcp_approval_response`` input item and ``previous_response_id``,
    or by passing the request item back in its input)

A call that fails (the server is down, hangs, refuses or returns too much) is an ``mcp_call``
item with its ``error``, and the model sees that error as the tool's result; a listing that
fails is a 424 naming the tool. The passes are the tool loop's (`tool_loop`, shared with
Anthropic's connector); each streams from the chat core's events as it is generated, streamed
or not (`MCPResponse.events`): text token by token, an MCP call's arguments as
``response.mcp_call_arguments.delta``, then its result once it ran.
"""

from __future__ import annotations

from nextoken.errors import InvalidRequest
from nextoken.server.chat.mcp_tools import MCPTool, item_id
from nextoken.server.openai.responses_render import ResponseRenderer, message_item
from nextoken.server.chat.tool_loop import ServerCall, ToolLoop, open_servers

DEFAULT_MAX_CALLS = 8  # MCP calls one response may run when the request sets no max_tool_calls


class MCPResponse:
    """One response to a request whose tools include MCP servers. `start` checks the servers,
    lists their tools, runs the approved calls and prepares the first pass (raising before any
    answer goes out); `events()` runs the passes (`tool_loop.ToolLoop`) into `render` (a
    `ResponseRenderer`), yielding its events; then `response` and `conversation` (to store) are
    set. `envelope(output, finish, usage, status=)`: the response object around its items."""

    def __init__(self, serving, body, request, lora, envelope, to_spec, render: ResponseRenderer):
        self.serving, self.body, self.request, self.lora = serving, body, request, lora
        self.envelope, self.to_spec, self.render = envelope, to_spec, render
        self.response: dict | None = None

    async def start(self, conversation: list[dict], previous: dict | None) -> "MCPResponse":
        """Raises `InvalidRequest` (a template without tools, a URL not allowed, two servers with one
        label, an approval for no request, a first pass that cannot be prepared) or
        `DependencyFailed` (a server that cannot list its tools)."""
        body = self.body
        tools = [(i, t) for i, t in enumerate(body.tools) if isinstance(t, MCPTool)]
        labels: dict[str, MCPTool] = {}
        for i, t in tools:
            if labels.setdefault(t.server_label, t) is not t:
                raise InvalidRequest(f"two MCP tools have server_label {t.server_label!r}", f"tools[{i}].server_label")
        servers = await open_servers(self.serving, tools, "tools", "server_url")
        self.listings = servers.items
        approved = []
        for approval in _approvals(body):
            asked = _approval_request(approval.approval_request_id, body, previous)
            tool = labels.get(asked["server_label"])
            if tool is None:
                raise InvalidRequest(f"the approved call's MCP server {asked['server_label']!r} is not among the "
                                     "tools", "tools")
            call = ServerCall(item_id("mcp"), asked["name"], tool,
                              asked["arguments"], approval_request_id=approval.approval_request_id)
            if not approval.approve:
                call.error = "the user declined this call" + (f": {approval.reason}" if approval.reason else "")
            approved.append(call)
        budget = body.max_tool_calls if isinstance(body.max_tool_calls, int) else DEFAULT_MAX_CALLS
        spec = lambda conv, first: self.to_spec(body, conv, servers.offered, first)  # noqa: E731
        self.loop = await ToolLoop(self.serving, self.request, self.lora, servers, conversation, spec, budget,
                                   "resp_").start(approved)
        return self

    @property
    def conversation(self) -> list[dict]:
        return self.loop.conversation

    @property
    def error(self) -> Exception | None:
        return self.loop.error

    async def events(self):
        """The response's events as the passes run (None for each when not streamed)."""
        r = self.render
        start = self.envelope([], None, None, status="in_progress")
        yield r.emit("response.created", {"response": start})
        yield r.emit("response.in_progress", {"response": start})
        for item in self.listings:
            for t in r.whole(item):
                yield t
        async for ev in self.loop.events():
            for t in r.tool(ev):
                yield t
        if self.loop.error is not None:
            return
        if len(r.items) == r.pass_start:  # the last pass answered nothing: an empty message
            r.items.append(message_item(""))
        self.response = self.envelope(r.items, self.loop.finish, self.loop.usage)
        final = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        yield r.emit(final, {"response": self.response})

    async def run(self) -> dict:
        """Run the passes unstreamed: the response; raises what ended them early."""
        async for _ in self.events():
            pass
        if self.loop.error is not None:
            raise self.loop.error
        return self.response


def _approvals(body) -> list:
    return [] if isinstance(body.input, str) else [it for it in body.input if it.type == "mcp_approval_response"]


def _approval_request(rid: str, body, previous: dict | None) -> dict:
    """The ``mcp_approval_request`` item `rid` answers: in this request's input, or in the
    output of the response it continues."""
    candidates = [] if isinstance(body.input, str) else [it.model_dump() for it in body.input
                                                         if it.type == "mcp_approval_request"]
    candidates += [it for it in (previous or {}).get("output", []) if it["type"] == "mcp_approval_request"]
    for it in candidates:
        if it.get("id") == rid and all(k in it for k in ("server_label", "name", "arguments")):
            return it
    raise InvalidRequest(f"approval_request_id {rid!r} names no mcp_approval_request of this conversation", "input")
