"""What each API declares about itself, so nothing else picks an API by its path: its error
body (and the body's schema), the media type of its streams, and which of its routes generate
(`ApiRouter.generation`: they stream, wait in the queue, and need a generation model).

    ApiShape (error_body, error_schema, stream_media_type)
    ApiRouter(shape)  -- an API's routes; ``@router.generation_route(path)`` marks a generating one
    Apis(routers)     -- the app's: `shape(path)` and `is_generation(path)` by the routes' own
                         path patterns (a path no API router serves answers in OpenAI's shape)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fastapi import APIRouter

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 424: "failed_dependency", 429: "rate_limit_error", 503: "service_unavailable",
         500: "server_error"}


@dataclass(frozen=True)
class ApiShape:
    """name: the error schema's component name; error_body(status, message, param) -> the JSON
    body of an error; error_schema: that body's JSON schema; stream_media_type: what
    ``"stream": true`` answers."""

    name: str
    error_body: Callable[[int, str, str | None], dict]
    error_schema: dict
    stream_media_type: str = "text/event-stream"


def _openai_error(status: int, message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": status}}


OPENAI = ApiShape("Error", _openai_error, {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "integer"}}}}})


def with_field(message: str, param: str | None) -> str:
    """`message` led by the field it is about (for APIs whose errors have no field of their own)."""
    return f"{param}: {message}" if param and not message.startswith(param) else message


class ApiRouter(APIRouter):
    """One API's routes and its `shape`; `generation` holds the paths of its generating routes,
    `published` their inert request fields, `servings` the serving classes the app makes for it
    (``app.state`` name -> class: `server.app.build_app` iterates the routers)."""

    def __init__(self, shape: ApiShape = OPENAI, prefix_of_paths: str = "", **kwargs):
        super().__init__(**kwargs)
        self.shape = shape
        self.prefix_of_paths = prefix_of_paths  # every path under it is this API's (errors in its shape)
        self.generation: set[str] = set()
        self.published: dict[str, dict] = {}  # "POST /path" -> its fields published but inert (`bodies.Published`)
        self.servings: dict[str, type] = {}  # ``app.state`` name -> the serving class its routes call

    def add_api_route(self, path: str, endpoint, **kwargs):
        """Every route with a declared answer (``response_model``, a `bodies.Answer`) answers the
        fields its renderer set: one left out stays out rather than becoming a null."""
        if kwargs.get("response_model") is not None:
            kwargs["response_model_exclude_unset"] = True
        super().add_api_route(path, endpoint, **kwargs)

    def generation_route(self, path: str, published: dict | None = None, **kwargs):
        """``@router.post(path)`` for a route that generates (streams, queues, needs the model);
        `published`: its request's fields that change nothing here (the guide lists them)."""
        self.generation.add(path)
        if published:
            self.published[f"POST {path}"] = published
        return self.post(path, **kwargs)


class Apis:
    """The app's API routers (`ApiRouter`), looked up by a request's path."""

    def __init__(self, routers: list[ApiRouter]):
        self.routers = routers

    def _router(self, path: str) -> ApiRouter | None:
        for router in self.routers:
            if any(r.path_regex.match(path) for r in router.routes):
                return router
        return None

    def serves(self, path: str) -> bool:
        """Whether one of the API routers has a route for `path`."""
        return self._router(path) is not None

    def shape(self, path: str) -> ApiShape:
        """The error shape of `path`: its router's; for a path no router serves, the shape of the
        API whose prefix it has (a 404 under ``/api/`` in Ollama's shape, which ollama-js prints;
        OpenAI's shape printed there as ``[object Object]``), else OpenAI's."""
        router = self._router(path)
        if router is None:
            router = next((r for r in self.routers if r.prefix_of_paths and path.startswith(r.prefix_of_paths)), None)
        return router.shape if router is not None else OPENAI

    def generation_paths(self) -> list[tuple[str, ApiShape]]:
        return [(p, r.shape) for r in self.routers for p in sorted(r.generation)]

    def is_generation(self, path: str) -> bool:
        return any(p == path for r in self.routers for p in r.generation)
