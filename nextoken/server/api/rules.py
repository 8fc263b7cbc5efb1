"""Rules that tie several request fields together, stated once for both the published JSON
Schema (draft 2020-12, which OpenAPI 3.1 uses) and the server's check. This module is the
machinery; each API's ``protocol`` declares its rules, and the rules every chat API shares are
`server.chat.rules`.

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

    @functools.cached_property
    def validator(self) -> Draft202012Validator:
        """`when`'s validator, made once (serializing the schema to find it cost 150 us a
        request over the 26 rules of /v1/completions)."""
        return _validator(json.dumps(self.when, sort_keys=True))


def forbid(*rules: Rule) -> dict:
    """Schema extra refusing every one of `rules`."""
    return {"not": {"anyOf": [r.when for r in rules]}}


def check(body: dict, rules: list[Rule]) -> None:
    """Raise `InvalidRequest` for the first of `rules` that `body` (a request's JSON, without
    null fields) breaks."""
    for rule in rules:
        if rule.validator.is_valid(body):
            raise InvalidRequest(rule.message, rule.field)


def matches(schema: dict, value) -> bool:
    """Whether `value` satisfies `schema` (JSON Schema 2020-12, by `jsonschema`): the rules'
    conditions are checked by the same standard the published schema states them in."""
    return _validator(json.dumps(schema, sort_keys=True)).is_valid(value)


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema_json))
