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

import threading
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Union

from cachetools import LRUCache
from fastapi import Request
from pydantic import ConfigDict, Field, model_validator

from nextoken import sampling_defaults
from nextoken.bodies import BODY, Body, FiniteFloat, LogprobCount, MaxTokens, NonEmptyStr, Published, accept_published, unset_or
from nextoken.errors import InvalidRequest, NotFound
from nextoken.server.api import published
from nextoken.server.api.rules import Rule, check, forbid
from nextoken.server.chat import rules as chat_rules
from nextoken.server.chat.core import ChatSpec, append_call, prepare
from nextoken.server.openai import responses_mcp
from nextoken.server.openai.protocol import FORCING_CHOICE
from nextoken.server.openai.responses_render import ResponseRenderer, call_item, message_item, reasoning_item, \
    text_logprobs
from nextoken.server.chat.mcp_tools import MCPTool
from nextoken.server.chat.events import Failed, Finish
from nextoken.server.chat.run import run
from nextoken.server.api.serving import ApiServing, sse_response
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


# POST /v1/responses (the `openai` SDK's ResponseCreateParams)
PUBLISHED = {
    "prompt_cache_key": published.CACHE, "prompt_cache_retention": published.CACHE,
    "prompt_cache_options": published.CACHE,
    "safety_identifier": published.ACCOUNT, "moderation": published.ACCOUNT, "access_programs": published.ACCOUNT,
    "service_tier": published.TIER,
    "reasoning": published.HINT,
    "stream_options": Published("include_obfuscation pads events against side channels; a local server has none"),
    "background_options": Published("options of background mode", published.empty_or_unset,
                                    "background mode is not available"),
    "image": Published("image generation options", published.empty_or_unset, "image generation is not available"),
    "background": Published("background mode", unset_or(False), "a response runs while its request is open"),
    "conversation": Published("OpenAI's Conversations API", unset_or(), "use previous_response_id"),
    "prompt": Published("a stored prompt template", unset_or(), "send the instructions and input"),
    "context_management": Published("server-side compaction", published.empty_or_unset,
                                    "context compaction is not available"),
    "truncation": Published("'auto' drops old input to fit the context", unset_or("disabled"),
                            "a prompt past the context is refused, never truncated"),
}


# /v1/responses: log-probabilities are not returned beside MCP tools (the tool rules every chat API
# shares: `server.chat.rules`)
RESPONSES_RULES = [
    Rule({"required": ["include", "tools"], "properties": {
        "include": {"type": "array", "contains": {"const": "message.output_text.logprobs"}},
        "tools": {"type": "array", "contains": {"type": "object", "required": ["type"],
                                                "properties": {"type": {"const": "mcp"}}}}}},
         "message.output_text.logprobs is not supported with MCP tools", "include")]
# the chat rules in the Responses API's names: its output constraint is a JSON text.format
JSON_TEXT_FORMAT = {"required": ["text"], "properties": {"text": {
    "type": "object", "required": ["format"], "properties": {"format": {
        "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}}}
CHAT_FIELDS = chat_rules.ChatFields(FORCING_CHOICE, constraints=(JSON_TEXT_FORMAT,))


class ResponsesRequest(Body):
    RULES: ClassVar[list] = RESPONSES_RULES  # cross-field rules: the schema below, and `create`'s check
    model_config = ConfigDict(**BODY, json_schema_extra=forbid(*RESPONSES_RULES, *chat_rules.published(CHAT_FIELDS)))

    model: NonEmptyStr | None = None
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[MaxTokens, Field(ge=1)] | None = None
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
    priority: int = 0  # as chat completions' (vLLM's)
    cache_salt: NonEmptyStr | None = None  # as chat completions' (vLLM's)
    max_tool_calls: int | None = Field(None, ge=1)  # MCP calls the server may run for this response
    # "message.output_text.logprobs": each output_text part's tokens with their log-probabilities (and
    # top_logprobs alternatives); "reasoning.encrypted_content" adds nothing (reasoning is plain text here)
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    top_logprobs: LogprobCount | None = None

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])

    @model_validator(mode="before")
    @classmethod
    def _published(cls, data):
        """OpenAI's published fields that change nothing here (`PUBLISHED`)."""
        return accept_published(data, PUBLISHED)


# -- the store ----------------------------------------------------------------------------------
class ResponseStore:
    """At most `size` responses (id -> (the response's JSON, its conversation as chat messages)),
    least recently used first out; thread-safe. `size` 0: nothing is kept."""

    def __init__(self, size: int):
        self.size = size
        self._items: LRUCache[str, tuple[dict, list[dict]]] = LRUCache(max(size, 1))
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[response["id"]] = (response, conversation)

    def get(self, rid: str, field: str = "response_id") -> tuple[dict, list[dict]]:
        """Raises `NotFound` (404, naming `field`) for an id not (or no longer) stored."""
        with self._lock:
            if rid not in self._items:
                raise NotFound(f"{field} {rid!r} is not stored (the last {self.size} stored responses are kept)",
                               field)
            return self._items[rid]  # (a read makes it the most recently used)

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
                    {"temperature": body.temperature, "top_p": body.top_p,
                     "logprobs": (body.top_logprobs or 0) if body.wants_logprobs else None}, body.max_output_tokens,
                    fields={"max_tokens": "max_output_tokens", "constraint": "text.format", "logprobs": "top_logprobs"},
                    priority=body.priority, client=f"user:{body.user}" if body.user else "", cache_salt=body.cache_salt,
                    unset=sampling_defaults.unset(body.model_fields_set))


# -- serving ------------------------------------------------------------------------------------
class OpenAIServingResponses(ApiServing):
    """``/v1/responses`` over the shared engine; `store`: the `ResponseStore`."""

    def __init__(self, state, args, metrics):
        super().__init__(state, args, metrics)
        self.store = ResponseStore(args.responses_store)

    async def create(self, body: ResponsesRequest, request: Request):
        lora = self.check_model(body.model)
        check(body.model_dump(exclude_none=True, by_alias=True), body.RULES)
        self.check_queue()
        if body.previous_response_id is not None and self.store.size <= 0:
            raise InvalidRequest("previous_response_id needs the response store, which is off on this server "
                                 "(--responses-store 0)", "previous_response_id")
        previous, history = self.store.get(body.previous_response_id, "previous_response_id") \
            if body.previous_response_id else (None, [])
        conversation = to_chat_messages(body, history)
        if not conversation:
            raise InvalidRequest("input holds nothing to answer: MCP approval items alone continue a previous "
                                 "response (give previous_response_id) or come with a message", "input")
        meta = {"created_at": int(time.time()), "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "tool_choice": _tool_choice_json(body.tool_choice)}
        if any(t.type == "mcp" for t in body.tools or []):
            return await self._mcp(body, request, lora, meta, conversation, previous)
        p = await prepare(self, to_spec(body, conversation))
        res = await run(self, p, request, lora, body.stream, "resp_")
        if body.stream:
            return sse_response(self._stream(body, res, meta, conversation))
        response = self.response(body, res, meta)
        self._keep(body, response, conversation)
        return response

    async def _mcp(self, body, request, lora, meta, conversation, previous):
        """A response whose tools include MCP servers (`responses_mcp.MCPResponse`), streamed or not."""
        rid = f"resp_{uuid.uuid4().hex[:24]}"
        envelope = lambda output, finish, usage, status=None: self.envelope(  # noqa: E731
            body, rid, output, finish, usage, meta, status)
        answer = await responses_mcp.MCPResponse(self, body, request, lora, envelope, to_spec,
                                                 ResponseRenderer(body.stream)).start(conversation, previous)
        if body.stream:
            async def events():
                async for text in answer.events():
                    if text is not None:
                        yield text
                if answer.response is not None:
                    self._keep(body, answer.response, answer.conversation)
            return sse_response(events())
        response = await answer.run()
        self._keep(body, response, answer.conversation)
        return response

    def _keep(self, body, response: dict, conversation: list[dict]) -> None:
        if body.store:
            self.store.put(response, conversation + _as_messages(response["output"]))

    def response(self, body, res, meta) -> dict:
        """The response of the core's `ChatResult`: reasoning, message, function_call items."""
        c = res.choices[0]
        output = [reasoning_item(c.thought)] if c.thought else []
        if c.text or not c.calls:
            output.append(message_item(c.text))
            if body.wants_logprobs:
                output[-1]["content"][0]["logprobs"] = text_logprobs(self.engine.tokenizer, c.token_ids,
                                                                     c.logprobs, body.top_logprobs or 0)
        output += [call_item(call.id, call.name, call.arguments) for call in c.calls]
        return self.envelope(body, res.request_id, output, c.finish, res.usage, meta)

    def envelope(self, body, rid, output, finish: str | None, usage, meta, status: str | None = None) -> dict:
        """The response object around `output`; `finish`: the core's finish reason (None: not
        finished), `usage`: a `chat.run.Usage` or None."""
        incomplete = finish == "length"
        n_in, n_out = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
        used = {name: getattr(body, name) if name in body.model_fields_set  # (unset: the model's default, if any)
                else self.engine.sampling_defaults.get(name, getattr(body, name)) for name in ("temperature", "top_p")}
        return {"id": rid, "object": "response", "created_at": meta["created_at"],
                "status": status or ("incomplete" if incomplete else "completed"), "model": self.args.model_name,
                "output": output, "output_text": "".join(p["text"] for item in output if item["type"] == "message"
                                                         for p in item["content"]),
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete and not status else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": used["temperature"], "top_p": used["top_p"], "tools": meta["tools"],
                "tool_choice": meta["tool_choice"], "parallel_tool_calls": body.parallel_tool_calls,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "metadata": body.metadata or {}, "error": None,
                "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
                          "input_tokens_details": {"cached_tokens": usage.cached_tokens if usage else 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    async def _stream(self, body, events, meta, conversation):
        """The Responses event sequence of the core's events."""
        r = ResponseRenderer(streamed=True)
        start = self.envelope(body, events.request_id, [], None, None, meta, status="in_progress")
        yield r.emit("response.created", {"response": start})
        yield r.emit("response.in_progress", {"response": start})
        tok = self.engine.tokenizer
        async for ev in events:
            if isinstance(ev, Failed):
                yield r.emit("error", {"message": ev.message, "code": "server_error"})
                return
            if isinstance(ev, Finish) and body.wants_logprobs:  # the message's, before it closes (as unstreamed)
                for item in r.items:
                    if item["type"] == "message":
                        item["content"][0]["logprobs"] = text_logprobs(tok, ev.choice.token_ids, ev.choice.logprobs,
                                                                       body.top_logprobs or 0)
                        break
            for text in r.core(ev):
                yield text
            if isinstance(ev, Finish):
                output = r.output({call.id for call in ev.choice.calls})  # a call cut by the token limit is not one
                final = self.envelope(body, events.request_id, output, ev.reason, ev.usage, meta)
                yield r.emit("response.completed" if final["status"] == "completed" else "response.incomplete",
                             {"response": final})
                self._keep(body, final, conversation)


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
