"""The base of every HTTP request body (the OpenAI-compatible API and the inspector): pydantic
models that refuse unknown fields and type coercions, so the server accepts exactly what its
OpenAPI schema allows, and the marks for limits known only once a model is loaded.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
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


def model_limit(name: str) -> dict:
    """JSON-schema extra for a bound known once the model is loaded: "token_id" (vocab - 1),
    "layer" (layers - 1) or "context" (max_model_len - 1); see `nextoken.server.openapi`."""
    return {"x-maximum": name}


TokenId = Annotated[int, Field(ge=0, json_schema_extra=model_limit("token_id"))]
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
