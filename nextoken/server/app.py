"""The FastAPI app: OpenAI-compatible endpoints over `AsyncLLMEngine`.

    build_app(state, ServerArgs) -> middleware (`server.middleware`: API key and draining gate, body limit; CORS)
                                  + error handlers + routers (`server.routes`: info, tokens;
                                    each API's package: `server.openai`, `server.anthropic`,
                                    `server.ollama`, listed in `server.routers`)
                                  + the inspector's routes (`inspect.routes`)

Every request streams from the one shared engine. A client's mistake is a 4xx in OpenAI's error
shape naming the field, never a 500; a client that disconnects has its request aborted (its KV
blocks freed) within a step.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from nextoken.server import embeddings, routers, routes
from nextoken.server.anthropic.serving import AnthropicServingMessages
from nextoken.server.args import ServerArgs
from nextoken.engine.stats import SchedulerStats
from nextoken.server.metrics import ServerMetrics
from nextoken.server.ollama.serving import OllamaServing
from nextoken.server.openai.chat import OpenAIServingChat
from nextoken.server.openai.completions import OpenAIServingCompletion
from nextoken.server.openai.responses import OpenAIServingResponses
from nextoken.server.openapi import document_errors, model_limits
from nextoken.server.middleware import BodyLimit, Gate, exception_handlers

log = logging.getLogger("nextoken.server")


def build_app(state, args: ServerArgs, lifespan=None) -> FastAPI:
    """The app. `state` has ``engine`` (an `AsyncLLMEngine`, None while loading), ``draining``
    and ``started`` (a Unix time); `args`: the `ServerArgs` (``args.model_name`` set). The
    routes (`server.routes`, and the inspector's `inspect.routes`) find the state, the args,
    the metrics and the serving objects on ``app.state``."""
    app = FastAPI(title="nextoken", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = ServerMetrics(args.model_name, lambda: state.engine.engine.scheduler_stats() if state.engine is not None
                            else SchedulerStats())
    app.state.server, app.state.args, app.state.metrics = state, args, metrics
    app.state.apis = apis = routers.apis()
    app.state.serving_completion = OpenAIServingCompletion(state, args, metrics)
    app.state.serving_chat = OpenAIServingChat(state, args, metrics)
    app.state.serving_messages = AnthropicServingMessages(state, args, metrics)
    app.state.serving_responses = OpenAIServingResponses(state, args, metrics)
    app.state.serving_ollama = OllamaServing(state, args, metrics)
    if args.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(BodyLimit, limit=args.max_body_bytes, apis=apis)
    app.add_middleware(Gate, state=state, config=args, apis=apis)
    exception_handlers(app, args)
    for router in (routes.info, routes.tokens, *routers.API_ROUTERS):
        app.include_router(router)
    app.include_router(embeddings.router, include_in_schema=False)  # a 400 here (this model generates)
    if args.inspect:
        from nextoken.inspect.routes import install

        install(app, lambda: state.engine)
    document_errors(app, lambda: None if state.engine is None else model_limits(state.engine.engine))
    if state.engine is not None:
        attach_engine(app, state.engine)
    return app


def attach_engine(app: FastAPI, engine) -> None:
    """Subscribe the app's metrics to the steps of `engine` (an `AsyncLLMEngine`): called when
    the model is loaded (`serve`), or at once when the state holds an engine already."""
    engine.engine.subscribe(app.state.metrics.on_step)
