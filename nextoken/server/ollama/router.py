"""Ollama's routes (``/api/*``): a JSON body read whatever its Content-Type (as Ollama does),
errors as ``{"error": message}``, streams as newline-delimited JSON."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.routing import APIRoute

from nextoken.errors import InvalidRequest
from nextoken.server.pooling import serving as emb
from nextoken.server.api.routing import ApiRouter, ApiShape, with_field
from nextoken.server.ollama.protocol import PUBLISHED_CHAT, PUBLISHED_GENERATE, VERSION, ChatRequest as OllamaChat, \
    GenerateRequest as OllamaGenerate
from nextoken.server.ollama.serving import OllamaServing
from nextoken.server.ollama.protocol import ChatAnswer, EmbedAnswer, EmbeddingAnswer, EmbeddingsRequest, EmbedRequest, \
    GenerateAnswer, ModelList, ShowAnswer, VersionAnswer, ShowRequest as OllamaShow

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


router = ApiRouter(SHAPE, "/api/", route_class=AnyBodyAsJSON)
router.servings["serving_ollama"] = OllamaServing
# the embedding routes, served beside the embedding model whether or not the server generates
embed_router = ApiRouter(SHAPE, "/api/", route_class=AnyBodyAsJSON)
router.servings["serving_ollama"] = OllamaServing


@router.generation_route("/api/chat", PUBLISHED_CHAT, response_model=ChatAnswer)
async def ollama_chat(body: OllamaChat, request: Request):
    return await request.app.state.serving_ollama.chat(body, request)


@router.generation_route("/api/generate", PUBLISHED_GENERATE, response_model=GenerateAnswer)
async def ollama_generate(body: OllamaGenerate, request: Request):
    return await request.app.state.serving_ollama.generate(body, request)


@router.get("/api/tags", response_model=ModelList)
async def ollama_tags(request: Request):
    return request.app.state.serving_ollama.tags()


@router.get("/api/ps", response_model=ModelList)
async def ollama_ps(request: Request):
    return request.app.state.serving_ollama.ps()


@router.post("/api/show", response_model=ShowAnswer)
async def ollama_show(body: OllamaShow, request: Request):
    return request.app.state.serving_ollama.show(body)


@router.get("/api/version", response_model=VersionAnswer)
async def ollama_version():
    return {"version": VERSION}


@embed_router.post("/api/embed", response_model=EmbedAnswer)
async def ollama_embed(body: EmbedRequest, request: Request):
    """Vectors for `input` from the server's embedding model (`server.pooling`), in Ollama's
    answer: ``embeddings``, ``prompt_eval_count`` and durations in nanoseconds."""
    start = time.perf_counter_ns()
    service = emb.embedding_service(request)
    name = emb.model_name(request)
    emb.check_model(request, body.model.removesuffix(":latest"))
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    if not inputs:
        raise InvalidRequest("input is empty: give a string or a list of strings", "input")
    if body.dimensions is not None:
        service.model.check_dimensions(body.dimensions)
    out = await service.embed(inputs, truncate=body.truncate)
    vectors = service.model.cut(out.vectors, body.dimensions)
    return {"model": name, "embeddings": vectors.tolist(), "total_duration": time.perf_counter_ns() - start,
            "load_duration": 0, "prompt_eval_count": sum(out.num_tokens)}


@embed_router.post("/api/embeddings", response_model=EmbeddingAnswer)
async def ollama_embeddings(body: EmbeddingsRequest, request: Request):
    """Ollama's older route: one `prompt`, ``{"embedding": [...]}``."""
    service = emb.embedding_service(request)
    emb.check_model(request, body.model.removesuffix(":latest"))
    out = await service.embed([body.prompt], truncate=True)
    return {"embedding": out.vectors[0].tolist()}
