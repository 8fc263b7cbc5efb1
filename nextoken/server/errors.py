"""Errors in the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``, and under
``/v1/messages`` in Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, under
``/api/`` in Ollama's, ``{"error": message}``."""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 424: "failed_dependency", 429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error"}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None,
                   path: str = "") -> JSONResponse:
    """The error body for a request to `path`: Anthropic's shape under ``/v1/messages`` (the
    field, when there is one, named in the message), OpenAI's elsewhere."""
    if path.startswith("/api/"):  # Ollama's shape
        return JSONResponse({"error": f"{param}: {message}" if param and not message.startswith(param) else message},
                            status_code=status, headers=headers)
    if path.startswith("/v1/messages"):
        text = f"{param}: {message}" if param and not message.startswith(param) else message
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "invalid_request_error"),
                                           "message": text}}
        return JSONResponse(body, status_code=status, headers=headers)
    body = {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


UNION_MEMBER = re.compile(r"^(str|int|float|bool|(list|dict)\[.*\]|(function|constrained)-.*|union:.*)$")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence (and the field) for pydantic's first complaint; never the raw dump."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # drop pydantic's union-member tags ("str", "list[int]", our "union:...") from the path
    loc = [p for p in loc if not UNION_MEMBER.match(p)]
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
