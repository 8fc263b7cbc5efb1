"""The published OpenAPI schema, made to say what the server really answers.

FastAPI documents only the success and its own 422; the server answers validation errors with
400 and can refuse any request with the statuses of `Gate`, `BodyLimit` and the engine. This
adds them to every operation with its API's error body (each API's router declares its shape,
`api.ApiShape`), drops the 422 it never sends, and gives /metrics its Prometheus text content
type and each generating route its API's stream.

Bounds that depend on the loaded model (token ids below the vocabulary size, layers, the context
length) are marked ``x-maximum`` by the request models (`nextoken.bodies.model_limit`);
once the model is loaded they become ``maximum``. The schema is kept from then on; while the model
loads it is served with the marks and rebuilt on the next request.
"""

from __future__ import annotations

import copy
import warnings

from nextoken.server.api.routing import OPENAI

REASONS = {400: "Invalid request (the message and param name the field)", 401: "Missing or wrong API key",
           404: "Unknown model or resource", 413: "Request body too large", 429: "Too many requests waiting",
           500: "Internal error", 503: "Loading, shutting down, or the engine stopped"}
PROMETHEUS = "text/plain; version=0.0.4"
# one server-sent event of a stream: ``data:`` holds a JSON chunk, or ``[DONE]`` at the end
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def statuses(path: str, method: str, apis) -> list[int]:
    """The error statuses operation `method` `path` can answer (a generating route of `apis`
    may answer 429)."""
    out = [] if path == "/health" or path.startswith("/inspect/static") else [401]
    if method in ("post", "put", "patch"):
        out += [400, 413]
    elif path.startswith(("/inspect/api", "/v1/watermark")) or "{" in path:
        out += [400]
    if apis.serves(path) or path.startswith(("/v1", "/tokenize", "/detokenize", "/inspect/api")) or "{" in path:
        out += [404]
    if apis.is_generation(path):
        out += [429]
    return sorted(set(out + [500, 503]))


def model_limits(engine) -> dict[str, int]:
    """The values of the ``x-maximum`` marks for `engine` (an `EngineClient`)."""
    most = engine.max_logprobs
    return {"token_id": engine.config.vocab_size - 1, "layer": engine.config.num_layers - 1,
            "head": engine.config.num_heads - 1, "context": engine.max_model_len - 1,
            "logprobs": engine.config.vocab_size if most == -1 else most}


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
    original, apis = app.openapi, app.state.apis
    done: list[dict] = []

    def openapi():
        if done:
            return done[0]
        with warnings.catch_warnings():  # one route serving two methods: its ids are made unique below
            warnings.filterwarnings("ignore", message="Duplicate Operation ID")
            schema = copy.deepcopy(original())
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for router in apis.routers:
            components[router.shape.name] = router.shape.error_schema
        components[OPENAI.name] = OPENAI.error_schema
        seen: set[str] = set()
        for path, ops in schema.get("paths", {}).items():
            ref = {"$ref": "#/components/schemas/" + apis.shape(path).name}
            for method, op in ops.items():
                if op.get("operationId") in seen:  # one route serving two methods: one id each
                    op["operationId"] = op["operationId"].rsplit("_", 1)[0] + "_" + method
                seen.add(op.get("operationId"))
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for code in statuses(path, method, apis):
                    headers = {"Retry-After": {"schema": {"type": "integer"}}} if code == 429 else None
                    resp = {"description": REASONS[code], "content": {"application/json": {"schema": ref}}}
                    if headers:
                        resp["headers"] = headers
                    responses.setdefault(str(code), resp)
        for path, shape in apis.generation_paths():  # "stream": true answers the API's stream
            op = schema.get("paths", {}).get(path, {}).get("post")
            if op is not None:
                kind = shape.stream_media_type
                op["responses"]["200"].setdefault("content", {})[kind] = {
                    "schema": SSE_EVENT if kind == "text/event-stream" else {"type": "string"}}
        metrics = schema.get("paths", {}).get("/metrics", {}).get("get")
        if metrics is not None:
            metrics["responses"]["200"]["content"] = {PROMETHEUS: {"schema": {"type": "string"}}}
        known = limits()
        if known is not None:
            apply_limits(schema, known)
            done.append(schema)
        return schema

    app.openapi = openapi


def guide_table() -> str:
    """The guide's table of the request fields each API publishes and that change nothing here
    (each router's `published`; docs/guide.md, between its ``published-fields`` markers;
    ``python -m nextoken.server.app.openapi`` prints it)."""
    import json

    from nextoken.server.app.routers import published_tables

    rows = ["| route | field | why it changes nothing | values accepted |", "|---|---|---|---|"]
    for route, table in published_tables().items():
        for field, e in table.items():
            if all(e.allows(v) for v in (True, 1, "x", ["x"], {"k": "x"})):
                accepted = "any"
            else:
                accepted = ", ".join(["unset"] + [f"`{json.dumps(v)}`" for v in (False, 0, "", [], {}, ["text"],
                                                                                   "disabled", "none", "auto")
                                                  if e.allows(v)])
            rows.append(f"| `{route}` | `{field}` | {e.note} | {accepted} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(guide_table(), end="")
