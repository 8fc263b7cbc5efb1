"""The published OpenAPI schema, made to say what the server really answers.

FastAPI documents only the success and its own 422; the server answers validation errors with
400 and can refuse any request with the statuses of `Gate`, `BodyLimit` and the engine. This
adds them to every operation with its API's error body (OpenAI's; Anthropic's under /v1/messages,
Ollama's under /api/), drops the 422 it never sends, and gives
/metrics its Prometheus text content type and the generation routes their event stream.

Bounds that depend on the loaded model (token ids below the vocabulary size, layers, the context
length) are marked ``x-maximum`` by the request models (`nextoken.server.protocol.model_limit`);
once the model is loaded they become ``maximum``. The schema is kept from then on; while the model
loads it is served with the marks and rebuilt on the next request.
"""

from __future__ import annotations

import copy
import warnings

ERROR_BODY = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "integer"}}}},
}
ANTHROPIC_ERROR_BODY = {  # Anthropic's shape, under /v1/messages
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
ANTHROPIC = "/v1/messages"
OLLAMA_ERROR_BODY = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
OLLAMA = "/api/"
NDJSON = ("/api/chat", "/api/generate")  # Ollama's streams: one JSON object per line
REASONS = {400: "Invalid request (the message and param name the field)", 401: "Missing or wrong API key",
           404: "Unknown model or resource", 413: "Request body too large", 429: "Too many requests waiting",
           500: "Internal error", 503: "Loading, shutting down, or the engine stopped"}
GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
QUEUED = GENERATION + ("/api/chat", "/api/generate")  # may answer 429
PROMETHEUS = "text/plain; version=0.0.4"
# one server-sent event of a stream: ``data:`` holds a JSON chunk, or ``[DONE]`` at the end
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def statuses(path: str, method: str) -> list[int]:
    """The error statuses operation `method` `path` can answer."""
    out = [] if path == "/health" or path.startswith("/inspect/static") else [401]
    if method in ("post", "put", "patch"):
        out += [400, 413]
    elif path.startswith(("/inspect/api", "/v1/watermark")) or "{" in path:
        out += [400]
    if path.startswith(("/v1", "/tokenize", "/detokenize", "/inspect/api", "/api/")) or "{" in path:
        out += [404]
    if path in QUEUED:
        out += [429]
    return sorted(set(out + [500, 503]))


def model_limits(engine) -> dict[str, int]:
    """The values of the ``x-maximum`` marks for `engine` (an `LLMEngine`)."""
    return {"token_id": engine.config.vocab_size - 1, "layer": engine.config.num_layers - 1,
            "context": engine.max_model_len - 1}


def apply_limits(node, limits: dict[str, int]) -> None:
    """Replace every ``x-maximum`` mark under `node` (in place) by its ``maximum``."""
    if isinstance(node, dict):
        name = node.pop("x-maximum", None)
        if name is not None:
            node["maximum"] = limits[name]
        for v in node.values():
            apply_limits(v, limits)
    elif isinstance(node, list):
        for v in node:
            apply_limits(v, limits)


def document_errors(app, limits=lambda: None) -> None:
    """Wrap `app.openapi` so that the schema lists every error status of every operation and
    the model's bounds; `limits()` gives `model_limits`, or None while the model loads."""
    original = app.openapi
    done: list[dict] = []

    def openapi():
        if done:
            return done[0]
        with warnings.catch_warnings():  # one route serving two methods: its ids are made unique below
            warnings.filterwarnings("ignore", message="Duplicate Operation ID")
            schema = copy.deepcopy(original())
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"], components["AnthropicError"] = ERROR_BODY, ANTHROPIC_ERROR_BODY
        components["OllamaError"] = OLLAMA_ERROR_BODY
        seen: set[str] = set()
        for path, ops in schema.get("paths", {}).items():
            kind = "AnthropicError" if path.startswith(ANTHROPIC) else \
                "OllamaError" if path.startswith(OLLAMA) else "Error"
            ref = {"$ref": "#/components/schemas/" + kind}
            for method, op in ops.items():
                if op.get("operationId") in seen:  # one route serving two methods: one id each
                    op["operationId"] = op["operationId"].rsplit("_", 1)[0] + "_" + method
                seen.add(op.get("operationId"))
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for code in statuses(path, method):
                    headers = {"Retry-After": {"schema": {"type": "integer"}}} if code == 429 else None
                    resp = {"description": REASONS[code], "content": {"application/json": {"schema": ref}}}
                    if headers:
                        resp["headers"] = headers
                    responses.setdefault(str(code), resp)
        for path in GENERATION:  # "stream": true answers server-sent events
            op = schema.get("paths", {}).get(path, {}).get("post")
            if op is not None:
                op["responses"]["200"].setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
        for path in NDJSON:  # "stream": true (Ollama's default) answers newline-delimited JSON
            op = schema.get("paths", {}).get(path, {}).get("post")
            if op is not None:
                content = op["responses"]["200"].setdefault("content", {})
                content["application/x-ndjson"] = {"schema": {"type": "string"}}
        metrics = schema.get("paths", {}).get("/metrics", {}).get("get")
        if metrics is not None:
            metrics["responses"]["200"]["content"] = {PROMETHEUS: {"schema": {"type": "string"}}}
        known = limits()
        if known is not None:
            apply_limits(schema, known)
            done.append(schema)
        return schema

    app.openapi = openapi
