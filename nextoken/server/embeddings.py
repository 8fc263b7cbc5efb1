"""Embeddings over HTTP: OpenAI's ``POST /v1/embeddings``, and vLLM's ``/v1/score`` and
``/v1/rerank`` by cosine similarity of the embedding model's vectors (no cross-encoder).

The one app (`server.app.build_app`) serves these routes when the server holds an embedding
model (`ServerState.embedder`: its model is one, or ``serve --embedding-model``); without one they
answer 400 naming the reason, as the generation routes do on a server with no generation model.
``/tokenize`` is this module's (`tokens`) on an embedding-only server.

Requests that arrive together share encoder passes: `EmbeddingService` runs one pass for every
input queued while the previous pass ran (micro-batching), on its own thread.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from prometheus_client.core import CounterMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from nextoken.errors import InvalidRequest



class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # vLLM's: cut inputs longer than the model takes


class ScoreRequest(BaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(BaseModel):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)


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


def embedding_service(request: Request) -> EmbeddingService:
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
    if name is not None and name != served:
        from nextoken.errors import NotFound

        raise NotFound(f"model {name!r} not found; this server embeds with {served!r}", "model")


def _inputs(x) -> list:
    """OpenAI's ``input`` as a list of inputs: a string, strings, token ids, or lists of them."""
    if isinstance(x, str):
        return [x]
    if x and all(isinstance(t, int) for t in x):
        return [x]
    return list(x)


def _vector(v: np.ndarray, fmt: str):
    return base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()


router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    service = embedding_service(request)
    check_model(request, body.model)
    inputs = _inputs(body.input)
    if not inputs:
        raise InvalidRequest("input is empty: give a string, a list of strings or token ids", "input")
    if body.dimensions is not None:  # refused before any pass for a model that cannot cut its vectors
        service.model.check_dimensions(body.dimensions)
    out = await service.embed(inputs, truncate=body.truncate_prompt_tokens is not None)
    vectors = service.model.cut(out.vectors, body.dimensions).numpy()
    n = sum(out.num_tokens)
    return {"object": "list", "model": model_name(request),
            "data": [{"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request):
    """vLLM's score API: cosine similarity of ``text_1`` against each ``text_2`` (one against
    many, or pairwise for equal-length lists)."""
    service = embedding_service(request)
    check_model(request, body.model)
    a = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    b = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not a or not b or (len(a) != 1 and len(a) != len(b)):
        raise InvalidRequest("text_1 must be one text or as many texts as text_2", "text_1")
    out = await service.embed(a + b)
    va, vb = out.vectors[: len(a)], out.vectors[len(a):]
    sims = _cosine(va.expand(len(b), -1) if len(a) == 1 else va, vb)
    n = sum(out.num_tokens)
    return {"object": "list", "model": model_name(request),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(sims)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request):
    """vLLM's (Jina/Cohere-style) rerank API: documents by cosine similarity to the query."""
    service = embedding_service(request)
    check_model(request, body.model)
    out = await service.embed([body.query, *body.documents])
    sims = _cosine(out.vectors[:1].expand(len(body.documents), -1), out.vectors[1:])
    order = sorted(range(len(sims)), key=lambda i: -sims[i])[: body.top_n or len(sims)]
    n = sum(out.num_tokens)
    return {"model": model_name(request),
            "results": [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": sims[i]}
                        for i in order],
            "usage": {"total_tokens": n}}


def _cosine(a, b) -> list[float]:
    import torch

    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()


# -- on an embedding-only server ---------------------------------------------------------------
tokens = APIRouter()


@tokens.post("/tokenize")
async def tokenize(request: Request):
    body = await request.json()
    service = embedding_service(request)
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise InvalidRequest("prompt must be a string", "prompt")
    ids = service.model.tokenize([body["prompt"]], truncate=True)[0]
    return {"tokens": ids, "count": len(ids), "max_model_len": service.model.max_seq_length}


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
