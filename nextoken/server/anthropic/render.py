"""The Messages API's answers: content blocks (thinking, text, tool_use; with the MCP connector
mcp_tool_use and mcp_tool_result) of a finished choice, and, streamed, Anthropic's event
sequence. One `MessageRenderer` per message holds the stream's state: the open block's index and
kind, the content so far.

    message_start -> (content_block_start -> content_block_delta* -> content_block_stop)*
      -> message_delta -> message_stop
"""

from __future__ import annotations

import uuid
from typing import Iterator

from nextoken.server.chat.tools import arguments_object
from nextoken.server.chat.events import Finish, Text, Thought, ToolCallArgs, ToolCallStart
from nextoken.server.chat.tool_loop import CallRan, LoopFailed
from nextoken.server.api.stream_json import stream_json

Event = tuple[str, dict]  # (kind, data) of one event


def tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(choice) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished `chat.run.Choice`."""
    if choice.finish == "length":
        return "max_tokens", None
    if choice.finish == "tool_calls":
        return "tool_use", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def blocks(c, skip: frozenset[str] | set[str] = frozenset()) -> list[dict]:
    """The content blocks of a `chat.run.Choice`: thinking, text, tool_use (but calls of the
    functions in `skip`)."""
    content = [{"type": "thinking", "thinking": c.thought, "signature": ""}] if c.thought else []
    if c.text:
        content.append({"type": "text", "text": c.text})
    return content + [{"type": "tool_use", "id": tool_id(), "name": call.name, "input": arguments_object(call.arguments)}
                      for call in c.calls if call.name not in skip]


def message(rid: str, model: str, content: list[dict], stop: tuple[str | None, str | None],
            usage: tuple[int, int]) -> dict:
    """The message object (`protocol.MessageAnswer`): unstreamed, the connector's, and (empty,
    unfinished) the stream's ``message_start``; `stop`: (stop_reason, stop_sequence), `usage`:
    (input tokens, output tokens)."""
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": usage[0], "output_tokens": usage[1]}}


def event(kind: str, data: dict) -> str:
    """One server-sent event of Anthropic's stream."""
    return f"event: {kind}\ndata: {stream_json({'type': kind, **data})}\n\n"


class MessageRenderer:
    """One message's stream state: the open block (`index`, `kind`) and, with the connector,
    the `content` so far. Its methods yield (kind, data) events."""

    def __init__(self, skip: frozenset[str] | set[str] = frozenset()):
        self.index, self.kind = -1, None
        self.content: list[dict] = []
        self.skip = skip  # the connector's tools: their calls' blocks come once they ran

    def core(self, ev) -> Iterator[Event]:
        """One core event: blocks opened and closed as the kind changes; `Finish` closes the
        open one (and adds the choice's blocks to `content`)."""
        if isinstance(ev, Thought):
            if self.kind != "thinking":
                yield from self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield "content_block_delta", {"index": self.index, "delta": {"type": "thinking_delta", "thinking": ev.text}}
        elif isinstance(ev, Text):
            if self.kind != "text":
                yield from self.open("text", {"type": "text", "text": ""})
            yield "content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": ev.text}}
        elif isinstance(ev, ToolCallStart):
            yield from self.open("tool", {"type": "tool_use", "id": tool_id(), "name": ev.name, "input": {}})
        elif isinstance(ev, ToolCallArgs):
            yield "content_block_delta", {"index": self.index,
                                          "delta": {"type": "input_json_delta", "partial_json": ev.text}}
        elif isinstance(ev, Finish):
            yield from self.open(None, None)
            self.content += blocks(ev.choice, self.skip)

    def open(self, kind: str | None, start: dict | None) -> Iterator[Event]:
        """Close the open block and (unless `kind` is None) open block `start`."""
        if self.kind is not None:
            yield "content_block_stop", {"index": self.index}
            self.kind = None
        if kind is not None:
            self.index += 1
            self.kind = kind
            yield "content_block_start", {"index": self.index, "content_block": start}

    def tool(self, ev) -> Iterator[Event]:
        """One event of the tool loop (or of the chat core, within it): a connector call that ran
        as its mcp_tool_use and mcp_tool_result blocks; the loop's other events show nothing."""
        if isinstance(ev, CallRan):
            call = ev.call
            ran = [{"type": "mcp_tool_use", "id": call.id, "name": call.name, "server_name": call.tool.server_label,
                    "input": arguments_object(call.arguments)},
                   {"type": "mcp_tool_result", "tool_use_id": call.id, "is_error": call.error is not None,
                    "content": [{"type": "text", "text": call.output if call.error is None else call.error}]}]
            self.content += ran
            for b in ran:
                yield from self.open("mcp", b)
                yield from self.open(None, None)
        elif isinstance(ev, LoopFailed):
            yield "error", {"error": {"type": "api_error" if ev.code == "server_error" else ev.code,
                                      "message": ev.message}}
        else:
            yield from self.core(ev)
