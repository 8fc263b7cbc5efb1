"""OpenAI's APIs: request bodies (`protocol`), completions (`completions`), chat completions
(`chat`), their answers' bodies (`render`), the Responses API (`responses`, with MCP tools run by
the server: `responses_mcp`), and their routes (`router`)."""
