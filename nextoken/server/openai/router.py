"""OpenAI's generation routes (completions, chat completions, responses and the stored
responses), in OpenAI's error shape, streaming server-sent events."""

from __future__ import annotations

from typing import Union

from fastapi import Request

from nextoken.server.api.routing import OPENAI, ApiRouter
from nextoken.server.openai.chat import OpenAIServingChat
from nextoken.server.openai.completions import OpenAIServingCompletion
from nextoken.server.openai.protocol import PUBLISHED_CHAT, ChatCompletion, ChatCompletionRequest, Completion, \
    CompletionRequest, ResponseDeleted, ResponseObject
from nextoken.server.openai.responses import PUBLISHED as PUBLISHED_RESPONSES, OpenAIServingResponses, \
    ResponsesRequest

router = ApiRouter(OPENAI)
router.servings.update(serving_completion=OpenAIServingCompletion, serving_chat=OpenAIServingChat,
                       serving_responses=OpenAIServingResponses)


@router.generation_route("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request):
    return await request.app.state.serving_completion.create(body, request)


@router.generation_route("/v1/chat/completions", PUBLISHED_CHAT, response_model=ChatCompletion)
async def chat(body: ChatCompletionRequest, request: Request):
    return await request.app.state.serving_chat.create(body, request)


@router.generation_route("/v1/responses", PUBLISHED_RESPONSES, response_model=ResponseObject)
async def create_response(body: ResponsesRequest, request: Request):
    return await request.app.state.serving_responses.create(body, request)


@router.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"],
                  response_model=Union[ResponseObject, ResponseDeleted])
async def stored_response(response_id: str, request: Request):
    """GET: a stored response; DELETE: forget it. (One route for both, so a 405 lists both.)"""
    store = request.app.state.serving_responses.store
    if request.method == "DELETE":
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
    return store.get(response_id)[0]
