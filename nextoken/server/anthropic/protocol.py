"""Anthropic's Messages API request bodies (``/v1/messages``, ``/v1/messages/count_tokens``),
with the fields the published schema holds that change nothing here (`published.MESSAGES`) and
the MCP connector's ``mcp_servers`` (run by `server.anthropic.mcp`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from nextoken.bodies import Body, FiniteFloat, NonEmptyStr, accept_published
from nextoken.server import published


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


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


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


class MessagesRequest(Body):
    model: NonEmptyStr
    max_tokens: int = Field(ge=1)
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
        """Anthropic's published fields that change nothing here (`published.MESSAGES`)."""
        return accept_published(data, published.MESSAGES)


class CountTokensRequest(Body):
    model: NonEmptyStr
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
