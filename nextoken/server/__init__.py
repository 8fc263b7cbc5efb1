"""The OpenAI-compatible HTTP server (`nextoken serve`)."""
