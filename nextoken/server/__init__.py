"""The HTTP server: one app for every model, one chat core under every API.

One package per API (`openai`, `anthropic`, `ollama`)."""
