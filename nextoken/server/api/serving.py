"""What every generation route of every API shares (`ApiServing`, as vLLM's ``OpenAIServing``):
the engine, the served model's name, the queue limit, grammars compiled off the event loop,
waiting for final outputs while watching the client, beam search, and the record of a finished
request. Each API's serving classes build on it (`server.openai`, `server.anthropic`, `server.ollama`)."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from nextoken.beam import BeamSearch
from nextoken.engine.protocol import EngineClient
from nextoken.errors import InvalidRequest, NotFound
from nextoken.outputs import RequestOutput
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams
from nextoken.server.args import ServerArgs
from nextoken.server.api.state import ServerState

log = logging.getLogger("nextoken.server")


class QueueFull(Exception):
    """More requests wait than ``--max-queued-requests``: a 429 (`server.app`)."""


class ClientGone(Exception):
    """The client hung up before its answer was ready: its requests are aborted, and nothing is
    sent (`server.app` answers 499, as nginx logs such a request, without a traceback)."""


def client_of(request) -> str:
    """Who sent `request` (a FastAPI `Request`), for the fair scheduling policy when the body
    names no user: its API key (``Authorization: Bearer``, or Anthropic's ``x-api-key``), or ""."""
    headers = getattr(request, "headers", None) or {}
    auth = headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return f"key:{key}" if key else ""


REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def valid_request_id(value: str | None) -> str | None:
    """`value` (an ``X-Request-Id`` header) when it is 1-128 letters, digits or ``._:-``, else None
    (a header of other characters is ignored rather than put in ids and logs)."""
    return value if value is not None and REQUEST_ID.fullmatch(value) else None


def new_request_id(prefix: str, request) -> str:
    """An engine request id for `request` (a FastAPI `Request`): `prefix`, then its id as the
    client sent it in ``X-Request-Id`` (as vLLM reads it) or as ``--enable-request-id-headers``
    answers it (`server.app.middleware.RequestIdHeader`), and 8 random hex digits (ids stay
    unique when a client sends one twice); without either, 32 random hex digits."""
    state = getattr(request, "state", None)
    given = getattr(state, "request_id", None) if state is not None else None
    headers = getattr(request, "headers", None) or {}
    given = given or valid_request_id(headers.get("x-request-id"))
    return f"{prefix}{given}-{uuid.uuid4().hex[:8]}" if given else f"{prefix}{uuid.uuid4().hex}"


def no_lora_beams(lora) -> None:
    """Beam search runs on the base model only: refuse it for a LoRA adapter's name."""
    if lora is not None:
        raise InvalidRequest(f"beam search is not available with a LoRA adapter ({lora.lora_name!r})",
                             "use_beam_search")


class ApiServing:
    """state: the server's `ServerState` (``engine``: an `EngineClient`, None while loading);
    args: the `ServerArgs`; metrics: the `ServerMetrics` finished requests are recorded in."""

    def __init__(self, state: ServerState, args: ServerArgs, metrics):
        self.state, self.args, self.metrics = state, args, metrics

    @property
    def engine(self) -> EngineClient:
        """The `EngineClient` (the Gate middleware answers 503 before any route while loading)."""
        return self.state.engine

    def check_model(self, name: str | None):
        """The `LoRARequest` a request's ``model`` names (None: the base model). Raises
        `NotFound` for a name this server does not serve."""
        if name is None or name == self.args.model_name or name in self.args.model_aliases:
            return None
        lora = getattr(self.state, "loras", {}).get(name)
        if lora is None:
            served = ", ".join(repr(n) for n in [self.args.model_name, *self.args.model_aliases,
                                                 *getattr(self.state, "loras", {})])
            raise NotFound(f"model {name!r} not found; this server serves {served}", "model")
        return lora

    def check_queue(self) -> None:
        if self.engine.num_waiting >= self.args.max_queued_requests:
            raise QueueFull()

    async def compile(self, structured) -> None:
        """Compile a request's grammar (cached) in a worker thread, off the event loop and before
        the request reaches the step loop. Raises `InvalidRequest` for an invalid one."""
        if structured is not None:
            await asyncio.to_thread(self.engine.compile_grammar, structured)

    def record(self, outs) -> None:
        """A finished request's metrics and its log line."""
        for out in outs:
            self.metrics.observe(out)
            log_request(out)

    async def collect(self, rids: list[str], request: Request) -> list[RequestOutput]:
        """Final outputs of `rids`; aborts them all and raises `ClientGone` if the client
        disconnects first (a cancelled handler aborts them too)."""
        eng = self.engine

        async def last(rid):
            out = None
            async for out in eng.stream(rid):
                pass
            return out

        task = asyncio.gather(*(last(r) for r in rids))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.args.disconnect_poll_s)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    _abandon(task, rids, eng)
                    raise ClientGone()
        except asyncio.CancelledError:
            _abandon(task, rids, eng)
            raise

    async def beam(self, body, prompts: list[list[int]], max_tokens: int, request=None) -> list[RequestOutput]:
        """Beam search for a request with ``use_beam_search``: `best_of` beams (default `n`), the
        `n` best returned as its choices (best first; the rules table refuses what beam search
        does not return), each prompt's search driven by the engine with the request's priority
        (`EngineClient.beam_search`)."""
        width = body.best_of or body.n
        if body.n > width:
            raise InvalidRequest(f"n ({body.n}) must not exceed best_of ({width}) with use_beam_search", "n")
        eng = self.engine
        for ids in prompts:
            eng.encode_prompt(ids, SamplingParams(max_tokens=max_tokens))  # the context check
        eog = eng.tokenizer.eog_token_ids
        options = RequestOptions(priority=body.priority, client=f"user:{body.user}" if body.user else client_of(request))
        outs = await asyncio.gather(*(eng.beam_search(ids, BeamSearch([ids], width, max_tokens, body.length_penalty,
                                                                      body.ignore_eos, eog),
                                                      new_request_id("beam-", request), options)
                                      for ids in prompts))
        for out in outs:
            out.outputs[:] = out.outputs[: body.n]
            out.metrics.num_output_tokens = sum(len(c.token_ids) for c in out.outputs)
        return list(outs)


def _abandon(task: asyncio.Future, rids: list[str], eng) -> None:
    """Stop waiting for `rids` (their outputs will never be read) and abort them."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" log
    for r in rids:
        eng.abort(r)


def sse_response(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def check_token_ids(engine, ids: list[int]) -> list[int]:
    """`ids`, or `InvalidRequest` (field "tokens") naming the first outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < engine.config.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {engine.config.vocab_size})", "tokens")
    return ids


def log_request(out) -> None:
    """One log line per finished request: id, tokens in and out, TTFT, total time."""
    m = out.metrics
    total = (m.finished_time - m.arrival_time) if m.finished_time else float("nan")
    ttft = f"{m.ttft:.3f}s" if m.ttft is not None else "-"
    log.info("request %s prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs finish=%s", out.request_id,
             m.num_prompt_tokens, m.num_output_tokens, ttft, total,
             ",".join(str(c.finish_reason) for c in out.outputs))
