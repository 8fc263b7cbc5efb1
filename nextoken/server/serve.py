"""`nextoken serve`: load the model and run the HTTP server with uvicorn.

The model file is resolved before the server starts (an unknown model is a one-line error);
the weights load (and one warm-up request runs) in the background while `/health` answers
503. SIGTERM (or Ctrl-C) makes the server refuse new requests with 503, lets in-flight requests
finish within `--shutdown-timeout` seconds, then exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from types import SimpleNamespace

log = logging.getLogger("nextoken.server")


def serve(engine_args, server_args, announce_inspector: bool = False) -> int:
    """Load `engine_args`' model (in the background: /health answers 503 until it is warm) and
    serve it as `server_args` (`ServerArgs`) say, until SIGTERM or Ctrl-C; the exit status. An
    embedding model (`embedding.is_embedding_model`) gets `server.embeddings`' app."""
    from nextoken.catalog import resolve_model
    from nextoken.distributed.group import TensorParallelError, is_follower
    from nextoken.engine.async_engine import AsyncLLMEngine
    from nextoken.engine.engine import LLMEngine
    from nextoken.engine.launch import warm_up
    from nextoken.embedding import EmbeddingModel, is_embedding_model
    from nextoken.errors import InvalidRequest
    from nextoken.lora import parse_lora_modules
    from nextoken.server.app import attach_engine, build_app
    from nextoken.server.embeddings import EmbeddingService, build_embedding_app

    path = resolve_model(engine_args.model, auto_pull=engine_args.auto_pull)  # an unknown model: one line, no server
    if is_embedding_model(path):
        return _serve(engine_args, server_args, lambda: EmbeddingService(EmbeddingModel(path)), build_embedding_app)
    if is_follower():  # a torchrun rank other than 0: no HTTP server, its shard follows rank 0's steps
        LLMEngine.from_engine_args(engine_args)  # exits when rank 0 stops
    stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nextoken-step")  # loads, warms, then steps
    server_ref = {}

    adapters = parse_lora_modules(server_args.lora_modules)  # a malformed item: one line, no server
    if adapters and not engine_args.enable_lora:
        raise InvalidRequest("--lora-modules needs --enable-lora", "lora_modules")

    def load():  # /health answers 200 once the model is loaded and warm
        engine = LLMEngine.from_engine_args(engine_args)
        for lora in adapters:  # a bad adapter stops the start, naming it
            engine.runner.loras.add(lora)
        server_ref["state"].loras = {lora.lora_name: lora for lora in adapters}
        warm_up(engine)
        async_engine = AsyncLLMEngine(engine, stepper)
        attach_engine(server_ref["app"], async_engine)  # the metrics follow each step
        async_engine.on_dead = on_dead
        return async_engine

    def on_dead(exc):  # a tensor-parallel rank failed: nothing can be served any more, exit with an error
        if isinstance(exc, TensorParallelError):
            log.error("%s; the server exits", exc)
            server_ref["state"].exit_code = 1
            server_ref["server"].should_exit = True

    return _serve(engine_args, server_args, load, build_app, announce_inspector, stepper, server_ref)


def _serve(engine_args, server_args, load, build, announce_inspector: bool = False, stepper=None,
           server_ref: dict | None = None) -> int:
    """Build the app with `build` (`build_app` or `build_embedding_app`), load the model with
    `load` (what ``state.engine`` becomes) on `stepper` in the background, and run uvicorn until
    a signal; the exit status."""
    import uvicorn

    state = SimpleNamespace(engine=None, draining=False, started=time.time(), exit_code=0, loras={})
    config = server_args.for_model(engine_args.model)
    server_ref = {} if server_ref is None else server_ref
    stepper = stepper or ThreadPoolExecutor(max_workers=1, thread_name_prefix="nextoken-load")

    @asynccontextmanager
    async def lifespan(app):
        async def load_in_background():
            try:
                state.engine = await asyncio.get_running_loop().run_in_executor(stepper, load)
                log.info("model %s loaded; serving", config.model_name)
            except Exception as exc:  # nothing to serve: say why and stop
                log.error("could not load the model: %s", exc)
                state.exit_code = 1
                server_ref["server"].should_exit = True

        task = asyncio.create_task(load_in_background())
        yield
        task.cancel()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.draining = True  # new requests get 503 while in-flight ones finish
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:  # a requested, graceful stop: exit 0 afterwards, not by the signal
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    app = build(state, config, lifespan)
    server_ref["app"], server_ref["state"] = app, state
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                   timeout_graceful_shutdown=config.shutdown_timeout))
    server_ref["server"] = server
    log.info("nextoken serving %s on http://%s:%d", config.model_name, config.host, config.port)
    if announce_inspector:  # `nextoken inspect`: the URL to open (with the key, when there is one)
        key = f"?key={config.api_key}" if config.api_key else ""
        print(f"inspector: http://{config.host}:{config.port}/inspect{key}", flush=True)
    server.run()
    return state.exit_code
