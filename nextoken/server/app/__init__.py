"""The FastAPI app, one for every model: the generation APIs (OpenAI's, Anthropic's, Ollama's) over
the shared `AsyncLLMEngine`, and/or the pooling routes over the `EmbeddingService`.

    build_app(state, ServerArgs) -> middleware (`middleware`: API key and draining gate, body
                                      limit; CORS)
                                  + error handlers (`errors`) + the routes of no one API
                                    (`routes`: info, tokens) + each API's router and serving
                                    classes (`routers`) + the inspector's routes
                                  + the published schema (`openapi`), /metrics (`metrics`)

Every request streams from the one shared engine. A client's mistake is a 4xx in its API's error
shape (`server.api.routing.ApiShape`) naming the field, never a 500; a client that disconnects
has its request aborted (its KV blocks freed) within a step.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from nextoken.server.app import routers, routes
from nextoken.server.pooling import router as pooling
from nextoken.server.pooling.serving import EmbeddingCollector
from nextoken.errors import InvalidRequest
from nextoken.server.args import ServerArgs
from nextoken.engine.stats import SchedulerStats
from nextoken.server.app.metrics import ServerMetrics
from nextoken.server.app.openapi import document_errors, model_limits
from nextoken.server.api.state import Capabilities, ServerState
from nextoken.server.app.middleware import BodyLimit, Gate, RequestIdHeader, exception_handlers

log = logging.getLogger("nextoken.server")


def build_app(state: ServerState, args: ServerArgs, lifespan=None,
              capabilities: Capabilities = Capabilities()) -> FastAPI:
    """The one app, for every model: `state` (a `ServerState`: the generation engine and/or the
    embedding service, None while loading), `args` (``args.model_name`` set), `capabilities`:
    what it serves. Generation: every API's router (each generating route answers 400 naming the
    reason on an embedding-only server), the inspector; embeddings: ``/v1/embeddings``,
    ``/v1/score``, ``/v1/rerank`` (400 without an embedding model). ``/health``, ``/v1/models``,
    ``/metrics``, the refusals while loading and the error shapes are the same for both. The
    routes find the state, the args, the metrics and the serving objects on ``app.state``."""
    app = FastAPI(title="nextoken", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = ServerMetrics(args.model_name, lambda: state.engine.scheduler_stats() if state.engine is not None
                            else SchedulerStats(), multiprocess=args.api_server_count > 1)
    metrics.add_collector(EmbeddingCollector(state))
    app.state.server, app.state.args, app.state.metrics = state, args, metrics
    app.state.apis = apis = routers.apis()
    if args.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    app.add_middleware(BodyLimit, limit=args.max_body_bytes, apis=apis)
    app.add_middleware(Gate, state=state, config=args, apis=apis)
    if args.enable_request_id_headers:  # (outermost: refusals and errors carry the header too)
        app.add_middleware(RequestIdHeader)
    exception_handlers(app, args)
    app.include_router(routes.info)
    if capabilities.generate:
        _generation(app, state, args, metrics)
    else:
        _refuse_generation(app, args, apis)
    app.include_router(pooling.router, include_in_schema=capabilities.embed)
    app.include_router(routers.ollama_embed, include_in_schema=capabilities.embed)
    document_errors(app, lambda: None if state.engine is None else model_limits(state.engine))
    if state.engine is not None:
        attach_engine(app, state.engine)
    return app


def _generation(app: FastAPI, state, args: ServerArgs, metrics) -> None:
    """The generation APIs' serving objects and routers, the token routes and the inspector."""
    for router in routers.API_ROUTERS:  # each API's serving objects, as its router names them
        for name, serving in router.servings.items():
            setattr(app.state, name, serving(state, args, metrics))
    for router in (routes.tokens, *routers.API_ROUTERS):
        app.include_router(router)
    if args.inspect and state.inspector_socket is not None:  # the engine in a process of its own
        from nextoken.server.app.inspector_proxy import install_proxy

        install_proxy(app, state.inspector_socket)
    elif args.inspect:
        from nextoken.inspect.routes import install

        install(app, lambda: state.engine)


def _refuse_generation(app: FastAPI, args: ServerArgs, apis) -> None:
    """An embedding-only server: its tokenizer's /tokenize, and a 400 on every generating route."""
    app.include_router(pooling.tokens)

    async def refuse(request: Request):
        raise InvalidRequest(f"model {args.model_name!r} is an embedding model: it does not generate text; use "
                             "/v1/embeddings, /v1/score or /v1/rerank", "model")

    for path, _ in apis.generation_paths():
        app.add_api_route(path, refuse, methods=["POST"], include_in_schema=False)


def attach_engine(app: FastAPI, engine) -> None:
    """Subscribe the app's metrics to the steps of `engine` (an `AsyncLLMEngine`): called when
    the model is loaded (`serve`), or at once when the state holds an engine already."""
    engine.subscribe(app.state.metrics.on_step)
