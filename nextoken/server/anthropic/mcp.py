"""Anthropic's MCP connector (``mcp_servers`` on ``/v1/messages``) on the same MCP code as the
Responses API's mcp tools (`mcp_tools`): each server's tools are listed and offered, the
model's calls of them run on the server, and each appears in the message as an
``mcp_tool_use`` block and its ``mcp_tool_result`` block before the answer's blocks. Anthropic's
connector runs calls without approval; at most `MAX_CALLS` per message.
"""

from __future__ import annotations

import uuid

from nextoken.server.chat_core import prepare
from nextoken.errors import InvalidRequest
from nextoken.server.chat_run import Failed, Finish, Tokens, ToolCallArgs, ToolCallStart, run
from nextoken.server.mcp_tools import MCPTool, PassLoop, check_allowed, listings, run_call, server_limits

MAX_CALLS = 8


def as_tool(server) -> MCPTool:
    """One ``mcp_servers`` entry (`protocol.MCPServer`) as the Responses API's MCP tool."""
    cfg = server.tool_configuration
    enabled, allowed = (cfg.enabled, cfg.allowed_tools) if cfg is not None else (True, None)
    return MCPTool(type="mcp", server_label=server.name, server_url=server.url, require_approval="never",
                   allowed_tools=allowed if enabled else [],
                   headers={"Authorization": f"Bearer {server.authorization_token}"}
                   if server.authorization_token else None)


class ConnectorLoop(PassLoop):
    """One message answering a request with ``mcp_servers``. `start` checks and lists the
    servers and prepares the first pass (raising before any answer goes out); `events(emit)`
    runs the passes, the text and thinking streamed as generated (`emit(kind, data)` formats an
    SSE event, or returns None: not streamed); then `message` is set. `render`: the Messages
    API's renderer (``block_events``, ``blocks``, ``stop_reason``, ``open_block``)."""

    def __init__(self, serving, body, request, lora, to_spec, render):
        self.serving, self.body, self.request, self.lora = serving, body, request, lora
        self.to_spec, self.render = to_spec, render
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.message: dict | None = None

    async def start(self) -> "ConnectorLoop":
        self.check_template(self.serving)
        self.limits = limits = server_limits(self.serving.args, "mcp_servers")
        servers = [(i, as_tool(s)) for i, s in enumerate(self.body.mcp_servers)]
        for i, t in servers:
            check_allowed(t, f"mcp_servers[{i}].url", limits)
        _, self.owners, self.offered = await listings(servers, limits, "mcp_servers")
        spec = self.to_spec(self.body, None, self.offered, True)
        self.conversation = spec.messages
        self.first = await prepare(self.serving, spec)
        return self

    async def _events(self, emit):
        r, p = self.render, self.first
        yield emit("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.serving.args.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(p.ids), "output_tokens": 0}}})
        block, content, tokens, used = {"index": -1, "kind": None}, [], [0, 0], 0
        while True:
            choice, owned_open = None, False
            async for ev in await run(self.serving, p, self.request, self.lora, stream=True, prefix="msg_"):
                if isinstance(ev, Failed):
                    self.error = RuntimeError(ev.message)
                    yield emit("error", {"error": {"type": "api_error", "message": ev.message}})
                    return
                if isinstance(ev, ToolCallStart):
                    owned_open = ev.name in self.owners  # a connector call: its blocks come once it ran
                if isinstance(ev, Finish):
                    choice = ev.choice
                    tokens = [tokens[0] + ev.usage.prompt_tokens, tokens[1] + ev.usage.completion_tokens]
                    for t in r.open_block(block, None, None):
                        yield emit(*t)
                elif not (owned_open and isinstance(ev, (ToolCallStart, ToolCallArgs, Tokens))):
                    for t in r.block_events(ev, block):
                        yield emit(*t)
            owned = [c for c in choice.calls if c.name in self.owners]
            content += r.blocks(choice, skip=set(self.owners))
            if not owned or used >= MAX_CALLS:
                break
            for call in owned[: MAX_CALLS - used]:
                tool = self.owners[call.name]
                item = await run_call(tool, call.name, call.arguments, self.conversation, self.limits)
                ran = [{"type": "mcp_tool_use", "id": item["id"], "name": call.name, "server_name": tool.server_label,
                        "input": r.tool_input(call.arguments)},
                       {"type": "mcp_tool_result", "tool_use_id": item["id"], "is_error": item["error"] is not None,
                        "content": [{"type": "text", "text": item["output"] if item["error"] is None
                                     else item["error"]}]}]
                content += ran
                used += 1
                for b in ran:
                    for t in r.open_block(block, "mcp", b) + r.open_block(block, None, None):
                        yield emit(*t)
            try:
                p = await prepare(self.serving, self.to_spec(self.body, self.conversation, self.offered, False))
            except InvalidRequest as exc:  # (the conversation outgrew the context, ...): after the 200
                self.error = exc
                yield emit("error", {"error": {"type": "invalid_request_error", "message": str(exc)}})
                return
        stop, seq = r.stop_reason(choice)
        if stop == "tool_use" and not any(b["type"] == "tool_use" for b in content):
            stop = "end_turn"  # the calls were the connector's, and they ran
        self.message = {"id": self.id, "type": "message", "role": "assistant", "model": self.serving.args.model_name,
                        "content": content, "stop_reason": stop, "stop_sequence": seq,
                        "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]}}
        yield emit("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": seq},
                                     "usage": {"output_tokens": tokens[1]}})
        yield emit("message_stop", {})
