"""The FastAPI app: OpenAI-compatible endpoints over `AsyncLLMEngine`.

Every request streams from the one shared engine. A client's mistake is a 4xx in OpenAI's error
shape naming the field, never a 500; a client that disconnects has its request aborted (its KV
blocks freed) within a step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nextoken.beam import async_beam_search
from nextoken.errors import EngineError, InvalidRequest, NotFound, RequestFailed
from nextoken.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nextoken.sampling_params import SamplingParams
from nextoken.server.errors import error_response, validation_message
from nextoken.server.metrics import ServerMetrics
from nextoken.server.openapi import document_errors, model_limits
from nextoken.sample.watermark import detect
from nextoken.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                      TokenizeRequest, WatermarkDetectRequest, WatermarkText)
from nextoken.server import responses as R
from nextoken.server import tools as tools_mod

log = logging.getLogger("nextoken.server")


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    max_queued_requests: int = 256
    max_body_bytes: int = 1 << 20  # 1 MiB
    disconnect_poll_s: float = 0.05
    max_tokens_default: int | None = None  # chat without max_tokens: at most this many (None: the rest of the context)
    inspect: bool = True  # serve the inspector at /inspect (`nextoken.inspect`)


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes (declared or streamed)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge()
            return msg

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await _too_large(self.limit)(scope, receive, send)


class Gate:
    """ASGI middleware: the API key (every route but /health), 503 while draining or loading.

    A pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one wraps ``receive``
    so that ``request.is_disconnected()`` never sees the client hang up."""

    def __init__(self, app, state, config: "ServerConfig"):
        self.app, self.state, self.config = app, state, config
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key is not None else None

    async def __call__(self, scope, receive, send):
        # open: /health, and the inspector's static files (code and styles, no data: a browser
        # loads them without the key; the page and every /inspect/api route need it)
        if scope["type"] == "http" and scope["path"] != "/health" and not scope["path"].startswith("/inspect/static/"):
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope):
        path = scope["path"]
        if self.expected is not None:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if path.startswith("/inspect") and not given:  # a browser page and its event stream: ?key=KEY
                given = b"Bearer " + _query_key(scope)
            if not hmac.compare_digest(given, self.expected):
                return error_response(401, "invalid or missing API key (Authorization: Bearer KEY"
                                           + (", or ?key=KEY on /inspect)" if path.startswith("/inspect") else ")"))
        if self.state.draining:
            return error_response(503, "the server is shutting down")
        if self.state.engine is None and path.startswith(("/v1", "/inspect/api")):
            return error_response(503, "the model is still loading")
        return None


def _query_key(scope) -> bytes:
    from urllib.parse import parse_qs

    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", [])
    return values[0].encode("latin-1") if values else b""


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int):
    return error_response(413, f"the request body is larger than {limit} bytes")


def build_app(state, config: ServerConfig, lifespan=None) -> FastAPI:
    """`state` has ``engine`` (an `AsyncLLMEngine`, None while loading), ``draining`` and
    ``started`` (a Unix time)."""
    app = FastAPI(title="nextoken", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = state
    metrics = ServerMetrics(config.model_name)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(Gate, state=state, config=config)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return error_response(400, msg, param)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_, exc: InvalidRequest):
        return error_response(exc.status, str(exc), exc.field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):  # 404, 405 (with its Allow header), ...
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    def engine():
        return state.engine

    def check_model(name: str | None):
        if name is not None and name != config.model_name:
            raise NotFound(f"model {name!r} not found; this server serves {config.model_name!r}", "model")

    def check_queue():
        if engine().num_waiting >= config.max_queued_requests:
            raise _QueueFull()

    if config.inspect:
        from nextoken.inspect.routes import build_router

        app.include_router(build_router(engine))

    @app.exception_handler(_QueueFull)
    async def _qf(_, exc):
        return error_response(429, f"too many requests waiting (limit {config.max_queued_requests}); retry later",
                              headers={"Retry-After": "1"})

    @app.exception_handler(EngineError)
    async def _engine_error(_, exc):
        return error_response(503, str(exc))

    @app.exception_handler(RequestFailed)
    async def _request_failed(_, exc):  # this request's fault in the model: the server stays up
        return error_response(exc.status, str(exc))

    # -- info -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        eng = state.engine
        if state.draining:
            return error_response(503, "the server is shutting down")
        if eng is None:
            return error_response(503, "the model is still loading")
        if not eng.is_running:
            return error_response(503, f"the engine loop has stopped: {eng.dead!r}")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from nextoken import __version__

        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "nextoken",
                                            "max_model_len": engine().engine.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        stats = engine().engine.stats() if state.engine else {"running": 0, "waiting": 0, "kv_cache_usage": 0.0,
                                                              "prefix_cache_hit_rate": 0.0}
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/get_load")
    async def get_load():
        """SGLang's load report, read by the routers derived from SGLang's (vllm-router's
        ``/get_loads``, its ``power_of_two`` policy): the requests running plus waiting."""
        stats = engine().engine.stats()
        return {"load": stats["running"] + stats["waiting"], "num_reqs": stats["running"],
                "num_waiting_reqs": stats["waiting"]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's tokenizer description (lm-evaluation-harness's ``tokenizer_backend=remote``
        reads it, then tokenizes through /tokenize)."""
        eng = engine().engine
        tok = eng.tokenizer

        def text(i):
            return tok.tokens[i] if i is not None else None

        return {"tokenizer_class": "nextoken", "eos_token": text(tok.eos_token_id), "bos_token": text(tok.bos_token_id),
                "pad_token": None, "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
                "model_max_length": eng.max_model_len, "vocab_size": eng.config.vocab_size}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        eng = engine().engine
        if isinstance(body, TokenizeChatRequest):
            ids = R.encode_chat(eng.tokenizer, tools_mod.messages_for_template(
                [m.model_dump(exclude_none=True) for m in body.messages]))
        else:
            ids = eng.tokenizer.encode(body.prompt, add_bos=None if body.add_special_tokens else False,
                                       parse_special=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": eng.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        eng = engine().engine
        _check_token_ids(eng, body.tokens)
        return {"prompt": eng.tokenizer.decode(body.tokens)}

    # -- generation -------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        check_queue()
        eng = engine()
        prompts = R.completion_prompts(eng.engine, body.prompt)
        structured = body.structured()
        await _compile(eng, structured)
        if body.use_beam_search:
            outs = await _beam(eng, body, [ids for ids, _ in prompts], body.generation_limit() or 16,
                               body.logprobs is not None or body.echo or body.prompt_logprobs is not None)
            return R.completion_response(eng.engine, body, outs, prompts, int(time.time()), config.model_name)
        rids = []
        try:
            for ids, text in prompts:
                params = body.sampling_params(body.generation_limit(), body.logprobs, structured,
                                              body.scored_prompt())
                rids.append(await eng.add_request(ids, params, f"cmpl-{uuid.uuid4().hex}", text))
        except BaseException:
            for rid in rids:
                eng.abort(rid)
            raise
        created = int(time.time())
        if body.stream:
            return _sse(R.stream_completion(eng, body, rids, prompts, created, config.model_name, metrics))
        outs = await _collect(eng, rids, request, config.disconnect_poll_s)
        for o in outs:
            metrics.observe(o)
            R.log_request(o)
        return R.completion_response(eng.engine, body, outs, prompts, created, config.model_name)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        check_queue()
        eng = engine()
        for name in ("max_tokens", "max_completion_tokens"):
            limit = getattr(body, name)
            if limit is not None and limit >= eng.engine.max_model_len:
                raise InvalidRequest(f"{name} is {limit}: no room for the prompt in the context length "
                                     f"{eng.engine.max_model_len} (max_model_len)", name)
        tok = eng.engine.tokenizer
        messages = tools_mod.messages_for_template([m.model_dump(exclude_none=True) for m in body.messages])
        tools, forced = _tool_setup(body, tok)
        ids = R.encode_chat(tok, messages, tools)
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            R.default_max_tokens(eng.engine, len(ids), config.max_tokens_default)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        if body.use_beam_search:
            if tools:
                raise InvalidRequest("tools cannot be combined with use_beam_search", "tools")
            body.structured()  # refuses a constraint with beam search
            out = (await _beam(eng, body, [ids], max_tokens, body.logprobs))[0]
            return R.chat_response(eng.engine, body, out, int(time.time()), config.model_name)
        structured = body.structured()
        if forced is not None:
            if structured is not None:
                raise InvalidRequest("tool_choice 'required' or a named function cannot be combined with another "
                                     "output constraint", "tool_choice")
            structured = forced
        await _compile(eng, structured)
        params = body.sampling_params(max_tokens, logprobs, structured)
        rid = await eng.add_request(ids, params, f"chatcmpl-{uuid.uuid4().hex}")
        created = int(time.time())
        names = frozenset(t["function"]["name"] for t in tools) if tools else None
        if body.stream:
            return _sse(R.stream_chat(eng, body, rid, created, config.model_name, metrics, names))
        out = (await _collect(eng, [rid], request, config.disconnect_poll_s))[0]
        metrics.observe(out)
        R.log_request(out)
        return R.chat_response(eng.engine, body, out, created, config.model_name, names)

    @app.post("/v1/watermark/detect")
    async def watermark_detect(body: WatermarkDetectRequest):
        check_model(body.model)
        eng = engine().engine
        if isinstance(body, WatermarkText):
            ids = eng.tokenizer.encode(body.text, add_bos=False, parse_special=False)
        else:
            ids = _check_token_ids(eng, body.tokens)
        res = await asyncio.to_thread(detect, ids, eng.config.vocab_size, eng.watermark.gamma, body.z_threshold)
        return {**dataclasses.asdict(res), "gamma": eng.watermark.gamma}

    document_errors(app, lambda: None if state.engine is None else model_limits(state.engine.engine))
    return app


async def _beam(eng, body, prompts: list[list[int]], max_tokens: int, unsupported: bool) -> list[RequestOutput]:
    """Beam search for a request with ``use_beam_search``: `best_of` beams (default `n`), the `n`
    best returned as its choices (best first)."""
    width = body.best_of or body.n
    if body.stream:
        raise InvalidRequest("use_beam_search cannot stream", "stream")
    if body.n > width:
        raise InvalidRequest(f"n ({body.n}) must not exceed best_of ({width}) with use_beam_search", "n")
    if unsupported:
        raise InvalidRequest("use_beam_search does not return logprobs or echo the prompt", "use_beam_search")
    for ids in prompts:
        eng.engine.encode_prompt(ids, SamplingParams(max_tokens=max_tokens))  # the context check
    start = time.perf_counter()
    results = await async_beam_search(eng, prompts, width, max_tokens, body.length_penalty, body.ignore_eos)
    outs = []
    eog = eng.engine.tokenizer.eog_token_ids
    for ids, res in zip(prompts, results):
        comps = [CompletionOutput(i, text=b.text, token_ids=b.token_ids, cumulative_logprob=b.cumulative_logprob,
                                  finish_reason="stop" if b.token_ids and b.token_ids[-1] in eog else "length")
                 for i, b in enumerate(res.sequences[: body.n])]
        metrics = RequestMetrics(start, len(ids), 0, sum(len(c.token_ids) for c in comps), None, time.perf_counter())
        outs.append(RequestOutput(f"beam-{uuid.uuid4().hex}", None, ids, comps, True, metrics))
    return outs


def _check_token_ids(eng, ids: list[int]) -> list[int]:
    """`ids`, or `InvalidRequest` (field "tokens") naming the first outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < eng.config.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {eng.config.vocab_size})", "tokens")
    return ids


def _tool_setup(body, tok):
    """``(tools for the template or None, the grammar forcing calls or None)`` of a chat
    request. Raises `InvalidRequest` for a tool_choice without tools and for a model whose chat
    template cannot render tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        return None, None
    if choice == "none":
        return None, None
    if not tools_mod.supports_tools(tok.chat_template):
        raise InvalidRequest("this model's chat template has no tool-call support (it renders no tools in a "
                             "<tool_call> format); start the server with --chat-template FILE naming a template "
                             "that has one", "tools")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if choice is None or choice == "auto":
        return tools, None
    name = None if choice == "required" else choice.function.name
    return tools, tools_mod.forced_grammar(tok, tools, name, body.parallel_tool_calls)


async def _compile(eng, structured) -> None:
    """Compile a request's grammar (cached) in a worker thread, off the event loop and before
    the request reaches the step loop. Raises `InvalidRequest` for an invalid one."""
    if structured is not None:
        await asyncio.to_thread(eng.engine.grammars.compile, structured)


class _QueueFull(Exception):
    pass


def _sse(gen):
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(eng, rids: list[str], request: Request, poll_s: float):
    """Final outputs of `rids`; aborts them all if the client disconnects first."""

    async def last(rid):
        out = None
        async for out in eng.stream(rid):
            pass
        return out

    task = asyncio.gather(*(last(r) for r in rids))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                for r in rids:
                    eng.abort(r)
                raise asyncio.CancelledError()
    except asyncio.CancelledError:
        task.cancel()
        for r in rids:
            eng.abort(r)
        raise
