"""Anthropic's Messages API: request bodies (`protocol`), the translation onto the chat core and
back (`serving`), the MCP connector (`mcp`), its routes and error shape (`router`)."""
