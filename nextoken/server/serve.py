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
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace

log = logging.getLogger("nextoken.server")


def uvicorn_config(app, config):
    """How uvicorn serves `app` (a `uvicorn.Config`): the host, port, log level, access log,
    graceful shutdown, keep-alive, TLS and root path of `config` (the `ServerArgs`)."""
    import uvicorn

    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                          access_log=not config.disable_uvicorn_access_log,
                          timeout_graceful_shutdown=config.shutdown_timeout,
                          timeout_keep_alive=config.timeout_keep_alive, root_path=config.root_path or "",
                          ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                          ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs)


_SERVER_CLASS: list = []


def server_class():
    """uvicorn's `Server`, whose shutdown first drops the TLS connections with no request in flight
    (`drop_idle_tls`). Closing one of those waits for the client's close_notify, which an idle
    keep-alive client never sends, until asyncio's SSL shutdown timeout (30 s): with one such
    client connected, a SIGTERM took 30 s where plain HTTP took 0.4."""
    if not _SERVER_CLASS:
        import uvicorn

        class Server(uvicorn.Server):
            async def shutdown(self, sockets=None) -> None:
                drop_idle_tls(self.server_state.connections)
                await super().shutdown(sockets)

        _SERVER_CLASS.append(Server)
    return _SERVER_CLASS[0]


def drop_idle_tls(connections) -> int:
    """Abort the transport of each of uvicorn's HTTP `connections` that is TLS and has no request
    in flight (no cycle, or its response complete): nothing is lost, and the client sees its
    connection end as a keep-alive timeout ends it. Returns how many were dropped."""
    dropped = 0
    for conn in list(connections):
        if not hasattr(conn, "cycle"):  # (not an HTTP/1.1 connection: uvicorn's own shutdown)
            continue
        transport, cycle = getattr(conn, "transport", None), conn.cycle
        if transport is None or not transport.get_extra_info("sslcontext"):
            continue
        if cycle is None or cycle.response_complete:
            transport.abort()
            dropped += 1
    return dropped


def serve(engine_args, server_args, announce_inspector: bool = False) -> int:
    """One server process (several over one engine process: `server.api_servers`). Load
    `engine_args`' model (in the background: /health answers 503 until it is warm), and
    ``--embedding-model`` beside it, and serve them as `server_args` (`ServerArgs`) say, until
    SIGTERM or Ctrl-C; the exit status. An embedding model (`catalog.is_embedding_model`) as
    `--model` serves embeddings alone (the one app, `server.app.build_app`, without generation)."""
    from nextoken.catalog import is_embedding_model, resolve_model
    from nextoken.engine.launch import freeze_heap
    from nextoken.errors import InvalidRequest
    from nextoken.server.app import attach_engine
    from nextoken.server.pooling.serving import EmbeddingService
    from nextoken.server.api.state import Capabilities

    path = resolve_model(engine_args.model, auto_pull=engine_args.auto_pull)  # an unknown model: one line, no server
    embed_only = is_embedding_model(path)
    extra = server_args.embedding_model
    embedding_path = resolve_model(extra, auto_pull=engine_args.auto_pull) if extra else (path if embed_only else None)
    if extra and (embed_only or not is_embedding_model(embedding_path)):
        raise InvalidRequest("--embedding-model names an embedding model served beside a generation --model",
                             "embedding_model")
    if not embed_only and not server_args.engine_process:  # (with the engine in a process of its own the
        from nextoken.distributed.group import is_follower  # server process needs no PyTorch)
        from nextoken.engine.engine import LLMEngine

        if is_follower():  # a torchrun rank other than 0: no HTTP server, it follows rank 0's steps
            LLMEngine.from_engine_args(engine_args)  # exits when rank 0 stops
    stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nextoken-step")  # loads, warms, then steps
    server_ref = {}

    adapters = served_adapters(engine_args, server_args)
    inspector = None  # with the engine in a process of its own, the inspector it serves
    if server_args.engine_process and not embed_only and server_args.inspect:
        inspector = inspector_in_engine_process(server_args.for_model(engine_args.model))

    def load(state):  # /health answers 200 once every model is loaded and warm
        load_models(state)
        freeze_heap()  # (what is loaded lives as long as the server: no full collection scans it again)

    def load_models(state):
        if embedding_path is not None:
            from nextoken.embedding import EmbeddingModel, encoder_dtype
            from nextoken.runner.device import resolve_device

            device = resolve_device(engine_args.device).torch
            dtype = encoder_dtype(engine_args.dtype if embed_only else "auto", device)
            quantization = engine_args.quantization if embed_only else None
            state.embedder = EmbeddingService(EmbeddingModel(embedding_path, dtype, quantization=quantization,
                                                             device=device, enforce_eager=engine_args.enforce_eager))
            state.embedding_model_name = extra
        if embed_only:
            return
        if server_args.engine_process:
            from nextoken.engine.core_client import EngineProcessClient

            level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
            client = EngineProcessClient(engine_args, adapters, level, inspector=inspector)
            client.on_dead = on_dead
            state.loras = {lora.lora_name: lora for lora in adapters}
            attach_engine(server_ref["app"], client)
            state.engine = client
            return
        from nextoken.engine.async_engine import AsyncLLMEngine
        from nextoken.engine.engine import LLMEngine
        from nextoken.engine.launch import warm_up

        engine = LLMEngine.from_engine_args(engine_args)
        for lora in adapters:  # a bad adapter stops the start, naming it
            engine.runner.loras.add(lora)
        state.loras = {lora.lora_name: lora for lora in adapters}
        warm_up(engine)
        async_engine = AsyncLLMEngine(engine, stepper)
        attach_engine(server_ref["app"], async_engine)  # the metrics follow each step
        async_engine.on_dead = on_dead
        state.engine = async_engine

    def on_dead(exc):  # a tensor-parallel rank or the engine process failed: nothing can be served, exit 1
        if not server_args.engine_process:
            from nextoken.distributed.group import TensorParallelError

            if not isinstance(exc, TensorParallelError):
                return
        log.error("%s; the server exits", exc)
        server_ref["state"].exit_code = 1
        server_ref["server"].should_exit = True

    caps = Capabilities(generate=not embed_only, embed=embedding_path is not None)
    return _serve(engine_args, server_args, load, caps, announce_inspector, stepper, server_ref,
                  inspector_socket=inspector[2] if inspector else None)


def served_adapters(engine_args, server_args) -> list:
    """The adapters of ``--lora-modules`` (`lora.LoRARequest`s). Raises `InvalidRequest` for a
    malformed item, or for adapters without ``--enable-lora`` (one line, no server)."""
    from nextoken.errors import InvalidRequest
    from nextoken.lora import parse_lora_modules

    adapters = parse_lora_modules(server_args.lora_modules)
    if adapters and not engine_args.enable_lora:
        raise InvalidRequest("--lora-modules needs --enable-lora", "lora_modules")
    return adapters


def inspector_in_engine_process(config) -> tuple:
    """What an engine process needs to serve the inspector (`engine.core.run_engine_core`'s
    `inspector`): the function that starts it there (`server.app.inspector_host.serve_inspector`),
    the server's `ServerArgs` `config` (its model name and key) and a new socket's path."""
    from nextoken.server.app.inspector_host import serve_inspector

    return serve_inspector, config, inspector_socket()


def inspector_socket() -> str:
    """A path for the engine process's inspector to listen on (`server.app.inspector_host`): a Unix socket in a
    new directory only this user may enter, removed at exit."""
    import atexit
    import os
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="nextoken-inspect-")
    atexit.register(shutil.rmtree, folder, True)
    return os.path.join(folder, "inspector.sock")


def serve_front_end(engine_args, server_args, channel, sock, inspector_socket: str | None = None) -> int:
    """One of ``--api-server-count``'s HTTP server processes: the app over its own
    `EngineProcessClient` on `channel` (``(to_core, from_core, engine pid)``), accepting on the
    listening socket `sock` it shares with the others, until the launcher's SIGTERM (a SIGINT is
    the launcher's to forward: `server.api_servers`); ``/inspect`` forwarded to the engine
    process's inspector on `inspector_socket` (None: no inspector); the exit status (1 when the
    engine process stopped)."""
    from nextoken.engine.core_client import EngineProcessClient
    from nextoken.engine.launch import freeze_heap
    from nextoken.server.app import attach_engine
    from nextoken.server.api.state import Capabilities

    adapters = served_adapters(engine_args, server_args)
    server_ref: dict = {}

    def load(state):
        client = EngineProcessClient(None, channel=channel)
        client.on_dead = on_dead
        state.loras = {lora.lora_name: lora for lora in adapters}
        attach_engine(server_ref["app"], client)
        state.engine = client
        freeze_heap()

    def on_dead(exc):
        log.error("%s; the server exits", exc)
        server_ref["state"].exit_code = 1
        server_ref["server"].should_exit = True

    return _serve(engine_args, replace(server_args, inspect=inspector_socket is not None), load,
                  Capabilities(generate=True, embed=False), server_ref=server_ref, sockets=[sock],
                  inspector_socket=inspector_socket)


def _read_engine_messages(state) -> None:
    """An engine in a process of its own: read its pipe on this event loop from now on, not from
    the first request (`EngineProcessClient.attach`: a server process that no request has reached
    yet still receives every step's counts)."""
    from nextoken.engine.core_client import EngineProcessClient

    if isinstance(state.engine, EngineProcessClient):
        state.engine.attach()


def _serve(engine_args, server_args, load, capabilities, announce_inspector: bool = False, stepper=None,
           server_ref: dict | None = None, sockets: list | None = None, inspector_socket: str | None = None) -> int:
    """Build the one app (`build_app` with `capabilities`), load the models with `load(state)`
    (which sets ``state.engine`` and/or ``state.embedder``) on `stepper` in the background, and
    run uvicorn until a signal; the exit status. `sockets`: listening sockets another process
    bound (``--api-server-count``: this is one of its front ends: it loads first, then serves,
    and leaves SIGINT to the launcher); `inspector_socket`: ``/inspect`` is forwarded there (the
    engine process serves the inspector)."""
    from nextoken.server.app import build_app
    from nextoken.server.api.state import ServerState

    state = ServerState(ready=False, inspector_socket=inspector_socket)
    config = server_args.for_model(engine_args.model)
    server_ref = {} if server_ref is None else server_ref
    stepper = stepper or ThreadPoolExecutor(max_workers=1, thread_name_prefix="nextoken-load")

    @asynccontextmanager
    async def lifespan(app):
        async def load_in_background():
            try:
                await asyncio.get_running_loop().run_in_executor(stepper, load, state)
                _read_engine_messages(state)
                state.ready = True
                log.info("model %s loaded; serving", config.model_name)
            except Exception as exc:  # nothing to serve: say why and stop
                log.error("could not load the model: %s", exc)
                state.exit_code = 1
                server_ref["server"].should_exit = True

        if state.ready:  # (loaded before the loop ran: one of --api-server-count's server processes)
            _read_engine_messages(state)
        task = asyncio.create_task(load_in_background()) if not state.ready else None
        yield
        if task is not None:
            task.cancel()
        for client in state.clients():  # in-flight requests are done: free each model (disk writes flushed)
            await asyncio.get_running_loop().run_in_executor(stepper, client.close)

    class Server(server_class()):
        def handle_exit(self, sig, frame):
            if sockets is not None and sig == signal.SIGINT:  # (a terminal's Ctrl-C: the launcher sends SIGTERM)
                return
            state.draining = True  # new requests get 503 while in-flight ones finish
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:  # a requested, graceful stop: exit 0 afterwards, not by the signal
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    app = build_app(state, config, lifespan, capabilities)
    server_ref["app"], server_ref["state"] = app, state
    server = Server(uvicorn_config(app, config))
    server_ref["server"] = server
    if sockets is None:
        log.info("nextoken serving %s on %s://%s:%d%s", config.model_name, config.scheme, config.host, config.port,
                 config.root_path or "")
    else:  # one server process of several: it accepts once loaded (none answers 503 while another answers 200)
        try:
            load(state)
        except Exception as exc:  # noqa: BLE001 - nothing to serve: say why and stop
            log.error("could not load the model: %s", exc)
            return 1
        state.ready = True
    if announce_inspector:  # `nextoken inspect`: the URL to open (with the key, when there is one)
        key = f"?key={config.api_key}" if config.api_key else ""
        print(f"inspector: {config.scheme}://{config.host}:{config.port}{config.root_path or ''}/inspect{key}",
              flush=True)
    server.run(sockets=sockets)
    return state.exit_code
