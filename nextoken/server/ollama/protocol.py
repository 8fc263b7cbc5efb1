"""Ollama's request bodies (``/api/chat``, ``/api/generate``, ``/api/show``), with the message
and option fields its clients send (`PUBLISHED_CHAT`, `PUBLISHED_GENERATE`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from nextoken.bodies import Answer, Body, NonEmptyStr, Published, accept_published, unset_or
from nextoken.server.api import published
from nextoken.server.openai.protocol import FunctionDefinition

VERSION = "0.6.0"  # the Ollama API version these routes follow


class ToolCallFunction(Body):
    name: NonEmptyStr
    arguments: dict[str, Any]
    index: int | None = None


class ToolCall(Body):
    function: ToolCallFunction
    id: str | None = None
    type: str | None = None


class Tool(Body):
    """A function tool, as Ollama takes it (OpenAI's chat shape; `type` may be left out)."""
    type: Literal["function"] = "function"
    function: FunctionDefinition


class Message(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


# POST /api/chat (Ollama's ChatRequest, as the `ollama` package types it)
PUBLISHED_CHAT = {"logprobs": published.LOGPROBS, "top_logprobs": published.TOP_LOGPROBS}

# POST /api/generate (Ollama's GenerateRequest)
PUBLISHED_GENERATE = {
    "logprobs": published.LOGPROBS, "top_logprobs": published.TOP_LOGPROBS,
    "width": Published("image generation", unset_or(), "image generation is not available"),
    "height": Published("image generation", unset_or(), "image generation is not available"),
    "steps": Published("image generation", unset_or(), "image generation is not available"),
    "suffix": Published("fill-in-the-middle text after the answer", unset_or(""),
                        "fill-in-the-middle is not supported"),
    "template": Published("a prompt template replacing the model's", unset_or(""), "the model's template is used"),
    "context": Published("the deprecated token context of an earlier answer", published.empty_or_unset,
                         "send the conversation to /api/chat"),
}


class ChatRequest(Body):
    model: NonEmptyStr
    messages: list[Message] = Field(default_factory=list)
    stream: bool = True
    format: Literal["json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    keep_alive: str | int | None = None
    think: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _published(cls, data):
        """Ollama's published fields that change nothing here (`PUBLISHED_CHAT`)."""
        return accept_published(data, PUBLISHED_CHAT)


class GenerateRequest(Body):
    model: NonEmptyStr
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    stream: bool = True
    format: Literal["json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | None = None
    images: list[str] | None = None
    think: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _published(cls, data):
        """Ollama's published fields that change nothing here (`PUBLISHED_GENERATE`)."""
        return accept_published(data, PUBLISHED_GENERATE)


class ShowRequest(Body):
    model: NonEmptyStr
    verbose: bool = False

    @model_validator(mode="before")
    @classmethod
    def _name(cls, data):
        """`name`, the field's older name (LiteLLM and older clients send it), stands for `model`;
        both at different values is a 400 naming `name`."""
        if isinstance(data, dict) and "name" in data and data.get("model", data["name"]) == data["name"]:
            data = {**{k: v for k, v in data.items() if k != "name"}, "model": data["name"]}
        return data


class EmbedRequest(Body):
    """``POST /api/embed``: one text or several; `truncate` (Ollama's default true) cuts a text
    longer than the model takes instead of refusing it."""

    model: NonEmptyStr
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: dict[str, Any] | None = None  # runner options: nothing to change for an encoder
    keep_alive: str | int | None = None


class EmbeddingsRequest(Body):
    """``POST /api/embeddings``, Ollama's older route: one `prompt`, one `embedding` back."""

    model: NonEmptyStr
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | None = None


# -- answers (`serving` builds them; one per line when streamed, the last with done and the counts) -
class _Timed(Answer):
    """The counts and durations (nanoseconds) of a finished answer (Ollama's names)."""
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class CallFunctionOut(Answer):
    name: str
    arguments: dict[str, Any]


class ToolCallOut(Answer):
    function: CallFunctionOut


class MessageOut(Answer):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatAnswer(_Timed):
    model: str
    created_at: str
    message: MessageOut
    done: bool


class GenerateAnswer(_Timed):
    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool


class ModelDetails(Answer):
    parent_model: str | None = None
    format: str | None = None
    family: str | None = None
    families: list[str] | None = None
    parameter_size: str | None = None
    quantization_level: str | None = None


class ModelEntry(Answer):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str | None = None  # (/api/ps)
    size_vram: int | None = None


class ModelList(Answer):
    models: list[ModelEntry]


class ShowAnswer(Answer):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    capabilities: list[str]
    model_info: dict[str, Any]


class VersionAnswer(Answer):
    version: str


class EmbedAnswer(Answer):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingAnswer(Answer):
    embedding: list[float]
