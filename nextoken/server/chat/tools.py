"""Tool calling (OpenAI's ``tools``/``tool_choice``) in the model's own format.

The chat template renders the tools and earlier calls; the model answers in its native call
syntax, which `ToolCallParser` turns into OpenAI tool calls, for a stream or a whole text. The
one format known today is Hermes-style, which Qwen2.5 uses::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` ``"required"`` or a named function forces that shape with a grammar
(`forced_grammar`, the call tags referenced by token id); ``"auto"`` lets the model choose and
parses what it wrote; ``"none"`` leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import re

from nextoken.errors import InvalidRequest
from nextoken.server.chat.events import Event, Text, ToolCallArgs, ToolCallOut, ToolCallStart
from nextoken.structured.params import JSON_DEFAULTS, StructuredOutputsParams, close_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tools in a call format we parse (Hermes-style)."""
    return bool(template) and "tools" in template and OPEN in template


def require_tool_template(template: str | None) -> None:
    """Raises `InvalidRequest` (field "tools") when the chat template cannot render tools: the one
    check every API's tools go through."""
    if not supports_tools(template):
        raise InvalidRequest("this model's chat template has no tool-call support (it renders no tools in a "
                             "<tool_call> format); start the server with --chat-template FILE naming a template "
                             "that has one", "tools")


def messages_for_template(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as chat templates expect them: a missing content is "", and each
    earlier tool call's arguments are an object (OpenAI sends JSON text; templates encode them
    with ``tojson``, which would otherwise encode them twice). Arguments that are not JSON (a
    model's malformed call sent back in the history) stay the text they were."""
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "developer":  # OpenAI's newer name for the system role
            m["role"] = "system"
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c["function"]
                args = fn["arguments"]
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": {"name": fn["name"], "arguments": args}})
            m["tool_calls"] = calls
        out.append(m)
    return out


def _tag(tokenizer, text: str) -> str:
    """A Lark terminal for tag `text`: the token by id when it is one token, else the text."""
    ids = tokenizer.encode(text, add_bos=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def forced_grammar(tokenizer, tools: list[dict], name: str | None, parallel: bool) -> StructuredOutputsParams:
    """A grammar that admits only calls (of function `name`, or of any of `tools`), one or
    (with `parallel`) several, each ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
    with arguments following the function's parameter schema."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]  # (`name` is one: `chat.core`)
    variants = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": close_objects(t["function"].get("parameters") or {"type": "object", "properties": {}})},
        "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": JSON_DEFAULTS}  # compact, as in response_format
    call = f'{_tag(tokenizer, OPEN)} "\\n" %json {json.dumps(schema)} "\\n" {_tag(tokenizer, CLOSE)}'
    start = 'start: call ("\\n" call)*' if parallel and name is None else "start: call"
    return StructuredOutputsParams(grammar=f"{start}\ncall: {call}\n")


class ToolCallParser:
    """Splits model text into content and tool calls as it arrives.

    `feed` takes the next piece of text and returns the chat core's events (`chat.events`):
    `Text`, `ToolCallStart` once per call, then `ToolCallArgs` pieces, each of choice `index`;
    `finish` returns the last events. Text that might still turn into a call tag, and the end of a call's
    arguments (which might be the closing brace of the call object), is held back until it is
    sure, so the events of any split of a text are the events of the whole text. Whitespace
    around calls is dropped.

    `names`: the tools' names. With them, an answer that is nothing but call objects without
    the tags (``{"name": ..., "arguments": ...}``, one or several, maybe in a ```json fence), which
    small models often write, is calls too; such an answer is held back until it ends."""

    def __init__(self, names: set[str] | frozenset[str] = frozenset(), index: int = 0):
        self.names, self.index = frozenset(names), index
        self.calls: list[ToolCallOut] = []
        self.content = ""
        self._buf = ""  # content not yet emitted (a possible tag start, or held whitespace)
        self._body: str | None = None  # inside a call: its text so far
        self._args_at: int | None = None  # where the arguments start in the body
        self._sent = 0  # argument characters emitted for the open call
        self._gap = ""  # whitespace held before the open tag
        self.cut_call: ToolCallOut | None = None  # the call the token limit cut short (`finish`)

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._body is None:
            self._buf += text
        else:
            self._body += text
        while True:
            if self._body is None:
                if not self._scan_content(events):
                    return events
            elif not self._scan_call(events):
                return events

    def finish(self, cut: bool = False) -> list[Event]:
        """Events for the text held back at the end (an unclosed call is closed). `cut`: the
        text stopped at the token limit, so an open tag (or the start of one, or of an untagged
        call object) is a call cut short:
        its markup is dropped (never content), and a call whose arguments had begun stays out of `calls`
        (a stream has sent its pieces already; the finish reason says it was cut)."""
        events: list[Event] = []
        if self._body is None and self._bare_call(events, cut):
            return events
        if cut and self._body is None:  # the start of a tag, or of an untagged call, cut: no content either
            held = self.names and not self.content and not self.calls and self._call_start(self._buf)
            self._buf = "" if held else self._buf[: len(self._buf) - _partial_suffix(self._buf, OPEN)]
        if self._body is not None:
            if cut:
                if self._args_at is not None:
                    self.cut_call = self.calls.pop()
                self._body, self._args_at = None, None
            elif self._args_at is None:  # never became a call: it was content after all
                self._buf, self._body = self._gap + OPEN + self._body, None
            else:
                self._close(self._body, events)
        rest = self._buf.rstrip() if self.calls else self._buf  # whitespace after calls is dropped
        if rest:
            self._emit_content(rest, events)
        self._buf = ""
        return events

    # -- content -------------------------------------------------------------------------
    def _scan_content(self, events) -> bool:
        buf = self._buf
        i = buf.find(OPEN)
        if i >= 0:
            before = buf[:i].rstrip()  # whitespace just before a call is dropped
            if before:
                self._emit_content(before, events)
            self._gap = buf[len(before):i]  # (kept in case the tag turns out to be no call)
            self._buf, self._body, self._args_at, self._sent = "", buf[i + len(OPEN):], None, 0
            return True
        if self.names and not self.content and not self.calls and _may_be_bare(buf.lstrip()):
            return False  # maybe an untagged call: wait for the end
        # hold back what might start a tag, and trailing whitespace (dropped if a call follows)
        ready = buf[: len(buf) - _partial_suffix(buf, OPEN)].rstrip()
        if ready:
            self._emit_content(ready, events)
            self._buf = buf[len(ready):]
        return False

    def _bare_call(self, events, cut: bool = False) -> bool:
        """At the end: the held answer as untagged calls, if it is nothing else: one call object
        or several (Qwen2.5 writes one per line), maybe in a ```json fence. `cut` (the token
        limit): the complete objects are the calls, and an object cut short that began as a call
        of one of the tools is dropped."""
        if not self.names or self.content or self.calls:
            return False
        text = self._buf.strip()
        fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*(```)?", text, re.S)
        if fence and (fence.group(2) or cut):
            text = fence.group(1)
        objects, at, decoder = [], 0, json.JSONDecoder()
        while True:
            while at < len(text) and text[at] in " \t\r\n,":
                at += 1
            if at == len(text):
                break
            try:
                obj, end = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                if cut and objects and self._call_start(text[at:]):
                    break  # the last call, cut short
                return False
            if not isinstance(obj, dict) or obj.get("name") not in self.names \
                    or not isinstance(obj.get("arguments"), dict) or len(obj) != 2:
                return False
            objects.append((obj, text[at:end]))
            at = end
        if not objects:
            return False
        for obj, raw in objects:
            self._open_call(obj["name"], events)
            m = _HEAD.match(raw)
            self._args_at, self._sent = 0, 0
            self._send(_arguments_so_far(raw[m.end():]) if m else json.dumps(obj["arguments"]), events)
        self._buf, self._args_at = "", None
        return True

    def _call_start(self, text: str) -> bool:
        """Whether `text` is the start of an untagged call object of one of the tools (``{"name":
        "get_w``, maybe in a ```json fence), whitespace aside."""
        s = re.sub(r"\s+", "", text)
        s = s.removeprefix("```json") if s.startswith("```json") else s.removeprefix("```")
        head = '{"name":"'
        if len(s) <= len(head):
            return head.startswith(s)
        name = s[len(head):].split('"', 1)[0]
        return s.startswith(head) and any(n.startswith(name) for n in self.names)

    def _emit_content(self, text: str, events) -> None:
        self.content += text
        if text:
            events.append(Text(self.index, text))

    def _open_call(self, name: str, events) -> None:
        call = ToolCallOut(name)
        self.calls.append(call)
        events.append(ToolCallStart(self.index, len(self.calls) - 1, call.id, name))

    # -- calls ---------------------------------------------------------------------------
    def _scan_call(self, events) -> bool:
        body = self._body
        if self._args_at is None:
            m = _HEAD.match(body)
            if m is None:
                end = body.find(CLOSE)
                if end >= 0:  # a closed tag that is no call we read: plain content
                    self._body = None
                    self._emit_content(self._gap + OPEN + body[: end + len(CLOSE)], events)
                    self._buf = body[end + len(CLOSE):]
                    return True
                return False
            self._open_call(m.group(1), events)
            self._args_at = m.end()
        end = body.find(CLOSE, self._args_at)
        if end >= 0:
            self._close(body[:end], events)
            self._buf = body[end + len(CLOSE):]
            return True
        ready = _arguments_so_far(body[self._args_at:])
        self._send(ready, events)
        return False

    def _send(self, args: str, events) -> None:
        if len(args) > self._sent and args.startswith(self.calls[-1].arguments):
            piece = args[self._sent:]
            self.calls[-1].arguments += piece
            self._sent = len(args)
            events.append(ToolCallArgs(self.index, len(self.calls) - 1, piece))

    def _close(self, body: str, events) -> None:
        self._send(_arguments_so_far(body[self._args_at:]), events)
        self._body, self._args_at = None, None


def _arguments_so_far(tail: str) -> str:
    """The arguments text that is certain while the call is still open: without a partial
    closing tag, trailing whitespace and one closing brace (which may be the call object's)."""
    tail = tail[: len(tail) - _partial_suffix(tail, CLOSE)].rstrip()
    return tail[:-1].rstrip() if tail.endswith("}") else tail


def _may_be_bare(text: str) -> bool:
    """Whether an answer beginning with `text` may be an untagged call object."""
    return text.startswith("{") or text.startswith("```") or (bool(text) and "```json".startswith(text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def parse(text: str, names: set[str] | frozenset[str] = frozenset(), cut: bool = False) -> ToolCallParser:
    """The whole text through a `ToolCallParser` (what a non-streamed answer returns); `cut`: the
    text stopped at the token limit (`ToolCallParser.finish`)."""
    p = ToolCallParser(names)
    p.feed(text)
    p.finish(cut)
    return p


def arguments_object(arguments: str) -> dict:
    """A call's JSON arguments as the object APIs that take parsed arguments send (Anthropic's
    ``input``, Ollama's ``arguments``): other JSON wrapped as ``{"value": ...}``, text that is not
    JSON as ``{"_raw": ...}``."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"value": value}
