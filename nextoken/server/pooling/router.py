"""The pooling routes: OpenAI's ``POST /v1/embeddings``, vLLM's ``/v1/score`` and ``/v1/rerank``,
and (`tokens`) ``/tokenize`` on an embedding-only server.

The one app (`server.app.build_app`) serves them when the server holds an embedding model
(`ServerState.embedder`: its model is one, or ``serve --embedding-model``); without one they
answer 400 naming the reason, as the generation routes do on a server with no generation model.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request

from nextoken.errors import InvalidRequest
from nextoken.server.api.routing import OPENAI, ApiRouter
from nextoken.server.openai.protocol import TokenizeAnswer
from nextoken.server.pooling.protocol import EmbeddingList, EmbeddingRequest, RerankAnswer, RerankRequest, \
    ScoreList, ScoreRequest
from nextoken.server.pooling.serving import check_model, embedding_service, model_name


def _inputs(x) -> list:
    """OpenAI's ``input`` as a list of inputs: a string, strings, token ids, or lists of them."""
    if isinstance(x, str):
        return [x]
    if x and all(isinstance(t, int) for t in x):
        return [x]
    return list(x)


def _vector(v: np.ndarray, fmt: str):
    return base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()


router = ApiRouter(OPENAI)


@router.post("/v1/embeddings", response_model=EmbeddingList)
async def embeddings(body: EmbeddingRequest, request: Request):
    service = embedding_service(request)
    check_model(request, body.model)
    inputs = _inputs(body.input)
    if not inputs:
        raise InvalidRequest("input is empty: give a string, a list of strings or token ids", "input")
    if body.dimensions is not None:  # refused before any pass for a model that cannot cut its vectors
        service.model.check_dimensions(body.dimensions)
    truncate = False if body.truncate_prompt_tokens is None else body.truncate_prompt_tokens
    if truncate is not False:
        service.model.tokenize(["x"], truncate)  # (a bad value refused before any pass)
    out = await service.embed(inputs, truncate=truncate)
    vectors = service.model.cut(out.vectors, body.dimensions).numpy()
    n = sum(out.num_tokens)
    return {"object": "list", "model": model_name(request),
            "data": [{"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/score", response_model=ScoreList)
async def score(body: ScoreRequest, request: Request):
    """vLLM's score API: cosine similarity of ``text_1`` against each ``text_2`` (one against
    many, or pairwise for equal-length lists)."""
    from nextoken.embedding import cosine_scores, score_pairs  # (here: a front end without PyTorch imports none)

    service = embedding_service(request)
    check_model(request, body.model)
    a = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    b = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    score_pairs(a, b)
    out = await service.embed(a + b)
    sims = cosine_scores(out.vectors[: len(a)], out.vectors[len(a):])
    n = sum(out.num_tokens)
    return {"object": "list", "model": model_name(request),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(sims)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/rerank", response_model=RerankAnswer)
async def rerank(body: RerankRequest, request: Request):
    """vLLM's (Jina/Cohere-style) rerank API: documents by cosine similarity to the query."""
    from nextoken.embedding import cosine_scores

    service = embedding_service(request)
    check_model(request, body.model)
    out = await service.embed([body.query, *body.documents])
    sims = cosine_scores(out.vectors[:1], out.vectors[1:])
    order = sorted(range(len(sims)), key=lambda i: -sims[i])[: body.top_n or len(sims)]
    n = sum(out.num_tokens)
    return {"model": model_name(request),
            "results": [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": sims[i]}
                        for i in order],
            "usage": {"total_tokens": n}}




# -- on an embedding-only server ---------------------------------------------------------------
tokens = ApiRouter(OPENAI)


@tokens.post("/tokenize", response_model=TokenizeAnswer)
async def tokenize(request: Request):
    body = await request.json()
    service = embedding_service(request)
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise InvalidRequest("prompt must be a string", "prompt")
    ids = service.model.tokenize([body["prompt"]], truncate=True)[0]
    return {"tokens": ids, "count": len(ids), "max_model_len": service.model.max_seq_length}
