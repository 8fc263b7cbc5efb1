"""Anthropic's MCP connector (``mcp_servers`` on ``/v1/messages``) on the same MCP code as the
Responses API's mcp tools (`mcp_tools`): each server's tools are listed and offered, the
model's calls of them run on the server, and each appears in the message as an
``mcp_tool_use`` block and its ``mcp_tool_result`` block before the answer's blocks. Anthropic's
connector runs calls without approval; at most `MAX_CALLS` per message.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from nextoken.bodies import Body, NonEmptyStr
from nextoken.server.chat_core import prepare
from nextoken.server.mcp_tools import MCPTool, check_allowed, listings, run_call, server_limits

MAX_CALLS = 8


class ToolConfiguration(Body):
    enabled: bool = True
    allowed_tools: list[str] | None = None


class MCPServer(Body):
    """One entry of ``mcp_servers`` (Anthropic's URL-based MCP server definition)."""
    type: Literal["url"]
    url: NonEmptyStr
    name: NonEmptyStr
    authorization_token: str | None = None
    tool_configuration: ToolConfiguration | None = None

    def as_tool(self) -> MCPTool:
        cfg = self.tool_configuration or ToolConfiguration()
        return MCPTool(type="mcp", server_label=self.name, server_url=self.url, require_approval="never",
                       allowed_tools=cfg.allowed_tools if cfg.enabled else [],
                       headers={"Authorization": f"Bearer {self.authorization_token}"}
                       if self.authorization_token else None)


async def respond(serving, body, request, lora, to_spec) -> dict:
    """The message answering `body`, whose ``mcp_servers`` the server calls; `to_spec(body,
    conversation, offered, first)` makes each pass's `ChatSpec`."""
    limits = server_limits(serving.args, "mcp_servers")
    servers = [(i, s.as_tool()) for i, s in enumerate(body.mcp_servers)]
    for i, t in servers:
        check_allowed(t, f"mcp_servers[{i}].url", limits)
    _, owners, offered = await listings(servers, limits, "mcp_servers")
    blocks, conversation, tokens, first, used = [], None, [0, 0], True, 0
    while True:
        spec = to_spec(body, conversation, offered, first)
        conversation, first = spec.messages, False
        p = await prepare(serving, spec)
        rid = await serving.engine.add_request(p.ids, p.params, f"msg_{uuid.uuid4().hex[:24]}", lora_request=lora)
        out = (await serving.collect([rid], request))[0]
        serving.record([out])
        tokens[0] += len(out.prompt_token_ids)
        tokens[1] += len(out.outputs[0].token_ids)
        message = serving._message(out, p.names)
        calls = [b for b in message["content"] if b["type"] == "tool_use" and b["name"] in owners]
        if not calls or used >= MAX_CALLS:
            message["content"] = blocks + [b for b in message["content"] if b not in calls]
            message["usage"] = {"input_tokens": tokens[0], "output_tokens": tokens[1]}
            if calls and message["stop_reason"] == "tool_use" and not any(b["type"] == "tool_use"
                                                                            for b in message["content"]):
                message["stop_reason"] = "end_turn"
            return message
        for b in calls[: MAX_CALLS - used]:
            tool = owners[b["name"]]
            item = await run_call(tool, b["name"], json.dumps(b["input"]), conversation, limits)
            blocks += [{"type": "mcp_tool_use", "id": item["id"], "name": b["name"], "server_name": tool.server_label,
                        "input": b["input"]},
                       {"type": "mcp_tool_result", "tool_use_id": item["id"], "is_error": item["error"] is not None,
                        "content": [{"type": "text", "text": item["output"] if item["error"] is None
                                     else item["error"]}]}]
            used += 1


def replay(message: dict, event) -> list[str]:
    """A finished message as Anthropic's event stream (`event(kind, data)` formats one): each
    content block started, its content as one delta where it has one, stopped."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 0}}
    out = [event("message_start", {"message": start})]
    for i, b in enumerate(message["content"]):
        if b["type"] == "text":
            out += [event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}),
                    event("content_block_delta", {"index": i, "delta": {"type": "text_delta", "text": b["text"]}})]
        elif b["type"] == "tool_use":
            out += [event("content_block_start", {"index": i, "content_block": {**b, "input": {}}}),
                    event("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                        "partial_json": json.dumps(b["input"])}})]
        else:
            out.append(event("content_block_start", {"index": i, "content_block": b}))
        out.append(event("content_block_stop", {"index": i}))
    out += [event("message_delta", {"delta": {"stop_reason": message["stop_reason"],
                                              "stop_sequence": message["stop_sequence"]},
                                    "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
            event("message_stop", {})]
    return out
