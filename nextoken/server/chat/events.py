"""The chat core's typed events and results, shared by the parsers that make them
(`tools.ToolCallParser`, `reasoning.ReasoningParser`), the run that streams them (`chat.run`)
and every API's renderer.

Per engine step and per choice, in order::

    Thought* -> (Text | ToolCallStart | ToolCallArgs)* -> [Finish] -> Tokens

`Failed` ends a stream the engine could not finish (after the 200 went out).
"""

from __future__ import annotations

import uuid

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from nextoken.outputs import RequestOutput


@dataclass
class ToolCallOut:
    """One tool call of an answer (`tools.ToolCallParser` makes them): the function's name, its
    arguments as JSON text, its id."""

    name: str
    arguments: str = ""
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class Usage:
    """Tokens of a request: its prompt, its completions (all choices), the prompt's tokens found
    in the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @classmethod
    def of(cls, outs: list["RequestOutput"]) -> "Usage":
        return cls(sum(len(o.prompt_token_ids) for o in outs),
                   sum(len(c.token_ids) for o in outs for c in o.outputs),
                   sum(o.metrics.num_cached_tokens for o in outs))


@dataclass
class Choice:
    """One completion, split: `thought` (with a reasoning parser), `text` (the answer without
    its tool calls), `calls` (complete calls only), `finish` ("stop", "length" or "tool_calls":
    a stop with calls), `stop_reason` (the stop string or token that ended it), its tokens and
    their log-probabilities (when asked)."""

    index: int
    thought: str = ""
    text: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)
    finish: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None


@dataclass(frozen=True)
class Thought:
    index: int
    text: str


@dataclass(frozen=True)
class Text:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """Call number `call` of choice `index` begins: its id and function name."""
    index: int
    call: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """A piece of the JSON text of call `call`'s arguments."""
    index: int
    call: int
    text: str


@dataclass(frozen=True)
class Finish:
    """Choice `index` ended: `choice` holds it whole; `usage` is the request's so far (all its
    choices when the last one ends); `output` the engine's output of that step."""
    index: int
    choice: Choice
    usage: Usage
    output: RequestOutput

    @property
    def reason(self) -> str:
        return self.choice.finish


@dataclass(frozen=True)
class Tokens:
    """The tokens of one step of choice `index` and their log-probabilities (None unless asked)."""
    index: int
    token_ids: list[int]
    logprobs: list[dict] | None


@dataclass(frozen=True)
class Failed:
    """The engine failed after the answer began (logged here; the API says so in its stream)."""
    message: str


Event = Union[Thought, Text, ToolCallStart, ToolCallArgs, Finish, Tokens, Failed]
