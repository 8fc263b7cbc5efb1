"""The inspector in the engine's own process (``serve --engine-process``, ``--api-server-count``).

Its views read the engine's state and the model's weights in place, and a trace records tensors
inside the forward pass: they need the engine in their process. So with the engine in a process of
its own the inspector is served there: the engine process runs the one app (`server.app.build_app`,
the inspector's routes being the ones used) in a thread of its own, over a `LocalFrontEnd` of its
`EngineCore`, on a Unix socket in a directory only this user may enter; each HTTP server process
forwards ``/inspect`` and everything under it to that socket (`server.app.inspector_proxy`).

    browser -> server process: /inspect/... -> (Unix socket) -> engine process: the inspector's
    routes -> LocalFrontEnd -> EngineCore's inbox (between steps, in its loop) -> the engine

The inspector's own requests (traces, the sampling playground, the demo) are requests of the
engine like any other; its reads of the engine's state run between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

log = logging.getLogger("nextoken.inspect")


def serve_inspector(engine, info, inbox, k: int, server_args, path: str):
    """Start serving the inspector over `engine` on the Unix socket `path` (a thread of this
    process), as front end `k` of the core whose inbox is `inbox`, with the server's `ServerArgs`
    (its model name and API key: `ServerArgs.for_model`'s); returns that front end (a
    `core_client.LocalFrontEnd`, for the core to send its messages to)."""
    from dataclasses import replace

    import uvicorn

    from nextoken.engine.core_client import LocalFrontEnd
    from nextoken.server.api.state import Capabilities, ServerState
    from nextoken.server.app import build_app

    client = LocalFrontEnd(engine, info, inbox, k)
    state = ServerState(ready=True)
    state.engine, state.loras = client, {}
    args = replace(server_args, inspect=True, engine_process=False, api_server_count=1)
    app = build_app(state, args, capabilities=Capabilities(generate=True, embed=False))
    server = uvicorn.Server(uvicorn.Config(app, uds=path, log_level="warning"))

    def run():
        try:
            asyncio.run(server.serve())
        except Exception:  # noqa: BLE001 - the engine goes on; the inspector's routes answer 502 from the servers
            log.exception("the inspector stopped")

    thread = threading.Thread(target=run, name="nextoken-inspector", daemon=True)
    thread.start()
    for _ in range(1000):  # (listening before it returns: at most 10 s)
        if server.started or not thread.is_alive():
            break
        time.sleep(0.01)
    return client
