"""Embeddings over HTTP: OpenAI's ``POST /v1/embeddings``, and vLLM's ``/v1/score`` and
``/v1/rerank`` by cosine similarity of the embedding model's vectors (no cross-encoder).

A server whose model is an embedding model (`embedding.is_embedding_model`) is built by
`build_embedding_app`: the same middleware and error shapes as the generation server, these
routes, and ``/health``, ``/v1/models``, ``/metrics``, ``/tokenize``; the generation routes
answer 400 naming the reason. A generation server answers these three routes with 400 the same way.

Requests that arrive together share encoder passes: `EmbeddingService` runs one pass for every
input queued while the previous pass ran (micro-batching), on its own thread.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Literal

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from nextoken.errors import InvalidRequest
from nextoken.server.middleware import BodyLimit, Gate, exception_handlers



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
    """An `embedding.EmbeddingModel` serving many requests: each `embed` call's inputs join a
    queue; one thread runs a pass over everything queued, then hands each caller its rows."""

    is_running, dead = True, None

    def __init__(self, model):
        self.model = model
        self._cond = threading.Condition()
        self._queue: list[tuple[list, bool, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.num_requests = self.num_tokens = self.num_passes = 0
        threading.Thread(target=self._loop, name="nextoken-embed", daemon=True).start()

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
                while not self._queue:
                    self._cond.wait()
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


def _service(request: Request) -> EmbeddingService:
    state, args = request.app.state.server, request.app.state.args
    if not isinstance(state.engine, EmbeddingService):
        raise InvalidRequest(f"model {args.model_name!r} generates text; embeddings, scores and reranking need an "
                             "embedding model (e.g. nextoken serve -m all-minilm-l6-v2)", "model")
    return state.engine


def _check_model(request: Request, name: str | None) -> None:
    args = request.app.state.args
    if name is not None and name != args.model_name:
        from nextoken.errors import NotFound

        raise NotFound(f"model {name!r} not found; this server serves {args.model_name!r}", "model")


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
    service = _service(request)
    _check_model(request, body.model)
    inputs = _inputs(body.input)
    if not inputs:
        raise InvalidRequest("input is empty: give a string, a list of strings or token ids", "input")
    if body.dimensions is not None:  # refused before any pass for a model that cannot cut its vectors
        service.model.check_dimensions(body.dimensions)
    out = await service.embed(inputs, truncate=body.truncate_prompt_tokens is not None)
    vectors = service.model.cut(out.vectors, body.dimensions).numpy()
    n = sum(out.num_tokens)
    return {"object": "list", "model": request.app.state.args.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request):
    """vLLM's score API: cosine similarity of ``text_1`` against each ``text_2`` (one against
    many, or pairwise for equal-length lists)."""
    service = _service(request)
    _check_model(request, body.model)
    a = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    b = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not a or not b or (len(a) != 1 and len(a) != len(b)):
        raise InvalidRequest("text_1 must be one text or as many texts as text_2", "text_1")
    out = await service.embed(a + b)
    va, vb = out.vectors[: len(a)], out.vectors[len(a):]
    sims = _cosine(va.expand(len(b), -1) if len(a) == 1 else va, vb)
    n = sum(out.num_tokens)
    return {"object": "list", "model": request.app.state.args.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(sims)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request):
    """vLLM's (Jina/Cohere-style) rerank API: documents by cosine similarity to the query."""
    service = _service(request)
    _check_model(request, body.model)
    out = await service.embed([body.query, *body.documents])
    sims = _cosine(out.vectors[:1].expand(len(body.documents), -1), out.vectors[1:])
    order = sorted(range(len(sims)), key=lambda i: -sims[i])[: body.top_n or len(sims)]
    n = sum(out.num_tokens)
    return {"model": request.app.state.args.model_name,
            "results": [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": sims[i]}
                        for i in order],
            "usage": {"total_tokens": n}}


def _cosine(a, b) -> list[float]:
    import torch

    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()


# -- the embedding model's own server ----------------------------------------------------------
info = APIRouter()


@info.get("/v1/models")
async def models(request: Request):
    service, args = _service(request), request.app.state.args
    return {"object": "list", "data": [{"id": args.model_name, "object": "model", "owned_by": "nextoken",
                                        "created": int(request.app.state.server.started),
                                        "max_model_len": service.model.max_seq_length}]}


@info.post("/tokenize")
async def tokenize(request: Request):
    body = await request.json()
    service = _service(request)
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise InvalidRequest("prompt must be a string", "prompt")
    ids = service.model.tokenize([body["prompt"]], truncate=True)[0]
    return {"tokens": ids, "count": len(ids), "max_model_len": service.model.max_seq_length}


@info.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(request.app.state.embed_registry), media_type="text/plain; version=0.0.4")


class EmbeddingCollector:
    """The embedding service's totals since the start, read at each scrape (zeros while loading)."""

    COUNTERS = (("num_requests", "Embedding requests served"), ("num_tokens", "Input tokens embedded"),
                ("num_passes", "Encoder passes (micro-batches)"))

    def __init__(self, state):
        self.state = state

    def collect(self):
        service = self.state.engine
        for key, doc in self.COUNTERS:
            yield CounterMetricFamily(f"nextoken_embedding_{key.removeprefix('num_')}", doc,
                                      value=getattr(service, key) if isinstance(service, EmbeddingService) else 0)


def build_embedding_app(state, args, lifespan=None) -> FastAPI:
    """The server of an embedding model: `state.engine` is its `EmbeddingService` (None while it
    loads). Middleware and error shapes are the generation server's (`server.middleware`)."""
    app = FastAPI(title="nextoken (embeddings)", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server, app.state.args = state, args
    app.state.embed_registry = registry = CollectorRegistry()
    registry.register(EmbeddingCollector(state))
    from nextoken.server import routers

    app.state.apis = apis = routers.apis()  # the generation routes' paths and shapes, for their refusals
    app.add_middleware(BodyLimit, limit=args.max_body_bytes, apis=apis)
    app.add_middleware(Gate, state=state, config=args, apis=apis)
    exception_handlers(app, args)
    from nextoken.server.routes import health

    app.add_api_route("/health", health, methods=["GET"])  # the generation server's own check
    app.include_router(info)
    app.include_router(router)

    async def refuse(request: Request):
        raise InvalidRequest(f"model {args.model_name!r} is an embedding model: it does not generate text; use "
                             "/v1/embeddings, /v1/score or /v1/rerank", "model")

    for path, _ in apis.generation_paths():
        app.add_api_route(path, refuse, methods=["POST"])
    return app
