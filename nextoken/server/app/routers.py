"""The API routers a generation server serves, each from its API's package: OpenAI's
(completions, chat, responses), Anthropic's (messages) and Ollama's (``/api/*``). Each declares
its error shape, its streams' media type, its generating routes with their inert request fields,
and its serving classes (`server.api.routing.ApiRouter`)."""

from __future__ import annotations

from nextoken.server.anthropic.router import router as anthropic
from nextoken.server.api.routing import Apis
from nextoken.server.ollama.router import embed_router as ollama_embed, router as ollama
from nextoken.server.openai.router import router as openai

API_ROUTERS = (openai, anthropic, ollama)


def apis() -> Apis:
    return Apis([*API_ROUTERS, ollama_embed])


def published_tables() -> dict[str, dict]:
    """Each generating route's inert request fields ("POST /path" -> `bodies.Published` table),
    as its router declares them."""
    return {route: table for router in API_ROUTERS for route, table in router.published.items()}
