"""OpenAI's APIs: request bodies and answers (`protocol`), completions (`completions`), chat
completions (`chat`), their answers' bodies (`render`), the Responses API (`responses`; its
output items and event stream: `responses_render`; MCP tools on the shared tool loop:
`responses_mcp`), and their routes (`router`)."""
