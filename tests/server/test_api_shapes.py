"""Each API's router declares its error shape, stream media type and generating routes
(`server.api.routing`); nothing else picks an API by a path prefix."""

from __future__ import annotations

import ast
from pathlib import Path

from nextoken.server.app import routers

SERVER = Path(__file__).resolve().parents[2] / "nextoken" / "server"


def test_a_path_finds_its_api_by_the_routers_own_routes():
    apis = routers.apis()
    assert apis.shape("/v1/messages").name == "AnthropicError"
    assert apis.shape("/v1/messages/count_tokens").name == "AnthropicError"
    assert apis.shape("/api/chat").name == "OllamaError" and apis.shape("/api/tags").name == "OllamaError"
    assert apis.shape("/v1/chat/completions").name == "Error"
    assert apis.shape("/v1/responses/resp_123").name == "Error"  # a route with a path parameter
    assert apis.shape("/api/nothing-here").name == "OllamaError"  # under Ollama's prefix: its shape (ollama-js)
    assert apis.shape("/v2/nothing-here").name == "Error"  # under no API's prefix: OpenAI's shape
    assert apis.shape("/v1/messagesX").name == "Error"  # a route, not a prefix
    body = apis.shape("/v1/messages").error_body(400, "must be positive", "max_tokens")
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": "max_tokens: must be positive"}}
    assert apis.shape("/api/chat").error_body(404, "model 'x' not found", None) == {"error": "model 'x' not found"}
    generating = {p: s.stream_media_type for p, s in apis.generation_paths()}
    assert generating == {"/v1/completions": "text/event-stream", "/v1/chat/completions": "text/event-stream",
                          "/v1/responses": "text/event-stream", "/v1/messages": "text/event-stream",
                          "/api/chat": "application/x-ndjson", "/api/generate": "application/x-ndjson"}
    assert not apis.is_generation("/v1/messages/count_tokens") and not apis.is_generation("/api/tags")


def test_no_module_outside_an_api_package_names_an_apis_paths():
    """The shared modules (errors, middleware, the published schema, the embedding service) hold no
    API path: the routers do."""
    for name in ("app/errors.py", "app/middleware.py", "app/openapi.py", "pooling/serving.py", "app/__init__.py",
                 "api/routing.py"):
        strings = [n.value for n in ast.walk(ast.parse((SERVER / name).read_text()))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        named = [s for s in strings if s.startswith(("/v1/messages", "/api/", "/v1/chat", "/v1/responses"))]
        assert not named, (name, named)
