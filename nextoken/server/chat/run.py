"""Running a prepared chat request (`chat.core.Prepared`) on the engine, once for every API:
`run` adds it, waits for it or streams it, splits each completion into thought, answer text and
tool calls, records its metrics and log line, and logs a stream that fails. Each API renders
what comes back: a `ChatResult` (not streamed) or an async stream of typed events.

The stream, per engine step and per choice, in order::

    Thought* -> (Text | ToolCallStart | ToolCallArgs)* -> [Finish] -> Tokens

`Tokens` closes each step (its token ids and log-probabilities, for APIs that send them with
the text); `Finish` comes once per choice, in the step where it ends; `Failed` ends a stream the
engine could not finish (after the 200 went out). The split is `reasoning.StreamSplitter`'s, so
the events of a streamed answer are the parse of the whole (`result`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from nextoken.outputs import RequestOutput
from nextoken.request_options import RequestOptions
from nextoken.server.chat.events import (Choice, Event, Failed, Finish, Tokens, Usage)
from nextoken.server.chat.reasoning import StreamSplitter, split as split_reasoning
from nextoken.server.api.serving import client_of, new_request_id
from nextoken.server.chat.tools import parse as parse_tools

if TYPE_CHECKING:
    from nextoken.server.chat.core import Prepared
    from nextoken.server.api.serving import ApiServing

log = logging.getLogger("nextoken.server")


@dataclass
class ChatResult:
    """A finished request: its id, its choices, its usage, and the engine's output (metrics)."""

    request_id: str
    choices: list[Choice]
    usage: Usage
    output: RequestOutput


class EventStream:
    """The events of request `request_id` (``async for``; read once)."""

    def __init__(self, request_id: str, events: AsyncIterator[Event]):
        self.request_id, self._events = request_id, events

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events


def _finish(c, calls: list) -> str:
    return "tool_calls" if c.finish_reason == "stop" and calls else c.finish_reason


def result(out: RequestOutput, names: frozenset[str] | None, style: str | None) -> ChatResult:
    """A finished output split for the answer: each completion's thought (reasoning `style`),
    answer text and tool calls (tool `names`; a call cut by the token limit is dropped)."""
    choices = []
    for c in out.outputs:
        thought, text = split_reasoning(c.text, style) if style else ("", c.text)
        calls = []
        if names:
            parsed = parse_tools(text, names, c.finish_reason == "length")
            text, calls = parsed.content, parsed.calls
        choices.append(Choice(c.index, thought, text, calls, _finish(c, calls), c.stop_reason, c.token_ids,
                              c.logprobs))
    return ChatResult(out.request_id, choices, Usage.of([out]), out)


async def run(serving: ApiServing, prepared: Prepared, request, lora=None, stream: bool = False,
              prefix: str = "chatcmpl-") -> ChatResult | EventStream:
    """`prepared` into the engine of `serving` (its `EngineClient`) as request `new_request_id`
    (with LoRA adapter `lora`); the `ChatResult` when it ends, or with `stream` the async stream
    of events. Not streamed, a client that hangs up aborts it (`serving.collect`)."""
    eng = serving.engine
    # (not streamed: the engine makes its one output when it ends, and no snapshot a step before)
    options = RequestOptions(lora_request=lora, priority=prepared.priority, cache_salt=prepared.cache_salt,
                             client=prepared.client or client_of(request), final_only=not stream)
    rid = await eng.add_request(prepared.ids, prepared.params, new_request_id(prefix, request), options)
    style = serving.args.reasoning_parser
    if stream:
        return EventStream(rid, _events(serving, rid, prepared.names, style))
    out = (await serving.collect([rid], request))[0]
    serving.record([out])
    return result(out, prepared.names, style)


async def _events(serving, rid: str, names, style) -> AsyncIterator[Event]:
    splitters: dict[int, StreamSplitter] = {}
    choices: dict[int, Choice] = {}  # the finished ones
    out = None
    try:
        async for out in serving.engine.stream(rid):
            for c in out.outputs:
                if c.index in choices:
                    continue  # ended in an earlier step
                if not c.delta and not c.delta_token_ids and not c.finished:
                    continue
                sp = splitters.setdefault(c.index, StreamSplitter(style, names, c.index))
                for event in sp.feed(c.delta, c.finished, c.finish_reason == "length"):
                    yield event
                if c.finished:
                    choices[c.index] = ch = _whole(c, sp)
                    yield Finish(c.index, ch, Usage.of([out]), out)
                yield Tokens(c.index, c.delta_token_ids, c.delta_logprobs)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - after the 200 went out: the API ends its stream with an error
        log.exception("stream failed")
        yield Failed(str(exc))
        return
    if out is not None and out.finished:
        serving.record([out])


def _whole(c, splitter: StreamSplitter) -> Choice:
    """Finished completion `c` whole, from what its splitter kept (the parsers hold the thought,
    the answer and the complete calls; without either, the answer is the engine's text)."""
    thinker, parser = splitter.thinker, splitter.parser
    text = parser.content if parser else thinker.content if thinker else c.text
    calls = list(parser.calls) if parser else []
    return Choice(c.index, thinker.reasoning if thinker else "", text, calls, _finish(c, calls), c.stop_reason,
                  c.token_ids, c.logprobs)
