"""The embedding model serving many requests: `EmbeddingService` (an `engine.protocol.Service`)
runs one encoder pass for every input queued while the previous pass ran (micro-batching), on
its own thread; the routes (`pooling.router`) find it with `embedding_service`, and /metrics
reads its totals (`EmbeddingCollector`).
"""

from __future__ import annotations

import asyncio
import threading

from fastapi import Request
from prometheus_client.core import CounterMetricFamily

from nextoken.engine.protocol import PoolingClient
from nextoken.errors import InvalidRequest, NotFound


class EmbeddingService:
    """An `embedding.EmbeddingModel` serving many requests (an `engine.protocol.Service`): each `embed`
    call's inputs join a queue; one thread runs a pass over everything queued, then hands each
    caller its rows. `num_requests`, `num_tokens`, `num_passes`: totals since the start."""

    def __init__(self, model):
        self.model = model
        self._cond = threading.Condition()
        self._queue: list[tuple[list, bool, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.num_requests = self.num_tokens = self.num_passes = 0
        self.dead: BaseException | None = None  # what stopped the pass loop (a pass's own error does not)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="nextoken-embed", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self.dead is None and not self._closed and self._thread.is_alive()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - /health reports it
            self.dead = exc

    async def embed(self, inputs: list, truncate: bool = False):
        """Vectors for `inputs` (`Embeddings`); raises `InvalidRequest` as `EmbeddingModel.embed`."""
        ids = self.model.tokenize(inputs, truncate)  # a bad input fails alone, before it joins a pass
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            self._queue.append((ids, loop, fut))
            self._cond.notify()
        return await fut

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue, []
            flat = [x for ids, _, _ in batch for x in ids]
            try:
                out = self.model.embed_ids(flat)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported to each caller of this pass
                out, error = None, exc
            self.num_passes += 1
            at = 0
            for ids, loop, fut in batch:
                n = len(ids)
                if error is None:
                    part = type(out)(out.vectors[at : at + n], out.num_tokens[at : at + n], out.token_ids[at : at + n])
                    self.num_requests += 1
                    self.num_tokens += sum(part.num_tokens)
                    loop.call_soon_threadsafe(_resolve, fut, part, None)
                else:
                    loop.call_soon_threadsafe(_resolve, fut, None, error)
                at += n


def _resolve(fut: asyncio.Future, result, error) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def embedding_service(request: Request) -> PoolingClient:
    """The server's embedding service; `InvalidRequest` naming how to start one when it has none."""
    state, args = request.app.state.server, request.app.state.args
    if state.embedder is None:
        raise InvalidRequest(f"model {args.model_name!r} generates text; embeddings, scores and reranking need an "
                             "embedding model (e.g. nextoken serve -m all-minilm-l6-v2, or --embedding-model "
                             "all-minilm-l6-v2 beside a generation model)", "model")
    return state.embedder


def model_name(request: Request) -> str:
    """The name clients send for the embedding model."""
    state = request.app.state.server
    return state.embedding_model_name or request.app.state.args.model_name


def check_model(request: Request, name: str | None) -> None:
    """`NotFound` for a model name that is not the embedding model's."""
    served = model_name(request)
    aliases = request.app.state.args.model_aliases if served == request.app.state.args.model_name else ()
    if name is not None and name != served and name not in aliases:
        raise NotFound(f"model {name!r} not found; this server embeds with {served!r}", "model")


class EmbeddingCollector:
    """The embedding service's totals since the start, read at each scrape (zeros while loading)."""

    COUNTERS = (("num_requests", "Embedding requests served"), ("num_tokens", "Input tokens embedded"),
                ("num_passes", "Encoder passes (micro-batches)"))

    def __init__(self, state):
        self.state = state

    def collect(self):
        service = self.state.embedder
        for key, doc in self.COUNTERS:
            yield CounterMetricFamily(f"nextoken_embedding_{key.removeprefix('num_')}", doc,
                                      value=getattr(service, key) if service is not None else 0)
