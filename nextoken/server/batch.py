"""``nextoken run-batch``: a file of OpenAI batch requests answered offline, as vLLM's
``vllm run-batch`` and OpenAI's Batch API do.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` (OpenAI's batch input
format; `url` one of the server's POST routes: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ...). Each goes through the server's own app in this process (no socket:
`httpx.ASGITransport`), so its answer is the one ``nextoken serve`` gives, with the same checks
and errors; they run concurrently, so the engine batches them. Each output line, in the input's
order, is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``;
a line that is not a request (bad JSON, a missing field, another method, ``stream``) gets
``response`` null and ``error`` ``{"code", "message"}`` naming what is wrong, and the others go
on.
"""

from __future__ import annotations

import asyncio
import json
import uuid

CONCURRENCY = 128  # requests in flight at once (below the server's queue bound, which would answer 429)


def parse_line(number: int, line: str) -> tuple[str | None, dict | str]:
    """``(custom_id, request)`` of input line `number` (1-based), or ``(custom_id, message)``
    naming what is wrong with it."""
    try:
        item = json.loads(line)
    except ValueError as exc:
        return None, f"line {number} is not JSON: {exc}"
    if not isinstance(item, dict):
        return None, f"line {number} is not a JSON object"
    custom_id = item.get("custom_id") if isinstance(item.get("custom_id"), str) else None
    for key, kind in (("custom_id", str), ("url", str), ("body", dict)):
        if not isinstance(item.get(key), kind):
            return custom_id, f"line {number}: {key} must be a {'string' if kind is str else 'JSON object'}"
    if item.get("method", "POST") != "POST":
        return custom_id, f"line {number}: method {item['method']!r}: batch requests are POST"
    if not item["url"].startswith("/"):
        return custom_id, f"line {number}: url {item['url']!r} must be a path such as /v1/chat/completions"
    if item["body"].get("stream"):
        return custom_id, f"line {number}: a batch request cannot stream (stream: true)"
    return custom_id, item


async def answer_all(app, lines: list[str], progress=None) -> list[dict]:
    """The output record of each input line (blank lines skipped), in order, through `app`;
    `progress`: called once per line answered."""
    import httpx

    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                                 timeout=None) as client:
        async def one(number: int, line: str) -> dict:
            custom_id, request = parse_line(number, line)
            record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": None}
            if isinstance(request, str):
                record["error"] = {"code": "invalid_request", "message": request}
            else:
                async with gate:
                    r = await client.post(request["url"], json=request["body"])
                try:
                    body = r.json()
                except ValueError:
                    body = {"error": {"message": r.text}}
                record["response"] = {"status_code": r.status_code, "request_id": uuid.uuid4().hex, "body": body}
            if progress is not None:
                progress()
            return record

        return await asyncio.gather(*(one(n, line) for n, line in enumerate(lines, 1) if line.strip()))


def run_batch(engine_args, server_args, input_text: str) -> list[dict]:
    """Load `engine_args`' model (a generation or an embedding model), serve it as `server_args`
    say, and answer every line of `input_text` (`answer_all`); the output records."""
    from tqdm import tqdm

    from nextoken.engine.async_engine import AsyncLLMEngine
    from nextoken.llm import LLM
    from nextoken.server.api.state import Capabilities, ServerState
    from nextoken.server.app import build_app
    from nextoken.server.pooling.serving import EmbeddingService

    llm = LLM.from_engine_args(engine_args)
    state = ServerState(ready=True)
    embed_only = llm.engine is None
    if embed_only:
        state.embedder = EmbeddingService(llm.embedder)
    else:
        state.engine = AsyncLLMEngine(llm.engine)
    app = build_app(state, server_args.for_model(engine_args.model),
                    capabilities=Capabilities(generate=not embed_only, embed=embed_only))
    lines = input_text.splitlines()
    with tqdm(total=sum(1 for line in lines if line.strip()), desc="Processed requests", unit="request") as bar:
        return asyncio.run(answer_all(app, lines, bar.update))
