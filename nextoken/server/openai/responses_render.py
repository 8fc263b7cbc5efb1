"""The Responses API's answers: output items built as the chat core's events arrive (reasoning,
message, function_call) and, with MCP tools, the tool loop's (`tool_loop`: mcp_call,
mcp_approval_request, mcp_list_tools), with the Responses event sequence when streamed. One
`ResponseRenderer` per response holds the stream's state: the items so far, the open one, the
sequence number.

    response.output_item.added -> (deltas) -> *.done -> response.output_item.done   per item
"""

from __future__ import annotations

import uuid
from typing import Iterator

from nextoken.server.chat.events import Finish, Text, Thought, ToolCallArgs, ToolCallStart
from nextoken.server.openai.render import chat_logprobs
from nextoken.server.chat.tool_loop import CallArgs, CallClosed, CallOpened, CallRan, CallsCut, LoopFailed, PassStarted, \
    ServerCall
from nextoken.server.api.stream_json import stream_json


def reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def server_call_item(call: ServerCall) -> dict:
    """A server's call as its item: ``mcp_approval_request`` (it needs approval) or ``mcp_call``
    (in progress until it ran)."""
    item = {"type": "mcp_approval_request" if call.approval else "mcp_call", "id": call.id,
            "server_label": call.tool.server_label, "name": call.name, "arguments": call.arguments}
    if not call.approval:
        item.update(output=call.output, error=call.error, status="in_progress")
        if call.approval_request_id is not None:
            item["approval_request_id"] = call.approval_request_id
    return item


def text_logprobs(tok, token_ids: list[int], logprobs: list[dict] | None, n: int) -> list[dict]:
    """An output_text part's ``logprobs``: each generated token with its log-probability and its
    `n` most likely alternatives, the entries of the chat route's ``logprobs.content``."""
    return (chat_logprobs(tok, token_ids, logprobs, n) or {"content": []})["content"]


class ResponseRenderer:
    """One response's output `items` and, when `streamed`, its events (`emit` formats one with
    the next sequence number; unstreamed it formats none and returns None). Every method yields
    what `emit` returns."""

    def __init__(self, streamed: bool):
        self.streamed = streamed
        self.items: list[dict] = []
        self.open: int | None = None  # the open item's index
        self.seq = -1
        self.pass_start = 0  # the index of the current pass's first item
        self._server: dict[str, dict] = {}  # the servers' calls' items by their ids

    def emit(self, kind: str, data: dict) -> str | None:
        if not self.streamed:
            return None
        self.seq += 1
        payload = stream_json({"type": kind, "sequence_number": self.seq, **data})
        return f"event: {kind}\ndata: {payload}\n\n"

    # -- the chat core's events ----------------------------------------------------------------
    def core(self, ev) -> Iterator[str | None]:
        """One core event: an item opened when the kind changes, the deltas into it; `Finish`
        closes the open one."""
        if isinstance(ev, Thought):
            if self._open_type() != "reasoning":
                yield from self.close()
                yield from self._add(reasoning_item(""))
            item = self.items[self.open]
            item["content"][0]["text"] += ev.text
            yield self.emit("response.reasoning_text.delta", {"item_id": item["id"], "output_index": self.open,
                                                              "content_index": 0, "delta": ev.text})
        elif isinstance(ev, Text):
            if self._open_type() != "message":
                yield from self.close()
                yield from self._add(message_item(""))
                yield self.emit("response.content_part.added", {
                    "item_id": self.items[-1]["id"], "output_index": self.open, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}})
            item = self.items[self.open]
            item["content"][0]["text"] += ev.text
            yield self.emit("response.output_text.delta", {"item_id": item["id"], "output_index": self.open,
                                                           "content_index": 0, "delta": ev.text})
        elif isinstance(ev, ToolCallStart):
            yield from self.close()
            yield from self._add(call_item(ev.id, ev.name, ""))
        elif isinstance(ev, ToolCallArgs):
            item = self.items[self.open]
            item["arguments"] += ev.text
            yield self.emit("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": self.open,
                                                                       "delta": ev.text})
        elif isinstance(ev, Finish):
            yield from self.close()

    def _open_type(self) -> str | None:
        return None if self.open is None else self.items[self.open]["type"]

    def _add(self, item: dict) -> Iterator[str | None]:
        self.items.append(item)
        self.open = len(self.items) - 1
        yield self.emit("response.output_item.added", {"output_index": self.open,
                                                       "item": {**item, "status": "in_progress"}})

    def close(self) -> Iterator[str | None]:
        """Close the open item (an MCP call's arguments only: the call is done once it ran)."""
        if self.open is None:
            return
        i, item = self.open, self.items[self.open]
        self.open = None
        kind, ids = item["type"], {"item_id": item["id"], "output_index": i}
        if kind == "reasoning":
            yield self.emit("response.reasoning_text.done", {**ids, "content_index": 0,
                                                             "text": item["content"][0]["text"]})
        elif kind == "message":
            part = item["content"][0]
            yield self.emit("response.output_text.done", {**ids, "content_index": 0, "text": part["text"]})
            yield self.emit("response.content_part.done", {**ids, "content_index": 0, "part": part})
        elif kind in ("function_call", "mcp_call"):
            yield self.emit(f"response.{kind}_arguments.done", {**ids, "arguments": item["arguments"]})
        if kind != "mcp_call":
            yield self.emit("response.output_item.done", {"output_index": i, "item": item})

    def output(self, kept: set[str]) -> list[dict]:
        """The items, but function calls not in `kept` (cut by the token limit); an empty answer
        is an empty message."""
        return [it for it in self.items if it["type"] != "function_call" or it["call_id"] in kept] or \
            [message_item("")]

    # -- the tool loop's events ----------------------------------------------------------------
    def whole(self, item: dict) -> Iterator[str | None]:
        """A finished item (a listing, an approved call) as its added .. done events."""
        self.items.append(item)
        i, kind = len(self.items) - 1, item["type"]
        ids = {"item_id": item["id"], "output_index": i}
        yield self.emit("response.output_item.added", {"output_index": i, "item": {**item, "status": "in_progress"}})
        yield self.emit(f"response.{kind}.in_progress", ids)
        if kind == "mcp_call":
            yield self.emit("response.mcp_call_arguments.done", {**ids, "arguments": item["arguments"]})
        yield self.emit(f"response.{kind}.{'failed' if item.get('error') else 'completed'}", ids)
        yield self.emit("response.output_item.done", {"output_index": i, "item": item})

    def tool(self, ev) -> Iterator[str | None]:
        """One event of the tool loop (or of the chat core, within it)."""
        if isinstance(ev, PassStarted):
            self.pass_start = len(self.items)
        elif isinstance(ev, CallOpened):
            yield from self.close()
            item = self._server[ev.call.id] = server_call_item(ev.call)
            yield from self._add(item)
            if item["type"] == "mcp_call":
                yield self.emit("response.mcp_call.in_progress", {"item_id": item["id"], "output_index": self.open})
        elif isinstance(ev, CallArgs):
            item = self._server[ev.call.id]
            item["arguments"] += ev.text
            if item["type"] == "mcp_call":
                yield self.emit("response.mcp_call_arguments.delta", {"item_id": item["id"],
                                                                      "output_index": self.open, "delta": ev.text})
        elif isinstance(ev, CallClosed):
            yield from self.close()
        elif isinstance(ev, CallsCut):
            cut = {id(self._server.pop(c.id)) for c in ev.server_calls}
            self.items[:] = [it for it in self.items if id(it) not in cut and not (
                it["type"] == "function_call" and it["call_id"] in ev.ids)]
        elif isinstance(ev, CallRan):
            item = self._server.pop(ev.call.id, None)
            if item is None:  # an approved call, run before the first pass
                yield from self.whole({**server_call_item(ev.call), "status": ev.call.status})
                return
            item.update(arguments=ev.call.arguments, output=ev.call.output, error=ev.call.error,
                        status=ev.call.status)
            at = self.items.index(item)
            yield self.emit(f"response.mcp_call.{'failed' if ev.call.error else 'completed'}",
                            {"item_id": item["id"], "output_index": at})
            yield self.emit("response.output_item.done", {"output_index": at, "item": item})
        elif isinstance(ev, LoopFailed):
            yield self.emit("error", {"message": ev.message, "code": ev.code,
                                      **({"param": ev.field} if ev.code == "invalid_request_error" else {})})
        else:
            yield from self.core(ev)
