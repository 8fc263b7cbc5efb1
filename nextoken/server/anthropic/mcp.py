"""Anthropic's MCP connector (``mcp_servers`` on ``/v1/messages``) on the same tool loop as the
Responses API's mcp tools (`tool_loop`, `mcp_tools`): each server's tools are listed and offered, the
model's calls of them run on the server, and each appears in the message as an
``mcp_tool_use`` block and its ``mcp_tool_result`` block before the answer's blocks. Anthropic's
connector runs calls without approval; at most `MAX_CALLS` per message (a call past them is an
``mcp_tool_result`` with ``is_error`` that says it was not run).
"""

from __future__ import annotations

import uuid

from nextoken.server.anthropic.render import MessageRenderer, message, stop_reason
from nextoken.server.chat.events import Finish
from nextoken.server.chat.mcp_tools import MCPTool
from nextoken.server.chat.tool_loop import ToolLoop, open_servers

MAX_CALLS = 8


def as_tool(server) -> MCPTool:
    """One ``mcp_servers`` entry (`protocol.MCPServer`, validated as Anthropic's) as the Responses
    API's MCP tool. Built without the Responses API's own checks: Anthropic's server ``name`` is
    any non-empty string, where OpenAI's ``server_label`` takes ``[A-Za-z0-9_-]{1,64}`` (a name
    outside it was a 500, found by the schema fuzzer), and it is shown back as the blocks'
    ``server_name``."""
    cfg = server.tool_configuration
    enabled, allowed = (cfg.enabled, cfg.allowed_tools) if cfg is not None else (True, None)
    return MCPTool.model_construct(type="mcp", server_label=server.name, server_url=server.url,
                                   require_approval="never", allowed_tools=allowed if enabled else [],
                                   headers={"Authorization": f"Bearer {server.authorization_token}"}
                                   if server.authorization_token else None)


class ConnectorMessage:
    """One message answering a request with ``mcp_servers``. `start` checks and lists the
    servers and prepares the first pass (raising before any answer goes out); `events()` runs
    the passes (`tool_loop.ToolLoop`), yielding Anthropic's (kind, data) events as generated;
    then `message` is set. `to_spec(body, conversation, offered, first)`: the pass's ChatSpec;
    `conversation`: the request's messages as chat messages."""

    def __init__(self, serving, body, request, lora, to_spec, conversation: list[dict]):
        self.serving, self.body, self.request, self.lora = serving, body, request, lora
        self.to_spec, self.conversation = to_spec, conversation
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.message: dict | None = None

    async def start(self) -> "ConnectorMessage":
        servers = await open_servers(self.serving, [(i, as_tool(s)) for i, s in enumerate(self.body.mcp_servers)],
                                     "mcp_servers", "url")
        spec = lambda conv, first: self.to_spec(self.body, conv, servers.offered, first)  # noqa: E731
        self.render = MessageRenderer(skip=set(servers.owners))
        self.loop = await ToolLoop(self.serving, self.request, self.lora, servers, self.conversation, spec,
                                   MAX_CALLS, "msg_").start()
        return self

    @property
    def error(self) -> Exception | None:
        return self.loop.error

    async def events(self):
        r, loop = self.render, self.loop
        model = self.serving.args.model_name
        yield "message_start", {"message": message(self.id, model, [], (None, None), (len(loop.first.ids), 0))}
        choice = None
        async for ev in loop.events():
            if isinstance(ev, Finish):
                choice = ev.choice  # (the last pass's decides the stop reason)
            for t in r.tool(ev):
                yield t
        if loop.error is not None:
            return
        stop, seq = stop_reason(choice)
        if stop == "tool_use" and not any(b["type"] == "tool_use" for b in r.content):
            stop = "end_turn"  # the calls were the connector's, and they ran
        usage = loop.usage
        self.message = message(self.id, model, r.content, (stop, seq), (usage.prompt_tokens, usage.completion_tokens))
        yield "message_delta", {"delta": {"stop_reason": stop, "stop_sequence": seq},
                                "usage": {"output_tokens": usage.completion_tokens}}
        yield "message_stop", {}

    async def run(self) -> dict:
        """Run the passes unstreamed: the message; raises what ended them early."""
        async for _ in self.events():
            pass
        if self.loop.error is not None:
            raise self.loop.error
        return self.message
