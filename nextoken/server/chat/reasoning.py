"""Separating a thinking model's thought from its answer (``<think>...</think>``, as Qwen3 and
the DeepSeek-R1 distills write it), for every API: ``reasoning_content`` (and ``reasoning``) in
chat, a ``reasoning`` item in Responses, ``thinking`` blocks in Messages, ``thinking`` in Ollama.

`ReasoningParser` works on a stream: `feed` takes the next piece of text and returns the chat
core's events `Thought` and `Text` (`chat.events`), holding back what might still be the start of
a tag, so the events of any split of a text are the events of the whole text (`split`). The two
styles (``--reasoning-parser``): ``qwen3`` (a thought only when the answer opens with
``<think>``) and ``deepseek_r1`` (the template opens the thought: everything up to ``</think>`` is
thought, a leading ``<think>`` dropped).
"""

from __future__ import annotations

from nextoken.server.chat.events import Event, Text, Thought
from nextoken.server.chat.tools import ToolCallParser

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")  # (server.args restates them: it imports no server code)


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One completion's stream of text split into thought and answer (see the module)."""

    def __init__(self, style: str = "qwen3", index: int = 0):
        self.index = index  # the choice's
        if style not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {style!r}")
        self.state = "start"  # start: nothing decided yet; think: in the thought; answer: after it
        self.buf = ""
        self.opens_in_thought = style == "deepseek_r1"
        self.strip = False  # just after </think>: its newlines are dropped
        self.reasoning = self.content = ""

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(START) or (self.opens_in_thought and not START.startswith(stripped)):
                    self.buf = stripped[len(START):] if stripped.startswith(START) else self.buf
                    self.state = "think"
                elif not stripped or START.startswith(stripped):
                    return events  # maybe "<think>" still: wait
                else:
                    self.state = "answer"
            elif self.state == "think":
                i = self.buf.find(END)
                if i < 0:
                    keep = _partial(self.buf, END)
                    self._emit("reasoning", self.buf[: len(self.buf) - keep], events)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return events
                self._emit("reasoning", self.buf[:i], events)
                self.buf = self.buf[i + len(END):]
                self.state, self.strip = "answer", True
            else:
                if self.strip:  # the newlines after </think> are not part of the answer
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        return events
                    self.strip = False
                self._emit("content", self.buf, events)
                self.buf = ""
                return events

    def finish(self) -> list[Event]:
        """The events for what is held back at the end (an unclosed thought stays thought)."""
        events: list[Event] = []
        if self.strip:
            self.buf = self.buf.lstrip("\n")
        if self.buf:
            kind = "reasoning" if self.state == "think" or (self.state == "start" and self.opens_in_thought) \
                else "content"
            self._emit(kind, self.buf, events)
            self.buf = ""
        return events

    def _emit(self, kind: str, text: str, events: list) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        kind_of = Thought if kind == "reasoning" else Text
        if events and type(events[-1]) is kind_of:
            events[-1] = kind_of(self.index, events[-1].text + text)
        else:
            events.append(kind_of(self.index, text))


def split(text: str, style: str) -> tuple[str, str]:
    """(thought, answer) of a whole text."""
    p = ReasoningParser(style)
    p.feed(text)
    p.finish()
    return p.reasoning, p.content


class StreamSplitter:
    """One completion's streamed text as every API's stream needs it: with a reasoning `style`,
    the thought apart (`Thought`); the answer as `ToolCallParser` events with tool `names`, else
    as `Text`. `feed(delta, finished)` -> the events of choice `index`, the thought's first;
    `parser` is the tool-call parser (its calls), `thinker` the reasoning parser, or None."""

    def __init__(self, style: str | None = None, names: frozenset[str] | None = None, index: int = 0):
        self.index = index
        self.thinker = ReasoningParser(style, index) if style else None
        self.parser = ToolCallParser(names, index) if names else None

    def feed(self, delta: str, finished: bool, cut: bool = False) -> list[Event]:
        """`cut`: the completion stopped at its token limit (a tool call it leaves open is
        dropped from `parser.calls`, `ToolCallParser.finish`; its events went out already)."""
        text, thought = delta, []
        if self.thinker is not None:
            split = self.thinker.feed(delta) + (self.thinker.finish() if finished else [])
            thought = [ev for ev in split if isinstance(ev, Thought)]
            text = "".join(ev.text for ev in split if isinstance(ev, Text))
        if self.parser is None:
            return thought + ([Text(self.index, text)] if text else [])
        return thought + self.parser.feed(text) + (self.parser.finish(cut) if finished else [])
