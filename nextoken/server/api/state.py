"""What a running server holds (`ServerState`): the generation engine (an
`engine.protocol.EngineClient`, `AsyncLLMEngine` in a server) and the embedding service
(`server.pooling.serving.EmbeddingService`), both a `engine.protocol.Service`, so `/health`, the
refusals while loading and the shutdown treat them alike. One server may hold both (`serve --model
A --embedding-model B`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nextoken.engine.protocol import EngineClient, PoolingClient, Service


@dataclass(frozen=True)
class Capabilities:
    """What the app serves: text generation (every generation API, the inspector) and/or
    embeddings (``/v1/embeddings``, ``/v1/score``, ``/v1/rerank``)."""

    generate: bool = True
    embed: bool = False


@dataclass
class ServerState:
    """engine: the generation `EngineClient` (None while loading, or on an embedding-only
    server); embedder: the `EmbeddingService` (None without one); embedding_model_name: the name
    clients send for it; ready: every model is loaded (False while loading); draining: SIGTERM was
    received; started: a Unix time; exit_code; loras: the adapters served by name; inspector_socket:
    the Unix socket of the inspector the engine process serves (None: it runs here)."""

    engine: EngineClient | None = None
    embedder: PoolingClient | None = None
    embedding_model_name: str | None = None
    ready: bool = True
    draining: bool = False
    started: float = field(default_factory=time.time)
    exit_code: int = 0
    loras: dict = field(default_factory=dict)
    inspector_socket: str | None = None  # the engine process's inspector (`server.app.inspector_host`), which /inspect forwards to

    def clients(self) -> list[Service]:
        return [c for c in (self.engine, self.embedder) if c is not None]
