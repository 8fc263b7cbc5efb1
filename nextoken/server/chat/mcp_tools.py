"""MCP tools the server runs (OpenAI's Responses ``{"type": "mcp"}`` tools, Anthropic's
``mcp_servers``; the loop that runs them is `tool_loop`): list a remote MCP server's tools, and
call one, with the `mcp` package's client over streamable HTTP.

A server URL is reached only when one of ``serve --allow-mcp-url PATTERN`` (globs, default none)
matches it; each listing and each call has ``--mcp-timeout`` seconds, and an output larger than
``--mcp-max-output-bytes`` is an error, not a truncation. Failures of the MCP server (down,
hanging, refusing, too large) come back as `MCPFailure`, which the tool loop turns into
an ``error`` on the item (a call) or a 424 naming the server (a listing), never a 500.
"""

from __future__ import annotations

import asyncio
import fnmatch
import importlib.util
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from nextoken.bodies import Body, NonEmptyStr
from nextoken.errors import DependencyFailed, InvalidRequest


class MCPToolFilter(Body):
    tool_names: list[str] | None = None
    read_only: bool | None = None


class MCPApprovalFilter(Body):
    always: MCPToolFilter | None = None
    never: MCPToolFilter | None = None


class MCPTool(Body):
    """A remote MCP server's tools offered to the model (OpenAI's Responses ``mcp`` tool)."""

    type: Literal["mcp"]
    server_label: NonEmptyStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    server_url: NonEmptyStr
    server_description: str | None = None
    allowed_tools: list[str] | MCPToolFilter | None = None
    require_approval: Literal["always", "never"] | MCPApprovalFilter | None = None  # OpenAI's default: always
    headers: dict[str, str] | None = None

    def allows(self, name: str) -> bool:
        """Whether the request lets the model use tool `name` of this server."""
        a = self.allowed_tools
        names = a if isinstance(a, list) else a.tool_names if a is not None else None
        return names is None or name in names

    def needs_approval(self, name: str) -> bool:
        r = self.require_approval
        if r is None or r == "always":
            return True
        if r == "never":
            return False
        if r.never is not None and r.never.tool_names is not None and name in r.never.tool_names:
            return False
        if r.always is not None and r.always.tool_names is not None:
            return name in r.always.tool_names
        return r.never is None


class MCPFailure(Exception):
    """An MCP server that could not list or run a tool (its words in the message)."""


@dataclass(frozen=True)
class Limits:
    allowed: tuple[str, ...]
    timeout: float
    max_output_bytes: int


def check_allowed(tool: MCPTool, field: str, limits: Limits) -> None:
    """Raises `InvalidRequest` naming `field` (the request's URL field) for a URL no pattern allows."""
    if not any(fnmatch.fnmatchcase(tool.server_url, p) for p in limits.allowed):
        hint = "none are allowed (serve --allow-mcp-url PATTERN)" if not limits.allowed else \
            f"allowed: {', '.join(limits.allowed)}"
        raise InvalidRequest(f"MCP server URL {tool.server_url!r} is not allowed on this server; {hint}", field)


def _client(tool: MCPTool, limits: Limits):
    from mcp import Client
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    import httpx2  # the mcp package's HTTP client

    http = create_mcp_http_client(headers=tool.headers or None, timeout=httpx2.Timeout(limits.timeout))
    return Client(streamable_http_client(tool.server_url, http_client=http), read_timeout_seconds=limits.timeout)


async def _bounded(coro, tool: MCPTool, what: str, limits: Limits):
    try:
        return await asyncio.wait_for(coro, limits.timeout)
    except asyncio.TimeoutError:
        raise MCPFailure(f"MCP server {tool.server_label!r} did not {what} within {limits.timeout:g} s") from None
    except MCPFailure:
        raise
    except Exception as exc:  # noqa: BLE001 - a remote server: any failure is its answer
        raise MCPFailure(f"MCP server {tool.server_label!r} ({tool.server_url}) could not {what}: "
                         f"{type(exc).__name__}: {exc}"[:500]) from None


async def list_tools(tool: MCPTool, limits: Limits) -> list[dict]:
    """The server's tools the request allows, as OpenAI's ``mcp_list_tools`` item lists them
    (name, description, input_schema, annotations). Raises `MCPFailure`."""
    async def run():
        async with _client(tool, limits) as c:
            return (await c.list_tools()).tools

    listed = await _bounded(run(), tool, "list its tools", limits)
    return [{"name": t.name, "description": t.description or "", "input_schema": _schema(t),
             "annotations": _annotations(t)} for t in listed if tool.allows(t.name)]


async def call_tool(tool: MCPTool, name: str, arguments: dict[str, Any], limits: Limits) -> str:
    """The text of tool `name`'s result (text blocks joined, else its structured content as
    JSON). Raises `MCPFailure` for a failed call, an error result or an output past the limit."""
    async def run():
        async with _client(tool, limits) as c:
            return await c.call_tool(name, arguments, read_timeout_seconds=limits.timeout)

    result = await _bounded(run(), tool, f"run {name!r}", limits)
    texts = [b.text for b in result.content if getattr(b, "type", None) == "text"]
    text = "".join(texts) if texts else json.dumps(getattr(result, "structured_content", None))
    if len(text.encode()) > limits.max_output_bytes:
        raise MCPFailure(f"MCP tool {name!r} returned {len(text.encode())} bytes, over this server's limit of "
                         f"{limits.max_output_bytes} (--mcp-max-output-bytes)")
    if result.is_error:
        raise MCPFailure(text or f"MCP tool {name!r} failed")
    return text


def server_limits(args, field: str = "tools") -> Limits:
    """The server's MCP limits (`ServerArgs`); raises `InvalidRequest` naming `field` when the
    `mcp` package is missing."""
    if importlib.util.find_spec("mcp") is None:
        raise InvalidRequest("MCP tools need the mcp package on the server: pip install 'nextoken[mcp]'", field)
    return Limits(tuple(args.allow_mcp_url or ()), args.mcp_timeout, args.mcp_max_output_bytes)


async def listings(servers, limits: Limits, field: str = "tools") -> tuple[list[dict], dict[str, MCPTool], list[dict]]:
    """(the mcp_list_tools items, tool name -> its server, the tools in OpenAI chat's shape)."""
    items, owners, offered = [], {}, []
    for i, t in servers:
        try:
            listed = await list_tools(t, limits)
        except MCPFailure as exc:
            raise DependencyFailed(str(exc), f"{field}[{i}]") from None
        items.append({"type": "mcp_list_tools", "id": item_id("mcpl"), "server_label": t.server_label,
                      "tools": listed, "error": None})
        for tool in listed:
            if tool["name"] in owners:
                continue  # the first server offering a name keeps it
            owners[tool["name"]] = t
            offered.append({"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                                             "parameters": tool["input_schema"]}})
    return items, owners, offered


async def run_call(tool: MCPTool, name: str, arguments: str, limits: Limits) -> tuple[str | None, str | None]:
    """Run one call: (its output, None), or (None, the error: arguments that are not a JSON object,
    a failure of the server). Never raises for the server's faults."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(args, dict):
            raise MCPFailure(f"the arguments of {name!r} are not a JSON object")
        return await call_tool(tool, name, args, limits), None
    except json.JSONDecodeError:
        return None, f"the arguments of {name!r} are not JSON: {arguments[:200]}"
    except MCPFailure as exc:
        return None, str(exc)


def _schema(t) -> dict:
    schema = getattr(t, "input_schema", None) or getattr(t, "inputSchema", None)
    return schema if isinstance(schema, dict) else {"type": "object", "properties": {}}


def _annotations(t) -> dict | None:
    a = getattr(t, "annotations", None)
    return a.model_dump(exclude_none=True) if a is not None else None


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
