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
fails is a 424 naming the tool. Each pass streams from the chat core's events as it is
generated, streamed or not (`MCPLoop.events`): text token by token, an MCP call's arguments as
``response.mcp_call_arguments.delta``, then its result once it ran.
"""

from __future__ import annotations

from nextoken.errors import InvalidRequest
from nextoken.server.chat_core import prepare
from nextoken.server.chat_run import Failed, Finish, Tokens, ToolCallArgs, ToolCallStart, Usage, run
from nextoken.server.mcp_tools import MCPTool, PassLoop, check_allowed, item_id, listings, run_call, server_limits

DEFAULT_MAX_CALLS = 8  # MCP calls one response may run when the request sets no max_tool_calls


class MCPLoop(PassLoop):
    """One response to a request whose tools include MCP servers. `start` checks the servers
    and lists their tools (raising before any answer goes out); `events(emit)` runs the passes,
    yielding what `emit(kind, data)` formats (None: nothing, not streamed); then `response` and
    `conversation` (to store) are set. `render`: the Responses API's item renderer
    (``item_events(event, state, emit)`` and ``close(state, emit)``)."""

    def __init__(self, serving, body, request, lora, meta: dict, to_spec, render):
        self.serving, self.body, self.request, self.lora, self.meta = serving, body, request, lora, meta
        self.to_spec, self.render = to_spec, render
        self.id = item_id("resp")
        self.response: dict | None = None
        self.conversation: list[dict] = []

    async def start(self, conversation: list[dict], previous: dict | None) -> "MCPLoop":
        """Raises `InvalidRequest` (a URL not allowed, an approval for no request) or
        `DependencyFailed` (a server that cannot list its tools)."""
        body = self.body
        self.check_template(self.serving)
        self.limits = limits = server_limits(self.serving.args)
        servers = [(i, t) for i, t in enumerate(body.tools) if isinstance(t, MCPTool)]
        labels: dict[str, MCPTool] = {}
        for i, t in servers:
            check_allowed(t, f"tools[{i}].server_url", limits)
            if labels.setdefault(t.server_label, t) is not t:
                raise InvalidRequest(f"two MCP tools have server_label {t.server_label!r}", f"tools[{i}].server_label")
        self.items, self.owners, self.offered = await listings(servers, limits)
        self.conversation = list(conversation)
        self.approved = []
        for approval in _approvals(body):
            asked = _approval_request(approval.approval_request_id, body, previous)
            tool = labels.get(asked["server_label"])
            if tool is None:
                raise InvalidRequest(f"the approved call's MCP server {asked['server_label']!r} is not among the "
                                     "tools", "tools")
            self.approved.append((tool, asked, approval))
        return self

    async def _events(self, emit):
        start = self.serving.envelope(self.body, self.id, [], None, None, self.meta, status="in_progress")
        yield emit("response.created", {"response": start})
        yield emit("response.in_progress", {"response": start})
        # the output items, the open one; this pass's MCP items by call id and its calls' ids
        state = {"items": [], "open": None, "mcp": {}, "pass_ids": set()}
        for item in self.items:
            for t in _whole_item(item, state, emit):
                yield t
        for tool, asked, approval in self.approved:
            item = await run_call(tool, asked["name"], asked["arguments"], self.conversation, self.limits, approval)
            for t in _whole_item(item, state, emit):
                yield t
        budget = self.body.max_tool_calls if isinstance(self.body.max_tool_calls, int) else DEFAULT_MAX_CALLS
        used, usage, first, finish = 0, Usage(0, 0), True, None
        while True:
            try:
                p = await prepare(self.serving, self.to_spec(self.body, self.conversation, self.offered, first))
            except InvalidRequest as exc:  # (the conversation outgrew the context, ...): after the 200
                self.error = exc
                yield emit("error", {"message": str(exc), "code": "invalid_request_error", "param": exc.field})
                return
            first, choice, before = False, None, len(state["items"])
            async for ev in await run(self.serving, p, self.request, self.lora, stream=True, prefix="resp_"):
                if isinstance(ev, Failed):
                    self.error = RuntimeError(ev.message)
                    yield emit("error", {"message": ev.message, "code": "server_error"})
                    return
                for t in self._pass_events(ev, state, emit):
                    yield t
                if isinstance(ev, Finish):
                    choice, finish = ev.choice, ev.reason
                    usage = Usage(usage.prompt_tokens + ev.usage.prompt_tokens,
                                  usage.completion_tokens + ev.usage.completion_tokens)
            calls = _settle(state, choice)
            runs = [it for it in calls if it["type"] == "mcp_call"]
            asks = any(it["type"] == "mcp_approval_request" for it in calls)
            stop = asks or not runs or used >= budget
            for item in runs:
                if asks or used >= budget:
                    why = "the response ends at a call awaiting approval" if asks else \
                        f"max_tool_calls ({budget}) reached"
                    item.update(status="failed", error=f"not run: {why}")
                else:
                    ran = await run_call(self.owners[item["name"]], item["name"], item["arguments"],
                                         self.conversation, self.limits, call_id=item["id"])
                    item.update(output=ran["output"], error=ran["error"], status=ran["status"])
                    used += 1
                at = state["items"].index(item)
                yield emit(f"response.mcp_call.{'failed' if item['error'] else 'completed'}",
                           {"item_id": item["id"], "output_index": at})
                yield emit("response.output_item.done", {"output_index": at, "item": item})
            if stop:
                if len(state["items"]) == before:  # an empty answer is an empty message
                    state["items"].append(self.render.message_item(""))
                break
        self.response = self.serving.envelope(self.body, self.id, state["items"], finish, usage, self.meta)
        final = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        yield emit(final, {"response": self.response})

    def _pass_events(self, ev, state: dict, emit):
        """A core event of one pass: an MCP server's call as an ``mcp_call`` (or, needing
        approval, an ``mcp_approval_request``) item, anything else as the Responses API's."""
        items, open_mcp = state["items"], state.get("open_mcp")
        if isinstance(ev, ToolCallArgs) and open_mcp is not None:
            item = items[open_mcp]
            item["arguments"] += ev.text
            if item["type"] == "mcp_call":
                yield emit("response.mcp_call_arguments.delta", {"item_id": item["id"], "output_index": open_mcp,
                                                                 "delta": ev.text})
            return
        if open_mcp is not None and not isinstance(ev, Tokens):  # anything else ends the call's text
            yield from _close_mcp(state, emit)
        if isinstance(ev, ToolCallStart):
            state["pass_ids"].add(ev.id)
        if not (isinstance(ev, ToolCallStart) and ev.name in self.owners):
            yield from self.render.item_events(ev, state, emit)
            return
        yield from self.render.close(state, emit)
        tool = self.owners[ev.name]
        kind = "mcp_approval_request" if tool.needs_approval(ev.name) else "mcp_call"
        item = {"type": kind, "id": item_id("mcp" if kind == "mcp_call" else "mcpr"),
                "server_label": tool.server_label, "name": ev.name, "arguments": ""}
        if kind == "mcp_call":
            item.update(output=None, error=None, status="in_progress")
        items.append(item)
        state["open_mcp"], state["mcp"][ev.id] = len(items) - 1, item
        yield emit("response.output_item.added", {"output_index": state["open_mcp"], "item": item})
        if kind == "mcp_call":
            yield emit("response.mcp_call.in_progress", {"item_id": item["id"], "output_index": state["open_mcp"]})


def _close_mcp(state: dict, emit):
    """Close the open MCP item: an approval request is done; a call's arguments are done (the
    call itself is done once it ran)."""
    at = state.pop("open_mcp")
    item = state["items"][at]
    if item["type"] == "mcp_call":
        yield emit("response.mcp_call_arguments.done", {"item_id": item["id"], "output_index": at,
                                                        "arguments": item["arguments"]})
    else:
        yield emit("response.output_item.done", {"output_index": at, "item": item})


def _settle(state: dict, choice) -> list[dict]:
    """After a pass: the MCP items of its complete calls, in order; the items of calls the
    token limit cut (MCP or function calls) leave the output."""
    kept = {c.id for c in choice.calls} if choice is not None else set()
    by_call, state["mcp"] = state["mcp"], {}
    cut_ids, state["pass_ids"] = state["pass_ids"] - kept, set()
    cut = {id(item) for cid, item in by_call.items() if cid in cut_ids}
    state["items"][:] = [it for it in state["items"] if id(it) not in cut
                         and not (it["type"] == "function_call" and it["call_id"] in cut_ids)]
    return [item for cid, item in by_call.items() if cid in kept]


def _whole_item(item: dict, state: dict, emit):
    """A finished item (a listing, an approved call) as its added .. done events."""
    state["items"].append(item)
    at = len(state["items"]) - 1
    yield emit("response.output_item.added", {"output_index": at, "item": {**item, "status": "in_progress"}})
    kind = item["type"]
    yield emit(f"response.{kind}.in_progress", {"item_id": item["id"], "output_index": at})
    if kind == "mcp_call":
        yield emit("response.mcp_call_arguments.done", {"item_id": item["id"], "output_index": at,
                                                        "arguments": item["arguments"]})
    yield emit(f"response.{kind}.{'failed' if item.get('error') else 'completed'}",
               {"item_id": item["id"], "output_index": at})
    yield emit("response.output_item.done", {"output_index": at, "item": item})


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
