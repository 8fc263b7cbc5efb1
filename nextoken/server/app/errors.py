"""Error responses in the shape of the API a request is for (each API's router declares it:
`api.ApiShape`), and one readable sentence for pydantic's complaint about a body."""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from nextoken.server.api.routing import OPENAI, ApiShape

def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None,
                   shape: ApiShape = OPENAI) -> JSONResponse:
    """The error body of the API `shape` (`api.ApiShape`; the app's `Apis` names the shape of a
    request's path), OpenAI's by default."""
    return JSONResponse(shape.error_body(status, message, param), status_code=status, headers=headers)


UNION_MEMBER = re.compile(r"^(str|int|float|bool|(list|dict)\[.*\]|(function|constrained)-.*|union:.*)$")


def _path(err: dict) -> list[str]:
    """An error's location without "body" and pydantic's union-member tags ("str", "list[int]",
    our "union:...")."""
    return [str(p) for p in err.get("loc", ()) if p != "body" and not UNION_MEMBER.match(str(p))]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence (and the field) for pydantic's complaint; never the raw dump. Of
    several (a value that fits no member of a union), the deepest: the member the value's shape
    chose (a list of blocks with a bad block, not "should be a valid string")."""
    err, loc = max(((e, _path(e)) for e in exc.errors()), key=lambda el: len(el[1]))  # (max: the first of equals)
    if loc and loc[-1] == "[key]":  # a dict key (logit_bias): the field is the dict, the key is the value
        loc = loc[:-2]
    field = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if kind == "extra_forbidden":
        return f"unsupported parameter {field!r}", field
    if kind == "missing":
        return f"missing required parameter {field!r}", field
    if kind in ("model_attributes_type", "model_type", "dict_type") and not field:
        return "the request body must be a JSON object", None
    got = err.get("input")
    if kind == "unsupported_field_value":  # a published field at a value not honoured (`bodies.Published`)
        ctx = err.get("ctx") or {}
        return err["msg"], ".".join([*loc, ctx["field"]]) if "field" in ctx else field
    if kind == "unsupported_value":  # a switch accepted at one value only (`nextoken.bodies.only`)
        return f"{field} {err['msg']}", field
    got_s = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if len(got_s) > 60:
        got_s = got_s[:57] + "..."
    return f"{field}: {err.get('msg', 'invalid value')} (got {got_s})", field
