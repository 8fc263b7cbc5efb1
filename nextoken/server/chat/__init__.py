"""The chat core under every chat-like API: a request as a `ChatSpec` prepared once (`core`:
template and prompt ids from `prompts`, tools from `tools`, the rules every chat API shares from
`rules`, bounds, grammar), run on the engine (`run`), split into thought (`reasoning`), text
and tool calls (`tools`) as typed events (`events`); the MCP tool loop (`tool_loop`, over
`mcp_tools`)."""
