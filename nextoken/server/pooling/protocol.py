"""The pooling routes' request bodies (strict, as every API's: an unknown field is a 400 naming
it) and answers (OpenAI's embedding list; vLLM's score and rerank results)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nextoken.bodies import Answer, Body


class EmbeddingRequest(Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM's: cut each input to this many tokens
    # (-1: the model's length; 0 is refused)


class ScoreRequest(Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(Body):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)


class PoolingUsage(Answer):
    prompt_tokens: int | None = None
    total_tokens: int


class EmbeddingData(Answer):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a string: base64 of little-endian float32 (encoding_format "base64")


class EmbeddingList(Answer):
    object: Literal["list"]
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(Answer):
    index: int
    object: Literal["score"]
    score: float


class ScoreList(Answer):
    object: Literal["list"]
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(Answer):
    text: str


class RerankResult(Answer):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankAnswer(Answer):
    model: str
    results: list[RerankResult]
    usage: PoolingUsage
