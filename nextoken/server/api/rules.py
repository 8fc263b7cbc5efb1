"""The request rules that tie several fields together: one table, from which both the
published JSON Schema (draft 2020-12, which OpenAPI 3.1 uses) and the server's check are made.

Each `Rule` is a combination the server answers with 400 (its condition as JSON Schema, the
message, the field named). `forbid` turns a list of them into ``{"not": {"anyOf": [...]}}`` for
a model's ``json_schema_extra``; `check` evaluates the same conditions on a request body
(`matches`, by the `jsonschema` package) and raises the first rule's error.
tests/server/test_openapi_contract.py holds the server to its schema with a schema-driven fuzzer.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from itertools import combinations

from jsonschema import Draft202012Validator

from nextoken.errors import InvalidRequest

NOT_NULL = {"not": {"type": "null"}}


def given(field: str) -> dict:
    """`field` is present and not null."""
    return {"required": [field], "properties": {field: NOT_NULL}}


def true(field: str) -> dict:
    """`field` is ``true``."""
    return {"required": [field], "properties": {field: {"const": True}}}


def non_empty(field: str) -> dict:
    """`field` is a non-empty array."""
    return {"required": [field], "properties": {field: {"type": "array", "minItems": 1}}}


def one_of_values(field: str, values: list) -> dict:
    """`field` is one of `values`."""
    return {"required": [field], "properties": {field: {"enum": values}}}


def all_of(*conds: dict) -> dict:
    return {"allOf": list(conds)}


def any_of(*conds: dict) -> dict:
    return {"anyOf": list(conds)}


@dataclass(frozen=True)
class Rule:
    """A combination of fields refused with a 400: `when` (JSON Schema: the body breaks the rule
    when it matches), the `message` and the `field` the error names."""

    when: dict
    message: str
    field: str


def forbid(*rules: Rule) -> dict:
    """Schema extra refusing every one of `rules`."""
    return {"not": {"anyOf": [r.when for r in rules]}}


def check(body: dict, rules: list[Rule]) -> None:
    """Raise `InvalidRequest` for the first of `rules` that `body` (a request's JSON, without
    null fields) breaks."""
    for rule in rules:
        if matches(rule.when, body):
            raise InvalidRequest(rule.message, rule.field)


def matches(schema: dict, value) -> bool:
    """Whether `value` satisfies `schema` (JSON Schema 2020-12, by `jsonschema`): the rules'
    conditions are checked by the same standard the published schema states them in."""
    return _validator(json.dumps(schema, sort_keys=True)).is_valid(value)


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema_json))


# one output constraint at most (`_Sampling.structured`); response_format counts when it asks for JSON
JSON_FORMAT = {"required": ["response_format"],
               "properties": {"response_format": {"type": "object", "required": ["type"],
                                                  "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
CONSTRAINTS = [given("guided_json"), given("guided_regex"), given("guided_choice"), given("guided_grammar"),
               given("structured_outputs"), JSON_FORMAT]
CONSTRAINED = any_of(*CONSTRAINTS)
FORCING_CHOICE = {"anyOf": [{"const": "required"}, {"type": "object"}]}  # OpenAI's tool_choice that forces a call


CONSTRAINT_NAMES = ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                    "response_format"]


# /v1/responses: log-probabilities are not returned beside MCP tools (the tool rules every chat API
# shares: `server.chat.rules`)
RESPONSES_RULES = [
    Rule({"required": ["include", "tools"], "properties": {
        "include": {"type": "array", "contains": {"const": "message.output_text.logprobs"}},
        "tools": {"type": "array", "contains": {"type": "object", "required": ["type"],
                                                "properties": {"type": {"const": "mcp"}}}}}},
         "message.output_text.logprobs is not supported with MCP tools", "include")]


def sampling_rules(chat: bool) -> list[Rule]:
    """The refused combinations of /v1/completions (`chat` False) or /v1/chat/completions (but
    the tool rules every chat API shares: `server.chat.rules`)."""
    beam = true("use_beam_search")
    named = list(zip(CONSTRAINT_NAMES, CONSTRAINTS))
    rules = [Rule(all_of(a, b), f"give one output constraint, not {x} and {y}", y)
             for (x, a), (y, b) in combinations(named, 2)]
    rules += [Rule(all_of(cond, beam), f"{name} cannot be combined with use_beam_search", name) for name, cond in named]
    rules += [Rule(all_of(CONSTRAINED, true("ignore_eos")), "structured output cannot be combined with ignore_eos "
                   "(the grammar ends the output with an end-of-generation token)", "ignore_eos"),
              Rule(all_of(beam, true("stream")), "use_beam_search cannot stream", "stream")]
    if chat:
        rules += [Rule(all_of(given("top_logprobs"), {"not": true("logprobs")}), "top_logprobs needs logprobs to be "
                       "true", "top_logprobs"),
                  Rule(all_of(beam, true("logprobs")), "use_beam_search does not return logprobs", "use_beam_search"),
                  Rule(all_of(beam, non_empty("tools")), "tools cannot be combined with use_beam_search", "tools")]
    else:
        score_only = {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}}
        rules += [Rule(all_of(beam, any_of(given("logprobs"), true("echo"), given("prompt_logprobs"))),
                       "use_beam_search does not return logprobs or echo the prompt", "use_beam_search"),
                  Rule(all_of(score_only, {"not": true("echo")}), "max_tokens 0 scores the prompt without "
                       "generating and needs echo (with logprobs for the scores)", "max_tokens"),
                  Rule(all_of(score_only, {"required": ["n"], "properties": {"n": {"not": {"const": 1}}}}),
                       "max_tokens 0 scores the prompt once: n must be 1", "n")]
    return rules


# structured_outputs: exactly one kind (`StructuredOutputsParams.kind`)
STRUCTURED_ONE = {"oneOf": [given("json"), given("regex"), given("choice"), given("grammar"), true("json_object")]}
# response_format of type json_schema carries its schema
JSON_SCHEMA_NEEDS_SCHEMA = {"if": one_of_values("type", ["json_schema"]), "then": given("json_schema")}
