"""`nextoken serve --api-server-count N`: N HTTP server processes in front of one engine process
(vLLM's ``--api-server-count``).

With ``--engine-process`` one HTTP server process does every stream's Python: reading the
engine's outputs, rendering each chunk and writing it (about 30-60 us a chunk). At a few hundred
streams on a GPU that is a core's worth of work, and it sets the pace. Here the launcher (this
process) binds the listening socket, starts the engine process with N front ends
(`core_client.start_engine_core`: a pair of pipes each), and starts N server processes
(``spawn``), each the ordinary app over its own `EngineProcessClient` (`serve.serve_front_end`),
all accepting on the one socket (the kernel hands each new connection to one of them, as with
uvicorn's ``--workers``). A request's outputs go back to the process that added it.

    launcher: socket, engine process, N server processes; forwards SIGINT/SIGTERM as SIGTERM
    server process k (uvicorn, the app)  <--pipes k-->  engine process (`engine.core.EngineCore`)

What differs from one server process:
- Loading: a server process accepts connections once the engine process is ready (the socket
  is bound from the start, so a client's connection waits in its queue, and ``/health`` answers
  200 when it is answered at all), not 503 while loading as one process does: with several,
  one still loading would answer 503 while another answers 200.
- ``/metrics``: each process writes its histograms and counters under a directory of its own
  (prometheus_client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``), and whichever process
  answers sums them all; the engine's gauges and totals are its last `SchedulerStats`, which every
  process receives, and each engine step is counted by one process.
- Adapters: ``--lora-modules`` serve in every process; loading one at runtime
  (``/v1/load_lora_adapter``) is refused, as each process keeps its own list of models.
- The inspector runs in the engine process (`server.app.inspector_host`); each server process forwards
  ``/inspect`` to it.
- Not here: an ``--embedding-model`` beside the model or as it, and tensor parallelism (refused
  with a one-line error).

Stopping: SIGTERM or Ctrl-C to the launcher sends SIGTERM to each server process, which drains
its requests (``--shutdown-timeout``) and says so to the engine process; the engine process exits
when every front end has closed. The server processes ignore a SIGINT (a terminal's Ctrl-C
reaches the whole process group: the launcher forwards it once). A server process that exits on
its own (a crash) stops the others, and the launcher exits 1; an engine process that dies makes
every server process exit 1; a launcher that is killed (SIGKILL) is noticed by each server
process, which stops as on SIGTERM.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading

from nextoken.errors import InvalidRequest

log = logging.getLogger("nextoken.server")


def check(engine_args, server_args) -> list:
    """Refuse what N server processes do not serve (one-line errors); the adapters of
    ``--lora-modules``."""
    from nextoken.catalog import is_embedding_model, resolve_model
    from nextoken.server.serve import served_adapters

    path = resolve_model(engine_args.model, auto_pull=engine_args.auto_pull)  # an unknown model: one line
    if is_embedding_model(path) or server_args.embedding_model:
        raise InvalidRequest("--api-server-count serves a generation model alone: serve embeddings with "
                             "--api-server-count 1", "api_server_count")
    if engine_args.tensor_parallel_size > 1:
        raise InvalidRequest("--api-server-count does not run tensor parallelism yet; serve without it",
                             "api_server_count")
    return served_adapters(engine_args, server_args)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket every server process accepts on (address reuse, as uvicorn binds)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def run_front_end(engine_args, server_args, channel, sock, log_level: str, inspector_socket: str | None) -> None:
    """A server process's main (`serve.serve_front_end`); exits with its status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's Ctrl-C: the launcher sends SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # asked to stop while loading: nothing to drain yet
    threading.Thread(target=_stop_with_launcher, name="nextoken-launcher-watch", daemon=True).start()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from nextoken.server.serve import serve_front_end

    sys.exit(serve_front_end(engine_args, server_args, channel, sock, inspector_socket))


def _stop_with_launcher() -> None:
    """Wait for the launcher to end; if it ends first (killed: it had no time to stop this
    process), stop as if it had sent SIGTERM, so no server process outlives it."""
    multiprocessing.parent_process().join()
    os.kill(os.getpid(), signal.SIGTERM)


def serve_api_servers(engine_args, server_args, announce_inspector: bool = False) -> int:
    """Serve `engine_args`' model with ``server_args.api_server_count`` server processes over one
    engine process (which serves the inspector, unless ``--no-inspect``) until SIGTERM or Ctrl-C;
    the exit status (0 after a requested stop, 1 when a process failed). `announce_inspector`
    (`nextoken inspect`): print the inspector's URL. Raises `InvalidRequest` for what this mode
    refuses."""
    from nextoken.engine.core_client import start_engine_core
    from nextoken.server.serve import inspector_in_engine_process

    n = server_args.api_server_count
    adapters = check(engine_args, server_args)
    config = server_args.for_model(engine_args.model)
    try:
        sock = listen(config.host, config.port)
    except OSError as exc:
        log.error("could not listen on %s:%d: %s", config.host, config.port, exc)
        return 1
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    metrics_dir = tempfile.mkdtemp(prefix="nextoken-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # (the server processes inherit it)
    ctx = multiprocessing.get_context("spawn")
    inspector = inspector_in_engine_process(config) if config.inspect else None
    engine, channels = start_engine_core(engine_args, adapters, level, front_ends=n, inspector=inspector)
    servers = []
    for k, (to_core, from_core) in enumerate(channels):
        p = ctx.Process(target=run_front_end, name=f"nextoken-api-{k}",
                        args=(engine_args, server_args, (to_core, from_core, engine.pid), sock, level,
                              inspector[2] if inspector else None))
        p.start()
        servers.append(p)
        to_core.close()
        from_core.close()
    sock.close()
    log.info("nextoken serving %s on %s://%s:%d%s: %d server processes over one engine process",
             config.model_name, config.scheme, config.host, config.port, config.root_path or "", n)
    if announce_inspector:  # `nextoken inspect`: the URL to open (with the key, when there is one)
        print(f"inspector: {config.scheme}://{config.host}:{config.port}{config.root_path or ''}/inspect"
              f"{f'?key={config.api_key}' if config.api_key else ''}", flush=True)
    try:
        return _supervise(servers, engine)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(servers: list, engine) -> int:
    """Wait for the server processes; on SIGINT or SIGTERM send each SIGTERM (a second one kills
    them); when one exits on its own, stop the others. Then wait for the engine process. The exit
    status: 0 when every server process exited 0."""
    stopping = {"asked": False, "signals": 0}

    def stop(sig=None, frame=None):
        stopping["asked"] = True
        stopping["signals"] += sig is not None
        for p in servers:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL if stopping["signals"] > 1 else signal.SIGTERM)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        live = list(servers)
        while live:
            multiprocessing.connection.wait([p.sentinel for p in live])
            for p in [p for p in live if not p.is_alive()]:
                live.remove(p)
                p.join()
                log.debug("%s exited with status %s", p.name, p.exitcode)
                if p.exitcode != 0:
                    status = 1
                    if not stopping["asked"]:
                        log.error("%s exited with status %s; stopping the others", p.name, p.exitcode)
                        stop()
                elif not stopping["asked"]:  # (one that stops alone stops the service)
                    stop()
        engine.join(60)  # (it exits once every front end has closed)
        if engine.is_alive():
            log.warning("the engine process did not stop within 60 s; killing it")
            engine.kill()
            engine.join(5)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return status
