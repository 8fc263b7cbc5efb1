"""A live server for tests: uvicorn in a background thread around an app built on an `LLM`."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import openai

from nextoken.engine.async_engine import AsyncLLMEngine
from nextoken.server.app import build_app
from nextoken.server.args import ServerArgs
from nextoken.server.serve import server_class, uvicorn_config
from tests.ports import free_ports


class LiveServer:
    """uvicorn in a background thread around the one app (`server.app.build_app`) serving `llm`
    (still loading, if None): a generation model, or an embedding model's `LLM` (embeddings
    alone); `embedder`: an embedding model's `LLM` served beside a generation `llm` (as
    ``serve --embedding-model``), under the name `embedder_name`; `engine`: an engine client built
    already (an `EngineProcessClient`) served in place of `llm`'s, and `inspector_socket` the
    socket its engine process serves the inspector on (``/inspect`` forwarded there)."""

    def __init__(self, llm, name: str, embedder=None, embedder_name: str | None = None, engine=None,
                 inspector_socket: str | None = None, **config):
        from nextoken.server.pooling.serving import EmbeddingService
        from nextoken.server.api.state import Capabilities, ServerState

        embed_only = llm is not None and llm.embedder is not None
        self.state = ServerState(ready=llm is not None or engine is not None, inspector_socket=inspector_socket)
        if engine is not None:  # an engine client built already (`EngineProcessClient`)
            self.state.engine = engine
        elif embed_only:
            self.state.embedder = EmbeddingService(llm.embedder)
        elif llm is not None:
            self.state.engine = AsyncLLMEngine(llm.engine)
        if embedder is not None:
            self.state.embedder, self.state.embedding_model_name = EmbeddingService(embedder.embedder), embedder_name
        self.llm = llm
        caps = Capabilities(generate=not embed_only, embed=embed_only or embedder is not None)
        if engine is not None:
            config.setdefault("inspect", inspector_socket is not None)
        self.port = free_ports(1)
        args = ServerArgs(model_name=name, host="127.0.0.1", port=self.port, **config)
        app = build_app(self.state, args, capabilities=caps)
        self.server = server_class()(uvicorn_config(app, args))  # as `serve` configures and runs it
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), f"uvicorn did not start on port {self.port}"
            time.sleep(0.02)
        self.url = f"{args.scheme}://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def stats(self) -> dict:
        """The served engine's `SchedulerStats` as a dictionary (an engine process's: as of its
        last message)."""
        return self.state.engine.scheduler_stats().as_dict()

    def busy(self) -> bool:
        """Whether the served engine holds a request."""
        s = self.stats()
        return s["running"] + s["waiting"] > 0

    def idle(self, timeout=5.0) -> bool:
        """True once the engine has no request left and every block is free (an engine process:
        as its last message says)."""
        end = time.time() + timeout
        while time.time() < end:
            if isinstance(self.state.engine, AsyncLLMEngine):
                eng = self.llm.engine
                if not eng.has_unfinished_requests() and all(b.ref_cnt == 0 for b in eng.kv.pool.blocks):
                    return True
            elif not self.busy() and self.stats()["free_blocks"] == self.stats()["num_blocks"]:
                return True
            time.sleep(0.05)
        return False

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120, log=None) -> None:
    """Wait until `url`/health answers 200. Raises AssertionError if the process exits first (with
    the end of its output when `log`, the file it writes to, is given), TimeoutError after
    `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status = proc.poll()
        if status is not None:
            output = ""
            if log is not None:
                log.seek(0)
                output = log.read()[-4000:]
            raise AssertionError(f"exited with status {status}: {output}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)
