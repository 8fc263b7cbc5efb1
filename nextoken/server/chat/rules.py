"""The rules every chat API shares, declared once: each is evaluated on the chat core's `ChatSpec`
(`check`, in `core.prepare`, its error naming the request's own field), and published in each
API's request schema in that API's own field names (`published`, with the API's `ChatFields`).
Rules of one API alone stay in its protocol (`server.api.rules`).

    a forcing tool_choice ("required", a named tool) needs tools
    a forced tool call excludes another output constraint (a JSON format, a regex, a grammar)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from nextoken.errors import InvalidRequest
from nextoken.server.api.rules import Rule, all_of, any_of, non_empty

Spec = Any  # a `chat.core.ChatSpec` (core imports this module, so not imported here)


@dataclass(frozen=True)
class ChatFields:
    """An API's names for what the chat rules read: its tools and tool_choice fields, the JSON
    Schema of a tool_choice value that forces a call, and the conditions under which its body
    asks for an output constraint (none: the API has no such field)."""

    forcing: dict
    tools: str = "tools"
    tool_choice: str = "tool_choice"
    constraints: tuple[dict, ...] = ()

    def forced(self) -> dict:
        return {"required": [self.tool_choice], "properties": {self.tool_choice: self.forcing}}


@dataclass(frozen=True)
class ChatRule:
    """A combination every chat API refuses: `breaks` (on the `ChatSpec`), its `message`, the
    `field` it names (the spec's neutral name), and `when`, its condition as JSON Schema in an
    API's names (None where the API cannot break it)."""

    breaks: Callable[[Spec], bool]
    message: Callable[[Spec], str]
    field: str
    when: Callable[[ChatFields], dict | None]


def _forcing(spec: Spec) -> bool:
    return spec.tool_choice not in (None, "auto", "none")


CHAT_RULES = (
    ChatRule(lambda s: _forcing(s) and not s.tools,
             lambda s: f"{s.name('tool_choice')} needs tools: {s.tool_choice!r} forces a call",
             "tool_choice", lambda f: all_of({"not": non_empty(f.tools)}, f.forced())),
    ChatRule(lambda s: _forcing(s) and bool(s.tools) and s.constraint is not None and s.prompt_ids is None,
             lambda s: f"a forced tool call cannot be combined with {s.name('constraint')}", "tool_choice",
             lambda f: all_of(non_empty(f.tools), f.forced(), any_of(*f.constraints)) if f.constraints else None),
)


def check(spec: Spec) -> None:
    """Raise `InvalidRequest` for the first chat rule `spec` breaks, naming the request's field."""
    for rule in CHAT_RULES:
        if rule.breaks(spec):
            raise InvalidRequest(rule.message(spec), spec.name(rule.field))


def published(fields: ChatFields) -> list[Rule]:
    """The chat rules as an API publishes them (for `api.rules.forbid`), in its `fields`' names;
    the server checks them on the `ChatSpec` (`check`), not on the body."""
    return [Rule(when, "", fields.tool_choice) for r in CHAT_RULES if (when := r.when(fields)) is not None]
