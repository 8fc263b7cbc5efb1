"""What the app (`server.app.build_app`, one for every model: generation, embeddings or both) puts
in front of its routes: the body limit, the API key and draining gate (ASGI middleware), and the
error handlers that give every error its API's shape."""

from __future__ import annotations

import hmac
import logging
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nextoken.errors import EngineError, InvalidRequest, RequestFailed
from nextoken.server.api.routing import Apis
from nextoken.server.args import ServerArgs
from nextoken.server.app.errors import error_response, validation_message
from nextoken.server.api.serving import ClientGone, QueueFull, valid_request_id

log = logging.getLogger("nextoken.server")


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes (declared or streamed), in the shape
    of the path's API (`apis`: the app's `api.Apis`)."""

    def __init__(self, app, limit: int, apis: Apis):
        self.app, self.limit, self.apis = app, limit, apis

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit, self.apis.shape(route_path(scope)))(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge()
            return msg

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await _too_large(self.limit, self.apis.shape(route_path(scope)))(scope, receive, send)


class RequestIdHeader:
    """ASGI middleware (``--enable-request-id-headers``, vLLM's): every HTTP answer carries
    ``X-Request-Id``, the client's own (`valid_request_id`) or a new one, which the request's
    engine id takes too (`server.api.serving.new_request_id`, through the scope's state)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        rid = valid_request_id(given.decode("latin-1") if given is not None else None) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class Gate:
    """ASGI middleware: the API key (every route but /health), 503 while draining or loading.

    A pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one wraps ``receive``
    so that ``request.is_disconnected()`` never sees the client hang up."""

    def __init__(self, app, state, config: ServerArgs, apis: Apis):
        self.app, self.state, self.config, self.apis = app, state, config, apis
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key is not None else None

    async def __call__(self, scope, receive, send):
        # open: /health, and the inspector's static files (code and styles, no data: a browser
        # loads them without the key; the page and every /inspect/api route need it)
        path = route_path(scope) if scope["type"] == "http" else ""
        if path and path != "/health" and not path.startswith("/inspect/static/"):
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope):
        path = route_path(scope)
        shape = self.apis.shape(path)
        if self.expected is not None:
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if not given and b"x-api-key" in headers:  # Anthropic's header, the same key
                given = b"Bearer " + headers[b"x-api-key"]
            if path.startswith("/inspect") and not given:  # a browser page and its event stream: ?key=KEY
                given = b"Bearer " + _query_key(scope)
            if not hmac.compare_digest(given, self.expected):
                return error_response(401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY"
                                           + (", or ?key=KEY on /inspect)" if path.startswith("/inspect") else ")"),
                                      shape=shape)
        if self.state.draining:
            return error_response(503, "the server is shutting down", shape=shape)
        if not self.state.ready and (self.apis.serves(path) or path.startswith(("/v1", "/inspect/api"))):
            return error_response(503, "the model is still loading", shape=shape)
        return None


def route_path(scope) -> str:
    """The request's path within the app: uvicorn's ``path`` holds the root path (--root-path,
    the ASGI spec's ``root_path``) before it, which the routes do not."""
    path, root = scope["path"], scope.get("root_path") or ""
    return path[len(root):] or "/" if root and path.startswith(root) else path


def _query_key(scope) -> bytes:
    from urllib.parse import parse_qs

    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", [])
    return values[0].encode("latin-1") if values else b""


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int, shape):
    return error_response(413, f"the request body is larger than {limit} bytes", shape=shape)


def _shape(req):
    return req.app.state.apis.shape(req.url.path)


def exception_handlers(app: FastAPI, args: ServerArgs) -> None:
    """Every error in its API's shape (``app.state.apis``, an `api.Apis`, names it by path): a client's
    mistake a 4xx naming the field, a fault of the request's own a 500, the engine gone a 503;
    never a traceback."""

    @app.exception_handler(RequestValidationError)
    async def _validation(req, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return error_response(400, msg, param, shape=_shape(req))

    @app.exception_handler(InvalidRequest)
    async def _invalid(req, exc: InvalidRequest):
        return error_response(exc.status, str(exc), exc.field, shape=_shape(req))

    @app.exception_handler(StarletteHTTPException)
    async def _http(req, exc: StarletteHTTPException):  # 404, 405 (with its Allow header), ...
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None),
                              shape=_shape(req))

    @app.exception_handler(Exception)
    async def _internal(req, exc: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}", shape=_shape(req))

    @app.exception_handler(ClientGone)
    async def _client_gone(_, exc):  # nobody reads this answer; its requests are aborted
        return Response(status_code=499)

    @app.exception_handler(QueueFull)
    async def _queue_full(req, exc):
        return error_response(429, f"too many requests waiting (limit {args.max_queued_requests}); retry later",
                              headers={"Retry-After": "1"}, shape=_shape(req))

    @app.exception_handler(EngineError)
    async def _engine_error(req, exc):
        return error_response(503, str(exc), shape=_shape(req))

    @app.exception_handler(RequestFailed)
    async def _request_failed(req, exc):  # this request's fault in the model: the server stays up
        return error_response(exc.status, str(exc), shape=_shape(req))
