"""What a running server holds (`ServerState`) and what it asks of each model it serves
(`EngineClient`): the generation engine (`engine.async_engine.AsyncLLMEngine`) and the embedding
service (`server.embeddings.EmbeddingService`) both are one, so `/health`, the refusals while
loading and the shutdown treat them alike. One server may hold both (`serve --model A
--embedding-model B`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class EngineClient(Protocol):
    """A model the server serves: whether its loop runs, the exception that stopped it (None
    while it runs), and `close` (stop it, free what it holds)."""

    @property
    def is_running(self) -> bool: ...

    @property
    def dead(self) -> BaseException | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Capabilities:
    """What the app serves: text generation (every generation API, the inspector) and/or
    embeddings (``/v1/embeddings``, ``/v1/score``, ``/v1/rerank``)."""

    generate: bool = True
    embed: bool = False


@dataclass
class ServerState:
    """engine: the generation `AsyncLLMEngine` (None while loading, or on an embedding-only
    server); embedder: the `EmbeddingService` (None without one); embedding_model_name: the name
    clients send for it; ready: every model is loaded (False while loading); draining: SIGTERM was
    received; started: a Unix time; exit_code; loras: the adapters served by name."""

    engine: EngineClient | None = None
    embedder: EngineClient | None = None
    embedding_model_name: str | None = None
    ready: bool = True
    draining: bool = False
    started: float = field(default_factory=time.time)
    exit_code: int = 0
    loras: dict = field(default_factory=dict)

    def clients(self) -> list[EngineClient]:
        return [c for c in (self.engine, self.embedder) if c is not None]
