"""The strict base of every HTTP request body (every API and the inspector).

Pydantic models that refuse unknown fields and type coercions, so the server accepts exactly what
its OpenAPI schema allows, and the marks for limits known only once a model is loaded.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

BODY = ConfigDict(extra="forbid", strict=True)
SEED_LIMIT = 2**53 - 1  # seeds within +-(2^53 - 1): exact as JSON numbers in every client and validator


def _integral(v):
    return int(v) if isinstance(v, float) and v.is_integer() else [_integral(x) for x in v] if isinstance(v, list) else v


class Body(BaseModel):
    """A request body: unknown fields and type coercions refused (`BODY`), except that a number
    with no fraction (``2.0``) is an integer, as in JSON Schema."""

    model_config = BODY

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data):
        if isinstance(data, dict):
            return {k: _integral(v) for k, v in data.items()}
        return data


class Answer(BaseModel):
    """An answer's body (a 200, or one event of a stream), declared so that the published schema
    states it and a route's ``response_model`` checks what the server sends: a field the model
    does not declare is an error, not dropped. Optional fields have defaults; a route answers with
    the fields its renderer set (``response_model_exclude_unset``)."""

    model_config = ConfigDict(extra="forbid")


UNION_TAG = "union:"  # prefix of the member tags in validation errors' locations (dropped from messages)


def by_field(field: str, members: dict[str, type]) -> Any:
    """A body that is one of `members`, chosen by the value of its `field` (a message by its
    role): the schema is their ``oneOf``; a value of no member is one error naming the field and
    the values it takes, and the member's tag stays out of error paths (`UNION_TAG`)."""
    def pick(v):
        value = v.get(field) if isinstance(v, dict) else getattr(v, field, None)
        return UNION_TAG + value if isinstance(value, str) and value in members else None
    allowed = ", ".join(repr(k) for k in members)
    return Annotated[Union[tuple(Annotated[m, Tag(UNION_TAG + k)] for k, m in members.items())],
                     Discriminator(pick, custom_error_type="union_member",
                                   custom_error_message=f"{field} must be one of {allowed}")]


def model_limit(name: str) -> dict:
    """JSON-schema extra for a bound known once the model is loaded: "token_id" (vocab - 1),
    "layer" (layers - 1), "head" (query heads - 1), "context" (max_model_len - 1) or
    "logprobs" (the engine's max_logprobs); see `nextoken.server.app.openapi`. The engine
    refuses a value past it."""
    return {"x-maximum": name}


TokenId = Annotated[int, Field(ge=0, json_schema_extra=model_limit("token_id"))]
MaxTokens = Annotated[int, Field(json_schema_extra=model_limit("context"))]  # an output bound: under the context
LogprobCount = Annotated[int, Field(ge=0, json_schema_extra=model_limit("logprobs"))]  # at most the engine's max_logprobs
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonEmptyStr = Annotated[str, Field(min_length=1)]



def only(value: bool):
    """A switch accepted at one value only (routers send such fields with every request): a
    strict boolean, ``const`` in the schema; the other value is a 400 "<field> true is not
    supported"."""
    def check(v: bool) -> bool:
        if v is not value:
            raise PydanticCustomError("unsupported_value", "{value} is not supported", {"value": str(v).lower()})
        return v
    return Annotated[bool, AfterValidator(check), Field(json_schema_extra={"const": value})]


class Published:
    """A field of an API's published request schema that changes nothing here, accepted (and
    dropped before validation) at the values `allows` takes; another value is a 400 naming the
    field and the value, with `why`. `note` says, in the guide's words, why it changes nothing."""

    def __init__(self, note: str, allows=lambda value: True, why: str = "not supported by this server"):
        self.note, self.allows, self.why = note, allows, why


def unset_or(*values):
    """`Published.allows` for a field accepted absent (null) or at one of `values` only."""
    return lambda value: value is None or any(value is v or (value == v and type(value) is type(v)) for v in values)


def accept_published(data, table: dict[str, Published]):
    """A body with the fields of `table` dropped (each at a value it allows); raises a
    validation error ``unsupported_field_value`` naming the field and value otherwise."""
    if not isinstance(data, dict) or not any(k in data for k in table):
        return data
    for key, value in data.items():
        if key in table and not table[key].allows(value):
            shown = json.dumps(value) if not isinstance(value, (dict, list)) else "an object" if isinstance(value, dict) \
                else json.dumps(value)[:60]
            raise PydanticCustomError("unsupported_field_value", "{field} {value} is not supported: {why}",
                                      {"field": key, "value": shown[:60], "why": table[key].why})
    return {k: v for k, v in data.items() if k not in table}
