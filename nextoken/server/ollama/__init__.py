"""Ollama's API: request bodies and answers (`protocol`), the translation onto the chat core
(`serving`), its routes, error shape and newline-delimited JSON streams (`router`)."""
