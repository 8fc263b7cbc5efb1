"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``)
as a translation onto the chat path: the same template, engine, structured output and tool-call
parser as /v1/chat/completions.

    input (a string, or message / function_call / function_call_output items) + instructions
      (+ the stored conversation of previous_response_id) -> chat messages -> ids, SamplingParams
      -> the engine -> output items (message with output_text, function_call), usage
         or, streamed, the Responses event sequence (response.created ... response.completed)

With ``store`` (the API's default), a response and its conversation are kept in a bounded
in-memory store (`ResponseStore`, ``--responses-store N``, least recently used first out), so a
later request can continue it with ``previous_response_id``; with the store off (``N = 0``) such a
request is a 400 that says so.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi import Request
from pydantic import Field, model_validator

from nextoken.bodies import Body, FiniteFloat, NonEmptyStr, accept_published
from nextoken.errors import InvalidRequest, NotFound
from nextoken.server import published
from nextoken.server.chat_core import ChatSpec, append_call, prepare
from nextoken.server import responses_mcp
from nextoken.server.mcp_tools import MCPTool
from nextoken.server import tools as tools_mod
from nextoken.server.reasoning import StreamSplitter, split as split_reasoning
from nextoken.server.serving import OpenAIServing, iter_events, sse_response
from nextoken.structured.params import StructuredOutputsParams


# -- the request ------------------------------------------------------------------------------
class ContentPart(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str
    id: str | None = None
    status: str | None = None


class MCPApprovalResponseItem(Body):
    """The client's answer to an ``mcp_approval_request`` item of an earlier response."""
    type: Literal["mcp_approval_response"]
    approval_request_id: NonEmptyStr
    approve: bool
    reason: str | None = None
    id: str | None = None


class MCPCallItem(Body):
    """An earlier response's MCP call passed back as input (a client that keeps the history)."""
    type: Literal["mcp_call"]
    id: str | None = None
    server_label: str
    name: NonEmptyStr
    arguments: str
    output: str | None = None
    error: str | None = None
    status: str | None = None
    approval_request_id: str | None = None


class MCPEchoItem(Body):
    """An earlier response's tool listing or approval request passed back as input: the listing
    changes nothing, the approval request is what an ``mcp_approval_response`` answers."""
    model_config = {**Body.model_config, "extra": "allow"}
    type: Literal["mcp_list_tools", "mcp_approval_request"]
    id: str | None = None


InputItem = Union[FunctionCallItem, FunctionCallOutputItem, MessageItem, MCPApprovalResponseItem, MCPCallItem,
                  MCPEchoItem]


class FunctionTool(Body):
    type: Literal["function"]
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: NonEmptyStr


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a style hint; changes nothing here


class ResponsesRequest(Body):
    model: NonEmptyStr | None = None
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: FiniteFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: FiniteFloat = Field(1.0, gt=0.0, le=1.0)
    tools: list[Annotated[Union[FunctionTool, MCPTool], Field(discriminator="type")]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: NonEmptyStr | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # MCP calls the server may run for this response

    @model_validator(mode="before")
    @classmethod
    def _published(cls, data):
        """OpenAI's published fields that change nothing here (`published.RESPONSES`)."""
        return accept_published(data, published.RESPONSES)


# -- the store ----------------------------------------------------------------------------------
class ResponseStore:
    """At most `size` responses (id -> (the response's JSON, its conversation as chat messages)),
    least recently used first out; thread-safe. `size` 0: nothing is kept."""

    def __init__(self, size: int):
        self.size = size
        self._items: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str, field: str = "response_id") -> tuple[dict, list[dict]]:
        """Raises `NotFound` (404, naming `field`) for an id not (or no longer) stored."""
        with self._lock:
            if rid not in self._items:
                raise NotFound(f"{field} {rid!r} is not stored (the last {self.size} stored responses are kept)",
                               field)
            self._items.move_to_end(rid)
            return self._items[rid]

    def delete(self, rid: str) -> None:
        with self._lock:
            if self._items.pop(rid, None) is None:
                raise NotFound(f"response {rid!r} is not stored", "response_id")


# -- translation --------------------------------------------------------------------------------
def to_chat_messages(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The conversation so far (`history`: a stored one) plus this request's instructions and
    input, as OpenAI chat messages (what the chat templates take)."""
    out = list(history)
    if body.instructions:
        out = [m for m in out if m["role"] != "system"]
        out.insert(0, {"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    for item in body.input:
        if item.type == "message":
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            out.append({"role": item.role, "content": text})
        elif item.type == "function_call":
            append_call(out, item.call_id, item.name, item.arguments)
        elif item.type == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif item.type == "mcp_call":  # a call the server ran earlier: the call and its result
            call_id = item.id or f"call_{uuid.uuid4().hex[:24]}"
            append_call(out, call_id, item.name, item.arguments)
            out.append({"role": "tool", "tool_call_id": call_id, "content": item.output or item.error or ""})
        # mcp_list_tools changes nothing; approval requests and responses: the MCP loop (`responses_mcp`)
    return out


def _structured(body: ResponsesRequest) -> StructuredOutputsParams | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.schema_ is None:
        raise InvalidRequest("text.format of type json_schema needs a schema", "text.format.schema")
    return StructuredOutputsParams(json=fmt.schema_)


def to_spec(body: ResponsesRequest, conversation: list[dict], mcp_tools: list[dict] | None = None,
            first: bool = True) -> ChatSpec:
    """The request as the chat core's `ChatSpec` (its conversation already as chat messages),
    with the listed tools of its MCP servers (`mcp_tools`, in OpenAI chat's shape). After the
    server ran MCP calls (`first` False) a forcing tool_choice is "auto": it forced the first."""
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.parameters or {"type": "object", "properties": {}}}}
             for t in body.tools or [] if t.type == "function"] + (mcp_tools or [])
    choice = body.tool_choice if first or body.tool_choice in (None, "none") else "auto"
    return ChatSpec(conversation, tools or None, choice.name if isinstance(choice, NamedFunction) else choice,
                    body.parallel_tool_calls, _structured(body),
                    {"temperature": body.temperature, "top_p": body.top_p}, body.max_output_tokens,
                    fields={"max_tokens": "max_output_tokens", "constraint": "text.format"})


def _event(kind: str, data: dict, seq: list[int]) -> str:
    seq[0] += 1
    payload = json.dumps({"type": kind, "sequence_number": seq[0], **data}, ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n"


# -- serving ------------------------------------------------------------------------------------
class OpenAIServingResponses(OpenAIServing):
    """``/v1/responses`` over the shared engine; `store`: the `ResponseStore`."""

    def __init__(self, state, args, metrics):
        super().__init__(state, args, metrics)
        self.store = ResponseStore(args.responses_store)

    async def create(self, body: ResponsesRequest, request: Request):
        lora = self.check_model(body.model)
        self.check_queue()
        if body.previous_response_id is not None and self.store.size <= 0:
            raise InvalidRequest("previous_response_id needs the response store, which is off on this server "
                                 "(--responses-store 0)", "previous_response_id")
        previous, history = self.store.get(body.previous_response_id, "previous_response_id") \
            if body.previous_response_id else (None, [])
        conversation = to_chat_messages(body, history)
        meta = {"created_at": int(time.time()), "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "tool_choice": _tool_choice_json(body.tool_choice)}
        if any(t.type == "mcp" for t in body.tools or []):
            response, conversation = await responses_mcp.respond(self, body, request, lora, conversation, previous,
                                                                 meta, to_spec)
            self._keep(body, response, conversation)
            if body.stream:
                seq = [-1]
                return sse_response(iter_events(responses_mcp.replay(response, lambda k, d: _event(k, d, seq))))
            return response
        p = await prepare(self, to_spec(body, conversation))
        rid = await self.engine.add_request(p.ids, p.params, f"resp_{uuid.uuid4().hex}", lora_request=lora)
        names = p.names
        if body.stream:
            return sse_response(self._stream(body, rid, names, meta, conversation))
        out = (await self.collect([rid], request))[0]
        self.record([out])
        response = self._response(body, out, names, meta)
        self._keep(body, response, conversation)
        return response

    def _keep(self, body, response: dict, conversation: list[dict]) -> None:
        if body.store:
            self.store.put(response, conversation + _as_messages(response["output"]))

    def _response(self, body, out, names, meta) -> dict:
        c = out.outputs[0]
        style = self.args.reasoning_parser
        thought, text = split_reasoning(c.text, style) if style else ("", c.text)
        calls = []
        if names:
            parsed = tools_mod.parse(text, names, c.finish_reason == "length")
            text, calls = parsed.content, parsed.calls
        output = [_reasoning_item(thought)] if thought else []
        if text or not calls:
            output.append(_message_item(text))
        output += [_call_item(call.id, call.name, call.arguments) for call in calls]
        return self._envelope(body, out.request_id, output, c, len(out.prompt_token_ids), meta)

    def _envelope(self, body, rid, output, c, num_prompt, meta, status: str | None = None) -> dict:
        incomplete = c is not None and c.finish_reason == "length"
        n_out = len(c.token_ids) if c is not None else 0
        return {"id": rid, "object": "response", "created_at": meta["created_at"],
                "status": status or ("incomplete" if incomplete else "completed"), "model": self.args.model_name,
                "output": output, "output_text": "".join(p["text"] for item in output if item["type"] == "message"
                                                         for p in item["content"]),
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete and not status else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p, "tools": meta["tools"],
                "tool_choice": meta["tool_choice"], "parallel_tool_calls": body.parallel_tool_calls,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "metadata": body.metadata or {}, "error": None,
                "usage": {"input_tokens": num_prompt, "output_tokens": n_out, "total_tokens": num_prompt + n_out,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    async def _stream(self, body, rid, names, meta, conversation):
        """The Responses event sequence for request `rid`."""
        seq = [-1]
        start = self._envelope(body, rid, [], None, 0, meta, status="in_progress")
        yield _event("response.created", {"response": start}, seq)
        yield _event("response.in_progress", {"response": start}, seq)
        splitter = StreamSplitter(self.args.reasoning_parser, names)
        state = {"items": [], "open": None}  # the output items so far; the open one's index
        out = c = None
        try:
            async for out in self.engine.stream(rid):
                c = out.outputs[0]
                thought, events = splitter.feed(c.delta, c.finished, c.finish_reason == "length")
                for piece in thought:  # the thought as a reasoning item, the answer as before
                    for event in _reasoning_events(piece, state, seq):
                        yield event
                for event in _item_events(events, state, splitter.parser, seq):
                    yield event
        except Exception as exc:  # noqa: BLE001 - after the 200 went out: an error event ends the stream
            yield _event("error", {"message": str(exc), "code": "server_error"}, seq)
            return
        for text in _close(state, seq):
            yield text
        if not state["items"]:
            state["items"].append(_message_item(""))
        final = self._envelope(body, rid, state["items"], c, len(out.prompt_token_ids), meta)
        yield _event("response.completed" if final["status"] == "completed" else "response.incomplete",
                     {"response": final}, seq)
        self.record([out])
        self._keep(body, final, conversation)


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _reasoning_events(piece: str, state: dict, seq: list[int]):
    """A piece of the thought: into the open reasoning item (opened first when another is)."""
    items = state["items"]
    if state["open"] is None or items[state["open"]]["type"] != "reasoning":
        yield from _close(state, seq)
        yield from _open(state, _reasoning_item(""), seq)
    item = items[state["open"]]
    item["content"][0]["text"] += piece
    yield _event("response.reasoning_text.delta", {"item_id": item["id"], "output_index": state["open"],
                                                   "content_index": 0, "delta": piece}, seq)


def _message_item(text: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def _tool_choice_json(choice):
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _as_messages(output: list[dict]) -> list[dict]:
    """A response's output items as chat messages, for the stored conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


def _item_events(events, state: dict, parser, seq: list[int]):
    """Responses events for `ToolCallParser` events (or plain text): an output item opened when
    the kind changes, text deltas into a message item, argument deltas into a function_call."""
    items = state["items"]
    for ev in events:
        if ev[0] == "content":
            if not ev[1]:
                continue
            if state["open"] is None or items[state["open"]]["type"] != "message":
                yield from _close(state, seq)
                yield from _open(state, _message_item(""), seq)
                yield _event("response.content_part.added", {"item_id": items[-1]["id"], "output_index": state["open"],
                                                             "content_index": 0,
                                                             "part": {"type": "output_text", "text": "",
                                                                      "annotations": []}}, seq)
            item = items[state["open"]]
            item["content"][0]["text"] += ev[1]
            yield _event("response.output_text.delta", {"item_id": item["id"], "output_index": state["open"],
                                                        "content_index": 0, "delta": ev[1]}, seq)
        elif ev[0] == "call":
            call = parser.calls[ev[1]]
            yield from _close(state, seq)
            yield from _open(state, _call_item(call.id, call.name, ""), seq)
        elif ev[2]:
            item = items[state["open"]]
            item["arguments"] += ev[2]
            yield _event("response.function_call_arguments.delta", {"item_id": item["id"],
                                                                    "output_index": state["open"], "delta": ev[2]}, seq)


def _open(state: dict, item: dict, seq: list[int]):
    state["items"].append(item)
    state["open"] = len(state["items"]) - 1
    shown = {**item, "status": "in_progress"}
    yield _event("response.output_item.added", {"output_index": state["open"], "item": shown}, seq)


def _close(state: dict, seq: list[int]):
    if state["open"] is None:
        return
    i, item = state["open"], state["items"][state["open"]]
    if item["type"] == "reasoning":
        yield _event("response.reasoning_text.done", {"item_id": item["id"], "output_index": i, "content_index": 0,
                                                      "text": item["content"][0]["text"]}, seq)
    elif item["type"] == "message":
        part = item["content"][0]
        yield _event("response.output_text.done", {"item_id": item["id"], "output_index": i, "content_index": 0,
                                                   "text": part["text"]}, seq)
        yield _event("response.content_part.done", {"item_id": item["id"], "output_index": i, "content_index": 0,
                                                    "part": part}, seq)
    else:
        yield _event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": i,
                                                               "arguments": item["arguments"]}, seq)
    yield _event("response.output_item.done", {"output_index": i, "item": item}, seq)
    state["open"] = None
