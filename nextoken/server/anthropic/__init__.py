"""Anthropic's Messages API: request bodies and answers (`protocol`), the translation onto the
chat core (`serving`), its answers' blocks and event stream (`render`), the MCP connector on the
shared tool loop (`mcp`), its routes and error shape (`router`)."""
