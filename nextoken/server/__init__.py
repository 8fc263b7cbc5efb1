"""The HTTP server: one app for every model, one chat core under every API.

    api/        what every API builds on: its router and error shape, the serving base class,
                the server's state, the published fields and the cross-field rules
    chat/       the chat core: prompt, tools, reasoning, the run and its typed events, the
                MCP tool loop
    openai/ anthropic/ ollama/ pooling/   one package per API
    app/        the app over them: middleware, errors, the published schema, the routes of
                no one API, metrics
    serve.py    loading, warming up and draining; replicas.py: several servers behind a router
"""
