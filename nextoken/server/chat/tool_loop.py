"""The tool loop: one answer during which the server itself runs MCP calls, for every API that
offers it (the Responses API's ``{"type": "mcp"}`` tools, Anthropic's MCP connector). Each API
renders the loop's events in its own shapes (``mcp_call`` items, ``mcp_tool_use`` blocks); the
call budget, approvals, timeouts, usage and the errors after the 200 are decided here once.

    open_servers: the template renders tools, each server's URL is allowed, its tools listed
      (a 424 naming the tool when a listing fails) -- before any answer goes out
    ToolLoop.start: approved calls run, the first pass prepared (its errors a 400, no 200 yet)
    ToolLoop.events: per pass, the chat core's events (`chat.run`) with the servers' calls as
      CallOpened / CallArgs / CallClosed; then CallsCut (calls the token limit cut), each complete
      call run (CallRan); the next pass sees the results. It ends when a pass calls none of the
      servers' tools, a call needs approval, or `budget` calls ran; a failure after the 200 is
      LoopFailed (and `error`).

A forcing ``tool_choice`` binds the first pass only (the API's `spec(conversation, first)`), as
agent SDKs reset it after a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from nextoken.errors import InvalidRequest
from nextoken.server.chat.core import ChatSpec, append_call, prepare
from nextoken.server.chat.events import Failed, Finish, Tokens, ToolCallArgs, ToolCallStart, Usage
from nextoken.server.chat.run import run
from nextoken.server.chat.tools import require_tool_template
from nextoken.server.chat.mcp_tools import Limits, MCPTool, check_allowed, item_id, listings, run_call, server_limits


@dataclass
class ServerCall:
    """A call of an MCP server's tool: as the model writes it (`arguments`, streamed), and once
    run its `output` or its `error` (a failed call, a declined one, one not run). `approval`: it
    needs the client's approval, so the answer ends at it. `id`: its item's id."""

    id: str
    name: str
    tool: MCPTool
    arguments: str = ""
    approval: bool = False
    output: str | None = None
    error: str | None = None
    approval_request_id: str | None = None  # the approval request it answers (an approved call)

    @property
    def status(self) -> str:
        return "failed" if self.error is not None else "completed"


@dataclass(frozen=True)
class PassStarted:
    """A pass of generation begins (the first, or one after calls ran)."""


@dataclass(frozen=True)
class CallOpened:
    """The model began a call of a server's tool."""
    call: ServerCall


@dataclass(frozen=True)
class CallArgs:
    """A piece of the call's arguments (JSON text)."""
    call: ServerCall
    text: str


@dataclass(frozen=True)
class CallClosed:
    """The call's arguments are complete (it has not run yet)."""
    call: ServerCall


@dataclass(frozen=True)
class CallsCut:
    """After a pass's `Finish`: the core ids of its calls (the servers' and the client's) that the
    token limit cut; they are not calls."""
    ids: frozenset[str]
    server_calls: tuple[ServerCall, ...]  # those among them that were the servers'


@dataclass(frozen=True)
class CallRan:
    """The call ran (its output or error set, its result added to the conversation), or was not
    run (`error` says why)."""
    call: ServerCall


@dataclass(frozen=True)
class LoopFailed:
    """The answer could not go on after the 200 (the engine failed, the conversation outgrew the
    context): `code` "server_error" or "invalid_request_error"; `field` the request's field."""
    message: str
    code: str
    field: str | None = None


LoopEvent = Union[PassStarted, CallOpened, CallArgs, CallClosed, CallsCut, CallRan, LoopFailed]


@dataclass
class Servers:
    """The MCP servers of a request, listed: the limits, the listing items (OpenAI's
    ``mcp_list_tools``), tool name -> its server, and the tools offered (OpenAI chat's shape)."""

    limits: Limits
    items: list[dict]
    owners: dict[str, MCPTool]
    offered: list[dict] = field(default_factory=list)


async def open_servers(serving, servers: list[tuple[int, MCPTool]], field_name: str, url_field: str) -> Servers:
    """Check and list the request's MCP servers (`servers`: their places in the request's list
    `field_name`, whose entries' URL field is `url_field`). Raises `InvalidRequest` (a template
    without tools: checked before any server is contacted; a URL not allowed; no mcp package) or
    `DependencyFailed` (a server that cannot list its tools)."""
    require_tool_template(serving.engine.tokenizer.chat_template)
    limits = server_limits(serving.args, field_name)
    for i, t in servers:
        check_allowed(t, f"{field_name}[{i}].{url_field}", limits)
    items, owners, offered = await listings(servers, limits, field_name)
    return Servers(limits, items, owners, offered)


Spec = Callable[[list[dict], bool], ChatSpec]  # (the conversation so far, first pass?) -> the pass's spec


class ToolLoop:
    """The passes of one answer over the chat core (the module's docstring). `spec` makes a
    pass's `ChatSpec` from the conversation (which grows by each call and its result);
    `budget`: the calls it may run; `prefix`: the engine request ids'. After `events`: `usage`
    (all passes), `finish` (the last pass's reason), `error` (what ended it early, or None)."""

    def __init__(self, serving, request, lora, servers: Servers, conversation: list[dict], spec: Spec,
                 budget: int, prefix: str):
        self.serving, self.request, self.lora, self.servers = serving, request, lora, servers
        self.conversation, self.spec, self.budget, self.prefix = list(conversation), spec, budget, prefix
        self.usage, self.finish, self.error = Usage(0, 0), None, None
        self.approved: list[ServerCall] = []

    async def start(self, approved: list[ServerCall] = ()) -> "ToolLoop":
        """Run the calls the client approved (their results join the conversation) and prepare
        the first pass. Raises `InvalidRequest` as `chat.core.prepare` does, before the 200."""
        for call in approved:
            await self._run(call)
        self.approved = list(approved)
        self.first = await prepare(self.serving, self.spec(self.conversation, True))
        return self

    async def _run(self, call: ServerCall) -> None:
        """Run `call` (unless declined) and add it and its result (or error) to the conversation."""
        if call.error is None:
            call.output, call.error = await run_call(call.tool, call.name, call.arguments, self.servers.limits)
        append_call(self.conversation, call.id, call.name, call.arguments)
        self.conversation.append({"role": "tool", "tool_call_id": call.id,
                                  "content": call.output if call.error is None else f"error: {call.error}"})

    async def events(self):
        """The chat core's events of every pass and the loop's own (`LoopEvent`)."""
        for call in self.approved:
            yield CallRan(call)
        p, used = self.first, 0
        while True:
            yield PassStarted()
            calls: dict[str, ServerCall] = {}  # this pass's calls of the servers' tools, by core id
            pass_ids: set[str] = set()
            choice, open_call = None, None
            async for ev in await run(self.serving, p, self.request, self.lora, stream=True, prefix=self.prefix):
                if isinstance(ev, Failed):
                    self.error = RuntimeError(ev.message)
                    yield LoopFailed(ev.message, "server_error")
                    return
                if isinstance(ev, ToolCallArgs) and open_call is not None:
                    open_call.arguments += ev.text
                    yield CallArgs(open_call, ev.text)
                    continue
                if open_call is not None and not isinstance(ev, Tokens):  # anything else ends its arguments
                    yield CallClosed(open_call)
                    open_call = None
                if isinstance(ev, ToolCallStart):
                    pass_ids.add(ev.id)
                    tool = self.servers.owners.get(ev.name)
                    if tool is not None:
                        approval = tool.needs_approval(ev.name)
                        open_call = calls[ev.id] = ServerCall(item_id("mcpr" if approval else "mcp"), ev.name, tool,
                                                              approval=approval)
                        yield CallOpened(open_call)
                        continue
                if isinstance(ev, Finish):
                    choice, self.finish = ev.choice, ev.reason
                    self.usage = Usage(self.usage.prompt_tokens + ev.usage.prompt_tokens,
                                       self.usage.completion_tokens + ev.usage.completion_tokens)
                yield ev
            kept = {c.id: c for c in choice.calls} if choice is not None else {}
            cut = frozenset(pass_ids - kept.keys())
            yield CallsCut(cut, tuple(calls[i] for i in cut if i in calls))
            complete = [calls[i] for i in kept if i in calls]
            for i, call in calls.items():
                if i in kept:
                    call.arguments = kept[i].arguments  # the parse of the whole (what was streamed)
            asks = any(c.approval for c in complete)
            runs = [c for c in complete if not c.approval]
            stop = asks or not runs or used >= self.budget
            for call in runs:
                if asks or used >= self.budget:
                    call.error = "not run: " + ("the answer ends at a call awaiting approval" if asks
                                                else f"the limit of {self.budget} calls was reached")
                else:
                    await self._run(call)
                    used += 1
                yield CallRan(call)
            if stop:
                return
            try:
                p = await prepare(self.serving, self.spec(self.conversation, False))
            except InvalidRequest as exc:  # (the conversation outgrew the context, ...): after the 200
                self.error = exc
                yield LoopFailed(str(exc), "invalid_request_error", exc.field)
                return
