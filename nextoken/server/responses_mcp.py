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
fails is a 424 naming the tool. Streamed, the same items are sent as events once each is done.
"""

from __future__ import annotations

import uuid

from nextoken.errors import InvalidRequest
from nextoken.server.chat_core import prepare
from nextoken.server.mcp_tools import MCPTool, check_allowed, item_id, listings, run_call, server_limits

DEFAULT_MAX_CALLS = 8  # MCP calls one response may run when the request sets no max_tool_calls


async def respond(serving, body, request, lora, conversation: list[dict], previous: dict | None, meta: dict,
                  to_spec) -> tuple[dict, list[dict]]:
    """The whole response to `body` (whose tools include MCP servers) and the conversation to
    store; `previous`: the stored response `previous_response_id` names, or None; `to_spec(body,
    conversation, offered tools, first)` makes each pass's `ChatSpec`. Raises
    `InvalidRequest` (a URL not allowed, an approval for no request), `DependencyFailed` (a
    server that cannot list its tools)."""
    limits = server_limits(serving.args)
    servers = [(i, t) for i, t in enumerate(body.tools) if isinstance(t, MCPTool)]
    labels: dict[str, MCPTool] = {}
    for i, t in servers:
        check_allowed(t, f"tools[{i}].server_url", limits)
        if labels.setdefault(t.server_label, t) is not t:
            raise InvalidRequest(f"two MCP tools have server_label {t.server_label!r}", f"tools[{i}].server_label")
    items, owners, offered = await listings(servers, limits)
    conversation = list(conversation)
    for approval in _approvals(body):
        asked = _approval_request(approval.approval_request_id, body, previous)
        tool = labels.get(asked["server_label"])
        if tool is None:
            raise InvalidRequest(f"the approved call's MCP server {asked['server_label']!r} is not among the tools",
                                 "tools")
        items.append(await run_call(tool, asked["name"], asked["arguments"], conversation, limits, approval))
    budget = body.max_tool_calls if isinstance(body.max_tool_calls, int) else DEFAULT_MAX_CALLS
    used, tokens, first = 0, [0, 0], True
    while True:
        p = await prepare(serving, to_spec(body, conversation, offered, first))
        first = False
        rid = await serving.engine.add_request(p.ids, p.params, f"resp_{uuid.uuid4().hex}", lora_request=lora)
        out = (await serving.collect([rid], request))[0]
        serving.record([out])
        tokens[0] += len(out.prompt_token_ids)
        tokens[1] += len(out.outputs[0].token_ids)
        response = serving._response(body, out, p.names, meta)
        calls = [it for it in response["output"] if it["type"] == "function_call" and it["name"] in owners]
        rest = [it for it in response["output"] if it not in calls and not (it["type"] == "message" and calls
                                                                               and not _text(it))]
        if not calls or used >= budget:
            return _finish(response, items + rest, tokens), conversation
        asks = [c for c in calls if owners[c["name"]].needs_approval(c["name"])]
        if asks:  # the response ends with the requests; the client approves or not
            items += [{"type": "mcp_approval_request", "id": item_id("mcpr"), "server_label":
                       owners[c["name"]].server_label, "name": c["name"], "arguments": c["arguments"]} for c in asks]
            return _finish(response, items + [it for it in rest if it["type"] != "message"], tokens), conversation
        for c in calls[: budget - used]:
            items.append(await run_call(owners[c["name"]], c["name"], c["arguments"], conversation, limits))
            used += 1


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


def _text(item: dict) -> str:
    return "".join(p["text"] for p in item.get("content", []))


def _finish(response: dict, output: list[dict], tokens: list[int]) -> dict:
    response["output"] = output
    response["output_text"] = "".join(_text(it) for it in output if it["type"] == "message")
    response["usage"].update(input_tokens=tokens[0], output_tokens=tokens[1], total_tokens=sum(tokens))
    return response


def replay(response: dict, event) -> list[str]:
    """A finished response as the Responses event sequence (`event(kind, data)` formats one):
    created, in_progress, each output item added and done (with the MCP items' own events and
    a message's text as one delta), then completed or incomplete."""
    start = {**response, "status": "in_progress", "output": [], "output_text": ""}
    out = [event("response.created", {"response": start}), event("response.in_progress", {"response": start})]
    for i, item in enumerate(response["output"]):
        out.append(event("response.output_item.added", {"output_index": i, "item": {**item, "status": "in_progress"}}))
        kind = item["type"]
        if kind in ("mcp_list_tools", "mcp_call"):
            out.append(event(f"response.{kind}.in_progress", {"item_id": item["id"], "output_index": i}))
            if kind == "mcp_call":
                out.append(event("response.mcp_call_arguments.done", {"item_id": item["id"], "output_index": i,
                                                                      "arguments": item["arguments"]}))
            done = "failed" if item.get("error") else "completed"
            out.append(event(f"response.{kind}.{done}", {"item_id": item["id"], "output_index": i}))
        elif kind == "message":
            part = item["content"][0]
            base = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out += [event("response.content_part.added", {**base, "part": {**part, "text": ""}}),
                    event("response.output_text.delta", {**base, "delta": part["text"]}),
                    event("response.output_text.done", {**base, "text": part["text"]}),
                    event("response.content_part.done", {**base, "part": part})]
        elif kind == "function_call":
            out.append(event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": i,
                                                                       "arguments": item["arguments"]}))
        out.append(event("response.output_item.done", {"output_index": i, "item": item}))
    final = "response.completed" if response["status"] == "completed" else "response.incomplete"
    out.append(event(final, {"response": response}))
    return out
