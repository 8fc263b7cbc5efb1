"""Request bodies of the OpenAI-compatible API, as pydantic models.

Every model forbids fields it does not know, so a parameter we do not support is a 400 that
names it instead of being silently ignored. Ranges follow the OpenAI API reference; vLLM's
extensions (top_k, min_p, repetition_penalty, ignore_eos, min_tokens) are accepted too.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nextoken.sampling_params import SamplingParams

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    use_beam_search: bool = False  # beam search (vLLM's extension): best_of beams, the n best returned
    best_of: int | None = Field(None, ge=1, le=10)
    length_penalty: FiniteFloat = 1.0
    temperature: FiniteFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: FiniteFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: FiniteFloat = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: FiniteFloat = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: FiniteFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, FiniteFloat] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16 or any(not s for s in items):
            raise ValueError("stop takes up to 16 non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100 or math.isnan(bias):
                raise ValueError(f"logit_bias[{key}] must be in [-100, 100]")
        return v

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens), stop=self.stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
