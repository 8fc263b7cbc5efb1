"""The published OpenAPI schema, made to say what the server really answers.

FastAPI documents only the success and its own 422; the server answers validation errors with
400 and can refuse any request with the statuses of `Gate`, `BodyLimit` and the engine. This
adds them to every operation with the OpenAI error body, drops the 422 it never sends, and gives
/metrics its Prometheus text content type.
"""

from __future__ import annotations

ERROR_BODY = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "integer"}}}},
}
REASONS = {400: "Invalid request (the message and param name the field)", 401: "Missing or wrong API key",
           404: "Unknown model or resource", 413: "Request body too large", 429: "Too many requests waiting",
           500: "Internal error", 503: "Loading, shutting down, or the engine stopped"}
GENERATION = ("/v1/completions", "/v1/chat/completions")
PROMETHEUS = "text/plain; version=0.0.4"


def statuses(path: str, method: str) -> list[int]:
    """The error statuses operation `method` `path` can answer."""
    out = [] if path == "/health" or path.startswith("/inspect/static") else [401]
    if method in ("post", "put", "patch"):
        out += [400, 413]
    elif path.startswith(("/inspect/api", "/v1/watermark")) or "{" in path:
        out += [400]
    if path.startswith(("/v1", "/tokenize", "/detokenize", "/inspect/api")) or "{" in path:
        out += [404]
    if path in GENERATION:
        out += [429]
    return sorted(set(out + [500, 503]))


def document_errors(app) -> None:
    """Wrap `app.openapi` so that the schema lists every error status of every operation."""
    original = app.openapi

    def openapi():
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_BODY
        ref = {"$ref": "#/components/schemas/Error"}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for code in statuses(path, method):
                    headers = {"Retry-After": {"schema": {"type": "integer"}}} if code == 429 else None
                    resp = {"description": REASONS[code], "content": {"application/json": {"schema": ref}}}
                    if headers:
                        resp["headers"] = headers
                    responses.setdefault(str(code), resp)
        metrics = schema.get("paths", {}).get("/metrics", {}).get("get")
        if metrics is not None:
            metrics["responses"]["200"]["content"] = {PROMETHEUS: {"schema": {"type": "string"}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
