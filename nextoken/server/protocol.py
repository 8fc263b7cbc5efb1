"""Request bodies of the OpenAI-compatible API, as pydantic models.

Every model forbids fields it does not know, so a parameter we do not support is a 400 that
names it instead of being silently ignored. Ranges follow the OpenAI API reference; vLLM's
extensions (top_k, min_p, repetition_penalty, ignore_eos, min_tokens) are accepted too.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nextoken.errors import InvalidRequest
from nextoken.sampling_params import SamplingParams
from nextoken.structured.params import StructuredOutputsParams

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    watermark: bool = False  # TGI's green-list watermark (the server's --watermark-gamma/--watermark-delta)

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

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint this request asks for, or None. Raises `InvalidRequest`
        when it sets several."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidRequest("response_format of type json_schema needs json_schema", "response_format")
            given.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, StructuredOutputsParams(**{key: getattr(self, name)})))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object))))
        if len(given) > 1:
            raise InvalidRequest("give one output constraint, not " + " and ".join(n for n, _ in given), given[1][0])
        if not given:
            return None
        name, spec = given[0]
        try:
            spec.kind()
        except InvalidRequest as exc:
            raise InvalidRequest(str(exc), name) from None
        if self.use_beam_search:
            raise InvalidRequest(f"{name} cannot be combined with use_beam_search", name)
        return spec

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # echo without logprobs: nothing to generate, the prompt is computed once
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens), stop=self.stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=structured, watermark=self.watermark, prompt_logprobs=prompt_logprobs,
        )


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: int | None = Field(16, ge=0)  # 0: score the prompt only (with echo)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extension: choices[].prompt_logprobs

    def generation_limit(self) -> int:
        """max_tokens (16 when not given). Raises `InvalidRequest` for 0 without echo."""
        n = 16 if self.max_tokens is None else self.max_tokens
        if n == 0 and not self.echo:
            raise InvalidRequest("max_tokens 0 scores the prompt without generating and needs echo (with "
                                 "logprobs for the scores)", "max_tokens")
        return n

    def scored_prompt(self) -> int | None:
        """How many alternatives each prompt position's log-probabilities carry, when the
        prompt is scored: echo with logprobs, or prompt_logprobs; else None."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


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


class WatermarkDetectRequest(BaseModel):
    """Text (or token ids) to score for the watermark (`nextoken.sample.watermark.detect`)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    text: str | None = Field(None, min_length=1)
    tokens: list[int] | None = Field(None, min_length=2)
    z_threshold: FiniteFloat = 4.0
