"""Anthropic's Messages API request bodies (``/v1/messages``, ``/v1/messages/count_tokens``),
with the fields the published schema holds that change nothing here (`PUBLISHED`) and
the MCP connector's ``mcp_servers`` (run by `server.anthropic.mcp`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, model_validator

from nextoken.bodies import BODY, Answer, Body, FiniteFloat, MaxTokens, NonEmptyStr, Published, accept_published, \
    by_field, unset_or
from nextoken.server.api import published
from nextoken.server.api.rules import forbid
from nextoken.server.chat import rules as chat_rules


class ToolConfiguration(Body):
    enabled: bool = True
    allowed_tools: list[str] | None = None


class MCPServer(Body):
    """One entry of ``mcp_servers`` (Anthropic's URL-based MCP server definition)."""
    type: Literal["url"]
    url: NonEmptyStr
    name: NonEmptyStr
    authorization_token: str | None = None
    tool_configuration: ToolConfiguration | None = None


class _Block(Body):
    """What the API lets every block carry beside its content, accepted and not used here:
    prompt-caching marks and the fields the SDK's own block objects dump (as null)."""

    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] = ""
    is_error: bool = False


UserBlock = Annotated[Union[TextBlock, ToolResultBlock], Field(discriminator="type")]
AssistantBlock = Annotated[Union[TextBlock, ToolUseBlock], Field(discriminator="type")]


class UserMessage(Body):
    """A user's turn: text, and the results of the calls the assistant made before it."""
    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(Body):
    """An assistant's turn: text, and the calls it made (tool_use)."""
    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)]


Message = by_field("role", {"user": UserMessage, "assistant": AssistantMessage})


class Tool(Body):
    name: NonEmptyStr
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: NonEmptyStr | None = None
    disable_parallel_tool_use: bool = False


class Metadata(Body):
    user_id: str | None = None


# POST /v1/messages (the `anthropic` SDK's MessageCreateParams)
PUBLISHED = {
    "cache_control": published.CACHE,
    "service_tier": published.TIER, "inference_geo": published.TIER, "speed": published.TIER,
    "workspace_id": published.ACCOUNT, "user_profile_id": published.ACCOUNT,
    "diagnostics": Published("request diagnostics a provider collects"),
    "thinking": Published("a thinking budget: a reasoning model here thinks as its chat template has it (the "
                          "server's --reasoning-parser returns the thought as thinking blocks)"),
    "container": Published("code execution containers", unset_or(), "code execution is not available"),
    "output_config": Published("effort and output format settings", published.empty_or_unset,
                               "output_config is not supported: use tools for structured output"),
}


# the chat rules in the Messages API's names: {"type": "any"} and {"type": "tool"} force a call
CHAT_FIELDS = chat_rules.ChatFields({"type": "object", "required": ["type"],
                                     "properties": {"type": {"enum": ["any", "tool"]}}})


class MessagesRequest(Body):
    model_config = ConfigDict(**BODY, json_schema_extra=forbid(*chat_rules.published(CHAT_FIELDS)))

    model: NonEmptyStr
    max_tokens: Annotated[MaxTokens, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    temperature: FiniteFloat = Field(1.0, ge=0.0, le=1.0)
    top_p: FiniteFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    stop_sequences: Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    mcp_servers: list[MCPServer] | None = None  # the MCP connector (`anthropic.mcp`)
    priority: int = 0  # not Anthropic's: the scheduling priority of vLLM's OpenAI bodies

    @model_validator(mode="before")
    @classmethod
    def _published(cls, data):
        """Anthropic's published fields that change nothing here (`PUBLISHED`)."""
        return accept_published(data, PUBLISHED)


class CountTokensRequest(Body):
    model: NonEmptyStr
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None


# -- answers (`render` builds them; the anthropic SDK's shapes) ----------------------------------
class ThinkingOut(Answer):
    type: Literal["thinking"]
    thinking: str
    signature: str


class TextOut(Answer):
    type: Literal["text"]
    text: str


class ToolUseOut(Answer):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MCPToolUseOut(Answer):
    type: Literal["mcp_tool_use"]
    id: str
    name: str
    server_name: str
    input: dict[str, Any]


class MCPToolResultOut(Answer):
    type: Literal["mcp_tool_result"]
    tool_use_id: str
    is_error: bool
    content: list[TextOut]


ContentBlock = Annotated[Union[ThinkingOut, TextOut, ToolUseOut, MCPToolUseOut, MCPToolResultOut],
                         Field(discriminator="type")]


class MessageUsage(Answer):
    input_tokens: int
    output_tokens: int


class MessageAnswer(Answer):
    """A message (``POST /v1/messages``; streamed, ``message_start`` carries it empty)."""
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(Answer):
    input_tokens: int


# -- the stream's events (`render.MessageRenderer`) ----------------------------------------------
class MessageStart(Answer):
    type: Literal["message_start"]
    message: MessageAnswer


class Ping(Answer):
    type: Literal["ping"]


class BlockStart(Answer):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlock


class TextDelta(Answer):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(Answer):
    type: Literal["thinking_delta"]
    thinking: str


class InputJSONDelta(Answer):
    type: Literal["input_json_delta"]
    partial_json: str


class BlockDelta(Answer):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[Union[TextDelta, ThinkingDelta, InputJSONDelta], Field(discriminator="type")]


class BlockStop(Answer):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(Answer):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None


class OutputUsage(Answer):
    output_tokens: int


class MessageDelta(Answer):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: OutputUsage


class MessageStop(Answer):
    type: Literal["message_stop"]


class ErrorDetail(Answer):
    type: str
    message: str


class StreamError(Answer):
    """The event that ends a stream that could not go on after the 200."""
    type: Literal["error"]
    error: ErrorDetail


StreamEvent = Annotated[Union[MessageStart, Ping, BlockStart, BlockDelta, BlockStop, MessageDelta, MessageStop,
                              StreamError], Field(discriminator="type")]
