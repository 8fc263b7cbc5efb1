"""The words every API's table of inert request fields is written in: the fields of its published
request schema that change nothing on this server (each API's ``protocol`` holds its tables, its
router names them per route: `server.app.routers.published_tables`). Each request model drops
them before validation (`bodies.accept_published`), at the values that mean nothing here;
another value is a 400 naming the field and the value. The guide's table lists them
(`server.app.openapi.guide_table`, held to the tables by a test), and a test sends every
optional field of each published schema (the `openai` and `anthropic` SDKs' request types)
alone."""

from __future__ import annotations

from nextoken.bodies import Published, unset_or

CACHE = Published("prompt caching here is automatic (the prefix cache), keyed by content")
ACCOUNT = Published("an account, billing or abuse-monitoring label: this server has none")
TIER = Published("a provider's service tier or region: one server, one tier")
HINT = Published("a hint about cost or style that this server's models do not take")


def empty_or_unset(value) -> bool:
    """`Published.allows` for a field accepted absent or empty."""
    return value is None or value == [] or value == {}

LOGPROBS = Published("log-probabilities of the output", unset_or(False), "log-probabilities are not returned here")
TOP_LOGPROBS = Published("alternatives' log-probabilities", unset_or(0), "log-probabilities are not returned here")
