"""Ollama's routes (``/api/*``): a JSON body read whatever its Content-Type (as Ollama does),
errors as ``{"error": message}``, streams as newline-delimited JSON."""

from __future__ import annotations

from fastapi import Request
from fastapi.routing import APIRoute

from nextoken.server.api import ApiRouter, ApiShape, with_field
from nextoken.server.ollama.protocol import VERSION, ChatRequest as OllamaChat, GenerateRequest as OllamaGenerate
from nextoken.server.ollama.protocol import ShowRequest as OllamaShow

SHAPE = ApiShape("OllamaError", lambda status, message, param: {"error": with_field(message, param)},
                 {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
                 stream_media_type="application/x-ndjson")


class AnyBodyAsJSON(APIRoute):
    """A route that reads its body as JSON whatever the request's Content-Type says, as Ollama
    does: ``curl URL/api/generate -d '{...}'`` (Ollama's own API docs) sends
    application/x-www-form-urlencoded."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            if request.method == "POST":
                scope = dict(request.scope)
                scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + \
                    [(b"content-type", b"application/json")]
                request = Request(scope, request.receive)
            return await handler(request)
        return route


router = ApiRouter(SHAPE, strict_content_type=False, route_class=AnyBodyAsJSON)


@router.generation_route("/api/chat")
async def ollama_chat(body: OllamaChat, request: Request):
    return await request.app.state.serving_ollama.chat(body, request)


@router.generation_route("/api/generate")
async def ollama_generate(body: OllamaGenerate, request: Request):
    return await request.app.state.serving_ollama.generate(body, request)


@router.get("/api/tags")
async def ollama_tags(request: Request):
    return request.app.state.serving_ollama.tags()


@router.get("/api/ps")
async def ollama_ps(request: Request):
    return request.app.state.serving_ollama.ps()


@router.post("/api/show")
async def ollama_show(body: OllamaShow, request: Request):
    return request.app.state.serving_ollama.show(body)


@router.get("/api/version")
async def ollama_version():
    return {"version": VERSION}
