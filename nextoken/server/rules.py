"""The request rules that tie several fields together, written as JSON Schema (draft 2020-12,
which OpenAPI 3.1 uses) so that the published schema refuses what the server refuses.

Each rule is a combination the server answers with 400; `forbid` turns a list of them into
``{"not": {"anyOf": [...]}}`` for a model's ``json_schema_extra``. The server keeps its own
checks (with messages that name the fields); tests/test_openapi_contract.py holds the two to
each other with a schema-driven fuzzer.
"""

from __future__ import annotations

from itertools import combinations

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


def forbid(*combos: dict) -> dict:
    """Schema extra refusing every one of `combos`."""
    return {"not": {"anyOf": list(combos)}}


# one output constraint at most (`_Sampling.structured`); response_format counts when it asks for JSON
JSON_FORMAT = {"required": ["response_format"],
               "properties": {"response_format": {"type": "object", "required": ["type"],
                                                  "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
CONSTRAINTS = [given("guided_json"), given("guided_regex"), given("guided_choice"), given("guided_grammar"),
               given("structured_outputs"), JSON_FORMAT]
CONSTRAINED = any_of(*CONSTRAINTS)
FORCED_TOOL = all_of(non_empty("tools"), {"required": ["tool_choice"], "properties": {
    "tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}})


def sampling_rules(chat: bool) -> list[dict]:
    """The forbidden combinations of /v1/completions (`chat` False) or /v1/chat/completions."""
    beam = true("use_beam_search")
    rules = [all_of(a, b) for a, b in combinations(CONSTRAINTS, 2)]
    rules += [all_of(CONSTRAINED, beam), all_of(CONSTRAINED, true("ignore_eos")), all_of(beam, true("stream"))]
    if chat:
        rules += [all_of(beam, true("logprobs")), all_of(beam, non_empty("tools")),
                  all_of(FORCED_TOOL, CONSTRAINED),
                  # tool_choice other than "none" needs tools
                  all_of({"not": non_empty("tools")}, given("tool_choice"),
                         {"not": one_of_values("tool_choice", ["none"])})]
    else:
        rules += [all_of(beam, any_of(given("logprobs"), true("echo"), given("prompt_logprobs")))]
    return rules


# structured_outputs: exactly one kind (`StructuredOutputsParams.kind`)
STRUCTURED_ONE = {"oneOf": [given("json"), given("regex"), given("choice"), given("grammar"), true("json_object")]}
# response_format of type json_schema carries its schema
JSON_SCHEMA_NEEDS_SCHEMA = {"if": one_of_values("type", ["json_schema"]), "then": given("json_schema")}
