"""Anthropic's routes (``/v1/messages``, ``/v1/messages/count_tokens``) and its error shape,
``{"type": "error", "error": {"type", "message"}}`` (the field, when there is one, named in the
message)."""

from __future__ import annotations

from fastapi import Request

from nextoken.server.anthropic.protocol import PUBLISHED, CountTokensRequest, MessageAnswer, MessagesRequest, TokenCount
from nextoken.server.anthropic.serving import AnthropicServingMessages
from nextoken.server.api.routing import ApiRouter, ApiShape, with_field

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
         503: "overloaded_error"}


def error_body(status: int, message: str, param: str | None) -> dict:
    return {"type": "error", "error": {"type": TYPES.get(status, "invalid_request_error"),
                                       "message": with_field(message, param)}}


SHAPE = ApiShape("AnthropicError", error_body, {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}})
router = ApiRouter(SHAPE)
router.servings["serving_messages"] = AnthropicServingMessages


@router.generation_route("/v1/messages", PUBLISHED, response_model=MessageAnswer)
async def messages(body: MessagesRequest, request: Request):
    return await request.app.state.serving_messages.create(body, request)


@router.post("/v1/messages/count_tokens", response_model=TokenCount)
async def count_tokens(body: CountTokensRequest, request: Request):
    return await request.app.state.serving_messages.count_tokens(body)
