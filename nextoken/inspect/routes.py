"""The inspector's HTTP side: the page at ``GET /inspect`` and its JSON endpoints under
``/inspect/api/`` (in the OpenAPI schema, tag "inspector"), plus one server-sent-events stream
for the live views. Nothing leaves the process; the routes write nothing but the inspector's own
memory (the last traces) and, for the demo, requests like any client's.

Model computations that need a forward pass (attention traces, the logit lens, the sampling
playground) run as requests of the engine (`AsyncLLMEngine.generate`, with a `TraceRecorder` or
``return_logits``): scheduled, abortable and counted like any other. Everything else reads the loaded
weights or the engine's state between steps.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import Field

from nextoken.bodies import SEED_LIMIT, Body, TokenId, model_limit
from nextoken.errors import InvalidRequest, NotFound
from nextoken.inspect import engine_view, interventions, journey, measure_routes, model_view, text
from nextoken.inspect.context import InspectContext, context_of
from nextoken.inspect.trace import (LABEL_RULE, MAX_TRACE_TOKENS, attention_payload, head_stats, lens_grid,
                                    logit_lens)
from nextoken.trace.recorder import TraceRecorder
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams

STATIC = os.path.join(os.path.dirname(__file__), "static")
LIVE_INTERVAL_S = 0.25
DEMO_PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?", "Count from one to ten.",
                "Name three primary colors.", "Explain gravity in one sentence.", "Say hello in four languages.",
                "What is 12 times 12?", "List the planets of the solar system."]


# a word: 1..64 characters (`text.word_token` says whether it is one token)
Word = Annotated[str, Field(min_length=1, max_length=text.MAX_WORD_CHARS)]


class TokenizeBody(Body):
    text: str = Field(min_length=1, max_length=text.MAX_TEXT_CHARS)
    chat: bool = False


class WordBody(Body):
    word: Word


class WordsBody(Body):
    words: list[Word] = Field(min_length=3, max_length=text.MAX_WORDS)


class AnalogyBody(Body):
    a: Word = "king"
    b: Word = "man"
    c: Word = "woman"
    target: Word = "queen"
    top: int = Field(10, ge=1, le=50)


class TraceBody(Body):
    prompt: str = Field(min_length=1, max_length=text.MAX_TEXT_CHARS)
    chat: bool = False


class SampleBody(Body):
    prompt: str = Field("It was a beautiful", min_length=1, max_length=text.MAX_TEXT_CHARS)
    generated: list[TokenId] = Field(default_factory=list, max_length=64)
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_k: int = Field(-1, ge=-1, le=1000)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=3.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int = Field(0, ge=0, le=SEED_LIMIT)
    json_schema: dict | None = Field(None, description="a JSON schema the output follows (its mask shown as a stage)")
    regex: str | None = Field(None, min_length=1, max_length=text.MAX_TEXT_CHARS,
                              description="a regular expression the whole output matches (instead of json_schema)")


class JourneyBody(SampleBody):
    """One step of a prompt's journey: the prompt, the tokens generated so far, the sampler's settings."""

    prompt: str = Field("The capital of France is", min_length=1, max_length=text.MAX_TEXT_CHARS)
    chat: bool = False
    generated: list[TokenId] = Field(default_factory=list, max_length=256)
    temperature: float = Field(0.0, ge=0.0, le=5.0)


class BranchBody(JourneyBody):
    """A branch point of a journey: its tokens before the clicked one (`generated`), how many
    alternatives to show and how long each one's greedy preview runs."""

    alternatives: int = Field(5, ge=1, le=10)
    preview: int = Field(10, ge=1, le=16)


class TrajectoryBody(JourneyBody):
    """An alternative trajectory: the journey's tokens before the branch point (`generated`), the
    token chosen there instead (`token`), and how long to continue with the sampler's settings."""

    token: TokenId
    max_tokens: int = Field(16, ge=1, le=64)


class BeamBody(Body):
    prompt: str = Field("The best thing about", min_length=1, max_length=text.MAX_TEXT_CHARS)
    beam_width: int = Field(3, ge=1, le=6)
    max_tokens: int = Field(6, ge=1, le=12)
    length_penalty: float = Field(1.0, ge=0.0, le=3.0)


class RunBody(Body):
    prompt: str = Field("The three most important inventions are", min_length=1, max_length=text.MAX_TEXT_CHARS)
    max_tokens: int = Field(32, ge=1, le=256)
    chat: bool = False


class DemoBody(Body):
    count: int = Field(6, ge=1, le=16)
    max_tokens: int = Field(48, ge=1, le=256)


@functools.lru_cache(maxsize=2)
def _stored(path: str) -> dict:
    return model_view.stored_tensors(path)


router = APIRouter(tags=["inspector"])


def install(app, get_engine) -> None:
    """Serve the inspector on `app`: its page, static files and ``/inspect/api`` routes, over the
    engine `get_engine()` returns."""
    app.state.inspector = InspectContext(get_engine)
    app.include_router(router)
    app.include_router(measure_routes.router)
    app.include_router(interventions.router)


@router.get("/inspect", include_in_schema=False)
async def page(request: Request):
    return FileResponse(os.path.join(STATIC, "index.html"), media_type="text/html")

@router.get("/inspect/static/{name}", include_in_schema=False)
async def static(request: Request, name: str):
    path = os.path.join(STATIC, os.path.basename(name))
    if not os.path.isfile(path) or name != os.path.basename(name):
        raise InvalidRequest(f"no file {name!r}", "name")
    kind = {"js": "text/javascript", "css": "text/css", "png": "image/png"}.get(name.rsplit(".", 1)[-1], "text/plain")
    return FileResponse(path, media_type=kind)

@router.get("/inspect/api/info", summary="The loaded model and the inspector's limits")
async def info(request: Request):
    eng = context_of(request).core()
    return {"model": eng.args.model, "architecture": eng.config.architecture, "name": eng.config.name,
            "vocab_size": eng.config.vocab_size, "max_trace_tokens": MAX_TRACE_TOKENS,
            "has_chat_template": bool(eng.tokenizer.chat_template), "label_rule": LABEL_RULE,
            "speculative": None if eng.speculative is None else eng.speculative.method,
            "gguf": str(eng.model_path).endswith(".gguf")}

@router.post("/inspect/api/tokenize", summary="Tokens of a text (ids, pieces, bytes, special tokens)")
async def tokenize(request: Request, body: TokenizeBody):
    return text.tokens_view(context_of(request).core().tokenizer, body.text, body.chat)

@router.post("/inspect/api/bpe", summary="Replay of the BPE merges that build one word")
async def bpe(request: Request, body: WordBody):
    return text.bpe_replay(context_of(request).core().tokenizer, body.word)

@router.post("/inspect/api/embeddings", summary="2D PCA of the embedding rows of a word list")
async def embeddings(request: Request, body: WordsBody):
    eng = context_of(request).whole_model()
    return await asyncio.to_thread(text.embedding_map, eng.model, eng.tokenizer, body.words)

@router.post("/inspect/api/analogy", summary="a - b + c on the embedding table: nearest tokens, rank of target")
async def analogy(request: Request, body: AnalogyBody):
    eng = context_of(request).whole_model()
    return await asyncio.to_thread(text.analogy, eng.model, eng.tokenizer, body.a, body.b, body.c,
                                   body.target, body.top)

@router.get("/inspect/api/rope", summary="The model's RoPE angles and tables, and their decay with distance")
async def rope(request: Request, positions: int = Query(64, ge=2, le=model_view.MAX_POSITIONS)):
    return model_view.rope_view(context_of(request).core().model, positions)

@router.get("/inspect/api/sinusoidal", summary="The original sinusoidal encoding (not used by the model)")
async def sinusoidal(request: Request, base: float = Query(10000.0, ge=2, le=1e6), positions: int = Query(50, ge=1, le=512),
                     dims: int = Query(64, ge=2, le=512, multiple_of=2)):
    return model_view.sinusoidal(base, positions, dims)

@router.get("/inspect/api/architecture", summary="Layers, sizes, parameters and bytes per part")
async def architecture(request: Request):
    return model_view.architecture(context_of(request).whole_model(), context_of(request).state.last_layer_ms)

@router.post("/inspect/api/trace", summary="Trace a prompt: tokens, head labels, time per layer")
async def trace(request: Request, body: TraceBody):
    eng = context_of(request).core()
    ids = context_of(request).encode(body.prompt, body.chat, MAX_TRACE_TOKENS)
    tracer = TraceRecorder(eng.config)
    start = time.perf_counter()
    await context_of(request).run_traced(ids, SamplingParams(temperature=0, max_tokens=1), tracer)
    ms = (time.perf_counter() - start) * 1000
    tokens = [{"id": i, "token": text.display(eng.tokenizer.token_text(i)), "special": i in eng.tokenizer.special_ids}
              for i in ids]
    tid = context_of(request).state.keep(tracer, tokens)
    cfg = eng.config
    labels = await asyncio.to_thread(lambda: [head_stats(tracer, layer) for layer in range(cfg.num_layers)])
    return {"trace_id": tid, "tokens": tokens, "layers": cfg.num_layers, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "sliding_layers": cfg.sliding_layers, "sliding_window": cfg.sliding_window,
            "labels": labels, "label_rule": LABEL_RULE, "layer_ms": [round(x, 3) for x in tracer.layer_ms],
            "passes": tracer.passes, "trace_ms": round(ms, 2)}

@router.get("/inspect/api/trace/{trace_id}/attention", summary="One layer's attention weights (uint8, base64)")
async def attention(request: Request, trace_id: str, layer: int = Query(ge=0, json_schema_extra=model_limit("layer"))):
    tracer, _ = context_of(request).state.get(trace_id)
    if layer >= len(tracer.attention):
        raise InvalidRequest(f"layer must be in [0, {len(tracer.attention) - 1}], got {layer}", "layer")
    return attention_payload(tracer, layer)

@router.get("/inspect/api/trace/{trace_id}/lens", summary="Logit lens: each layer's top tokens at a position")
async def lens(request: Request, trace_id: str, position: int = Query(ge=0), top: int = Query(5, ge=1, le=20)):
    tracer, tokens = context_of(request).state.get(trace_id)
    eng = context_of(request).whole_model()
    rows = await asyncio.to_thread(logit_lens, tracer, eng.model, eng.tokenizer, position, top)
    return {"position": position, "token": tokens[position]["token"] if position < len(tokens) else None,
            "layers": rows}

@router.get("/inspect/api/trace/{trace_id}/lens_grid", summary="Logit lens heatmap: every layer's top token at every position")
async def lens_heatmap(request: Request, trace_id: str):
    tracer, tokens = context_of(request).state.get(trace_id)
    eng = context_of(request).whole_model()
    grid = await asyncio.to_thread(lens_grid, tracer, eng.model, eng.tokenizer)
    return {**grid, "tokens": [t["token"] for t in tokens[grid["first"]:]]}


@router.post("/inspect/api/run", summary="Generate and return the engine's timeline: prefill, decode steps, TTFT, TPOT")
async def run(request: Request, body: RunBody):
    eng = context_of(request).core()
    ids = context_of(request).encode(body.prompt, body.chat)
    out = None
    async for out in context_of(request).get_engine().generate(ids, SamplingParams(temperature=0, max_tokens=body.max_tokens)):
        pass
    view = await context_of(request).between_steps(lambda: engine_view.timeline(eng, out.request_id, out.metrics))
    return {**view, "text": out.outputs[0].text, "request_id": out.request_id}

async def _next_token(ctx: InspectContext, ids: list[int], body: SampleBody):
    """The logits after `ids` + ``body.generated`` from a plain request (batched as usual) and the
    sampler's stages on them with `body`'s settings (`engine_view.sampling_stages`); raises
    `InvalidRequest` for a generated id outside the vocabulary."""
    eng = ctx.core()
    bad = [t for t in body.generated if not 0 <= t < eng.config.vocab_size]
    if bad:
        raise InvalidRequest(f"generated token id {bad[0]} is outside the vocabulary", "generated")
    params = _sampling(body, 1).validate(eng.config.vocab_size)
    grammar = await _grammar(eng, body)
    out = None
    async for out in ctx.get_engine().generate(ids + list(body.generated), SamplingParams(temperature=0, max_tokens=1),
                                               options=RequestOptions(return_logits=True)):
        pass
    logits = out.logits[0]
    return logits, engine_view.sampling_stages(eng.tokenizer, eng.sampler, logits, params, ids, list(body.generated),
                                               grammar)


def _sampling(body: SampleBody, max_tokens: int) -> SamplingParams:
    """The sampler's settings a body gives (temperature, filters, penalties, seed)."""
    return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                          repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, seed=body.seed, max_tokens=max_tokens)


async def _grammar(eng, body: SampleBody):
    """The grammar state after ``body.generated`` for ``body.json_schema`` or ``body.regex``
    (compiled by the engine's own `GrammarCompiler`, in a worker thread), or None. Raises
    `InvalidRequest` when both are given, when the constraint does not compile, or when a
    generated token breaks it."""
    from nextoken.structured import StructuredOutputsParams

    if body.json_schema is not None and body.regex is not None:
        raise InvalidRequest("give json_schema or regex, not both", "regex")
    if body.json_schema is None and body.regex is None:
        return None
    spec = StructuredOutputsParams(json=body.json_schema) if body.json_schema is not None else \
        StructuredOutputsParams(regex=body.regex)
    grammar = await asyncio.to_thread(eng.sequence_grammar, spec)
    ok = grammar.valid_prefix(list(body.generated))
    if ok < len(body.generated):
        raise InvalidRequest(f"generated token {body.generated[ok]} (position {ok}) is refused by the grammar; "
                             "reset the generated tokens", "generated")
    for t in body.generated:
        grammar.accept(t)
    return grammar


@router.post("/inspect/api/sample", summary="The sampler's stages on the next-token logits after a prompt")
async def sample(request: Request, body: SampleBody):
    ctx = context_of(request)
    ids = ctx.encode(body.prompt, False)
    _, view = await _next_token(ctx, ids, body)
    return {**view, "prompt_tokens": len(ids), "generated_text": ctx.core().tokenizer.decode(body.generated)}


@router.post("/inspect/api/journey/step", summary="One decode step of a prompt's journey, every stage on its data")
async def journey_step(request: Request, body: JourneyBody):
    ctx = context_of(request)
    eng = ctx.core()
    ids = ctx.encode(body.prompt, body.chat, MAX_TRACE_TOKENS)
    full = ids + list(body.generated)
    if len(full) > MAX_TRACE_TOKENS:  # the traced pass runs on the prompt and the tokens generated so far
        raise InvalidRequest(f"prompt has {len(full)} tokens; traces take at most {MAX_TRACE_TOKENS}", "generated")
    start = time.perf_counter()
    logits, stages = await _next_token(ctx, ids, body)  # the engine's own pass: the token and its draw
    tracer = TraceRecorder(eng.config, last_row_only=True)  # what happens inside, on the same tokens
    await ctx.run_traced(full, SamplingParams(temperature=0, max_tokens=1), tracer)
    view = await asyncio.to_thread(journey.step_view, eng, tracer, logits, stages, full, len(ids))
    return {**view, "prompt_tokens": len(ids), "step_ms": round((time.perf_counter() - start) * 1000, 1),
            "model": {"name": eng.config.name, "digest": await asyncio.to_thread(_digest, str(eng.model_path))}}


@functools.lru_cache(maxsize=4)
def _digest(path: str) -> str:
    """The model's SHA-256 (`loader.prepared.content_key`), which names a journey's export."""
    from nextoken.loader.prepared import content_key

    return content_key(path)


@router.post("/inspect/api/journey/branch", summary="A journey's branch point: the sampler's top alternatives, "
             "each with a greedy preview")
async def journey_branch(request: Request, body: BranchBody):
    """The token at position ``len(generated)`` of the journey taken apart: the candidates the
    sampler's real chain (`engine_view.sampling_stages`, with the body's settings) leaves most
    probable, then the most probable before it (under greedy only one is left), each with the
    greedy continuation the engine generates after it, all batched."""
    ctx = context_of(request)
    eng = ctx.core()
    ids = ctx.encode(body.prompt, body.chat, MAX_TRACE_TOKENS)
    _, stages = await _next_token(ctx, ids, body)
    cands = sorted(stages["candidates"], key=lambda c: (-c["p_final"], -c["p_raw"]))[: body.alternatives]
    prefix = ids + list(body.generated)

    async def preview(token: int) -> list[int]:
        out = None
        async for out in ctx.get_engine().generate(prefix + [token], SamplingParams(temperature=0, max_tokens=body.preview)):
            pass
        return list(out.outputs[0].token_ids)

    previews = await asyncio.gather(*(preview(c["id"]) for c in cands))
    alts = [{"id": c["id"], "token": c["token"], "prob": c["p_final"], "p_raw": c["p_raw"],
             "chosen": c["id"] == stages["chosen"]["id"], "preview_ids": p,
             "preview_text": eng.tokenizer.decode([c["id"]] + p)} for c, p in zip(cands, previews)]
    return {"position": len(body.generated), "greedy": stages["greedy"], "seed": body.seed,
            "temperature": body.temperature, "alternatives": alts}


@router.post("/inspect/api/journey/trajectory", summary="The journey continued from a branch point with another token")
async def journey_trajectory(request: Request, body: TrajectoryBody):
    """The continuation the engine generates after the journey's tokens before the branch point
    and `token` in place of the one chosen there, with the body's sampler settings (greedy at
    temperature 0; else seeded): its ids (the chosen token first), its text, and how many of its
    prompt tokens the engine found in the prefix cache (its own counter)."""
    ctx = context_of(request)
    eng = ctx.core()
    ids = ctx.encode(body.prompt, body.chat, MAX_TRACE_TOKENS)
    if not 0 <= body.token < eng.config.vocab_size:
        raise InvalidRequest(f"token id {body.token} is outside the vocabulary", "token")
    prompt = ids + list(body.generated) + [body.token]
    out = None
    async for out in ctx.get_engine().generate(prompt, _sampling(body, body.max_tokens)):
        pass
    token_ids = [body.token] + list(out.outputs[0].token_ids)
    return {"position": len(body.generated), "token_ids": token_ids, "text": eng.tokenizer.decode(token_ids),
            "prefix_reused": out.metrics.num_cached_tokens, "prompt_tokens": len(prompt),
            "greedy": body.temperature == 0, "temperature": body.temperature, "seed": body.seed}


@router.post("/inspect/api/beam", summary="Beam search as a tree next to the greedy path")
async def beam(request: Request, body: BeamBody):
    from nextoken.beam import BeamSearch

    eng = context_of(request).core()
    ids = context_of(request).encode(body.prompt, False)
    eng.encode_prompt(ids, SamplingParams(max_tokens=body.max_tokens))  # the context check
    search = BeamSearch([ids], body.beam_width, body.max_tokens, body.length_penalty, False,
                        eng.tokenizer.eog_token_ids)
    await context_of(request).get_engine().beam_search(ids, search)
    outs = search.outputs(eng.tokenizer)
    greedy = None
    async for greedy in context_of(request).get_engine().generate(ids, SamplingParams(temperature=0, max_tokens=body.max_tokens,
                                                                  logprobs=0)):
        pass
    g = greedy.outputs[0]
    return engine_view.beam_tree(eng.tokenizer, search, list(g.token_ids), g.cumulative_logprob, outs)

@router.get("/inspect/api/kv", summary="KV cache bytes per token (formula and cache) and memory against context")
async def kv(request: Request):
    return engine_view.kv_view(context_of(request).core())

@router.get("/inspect/api/state", summary="The engine now: block pool, running and waiting, recent steps")
async def state(request: Request, since: int = Query(-1, ge=-1)):
    eng = context_of(request).core()
    return await context_of(request).between_steps(lambda: engine_view.live_state(eng, since))

@router.get("/inspect/api/live", summary="Server-sent events: the engine state four times a second",
       response_class=StreamingResponse, responses={200: {"content": {"text/event-stream": {}}}})
async def live(request: Request):
    eng = context_of(request).core()

    async def events():
        since = max(-1, eng.num_steps - 64)
        while not await request.is_disconnected():
            snap = await context_of(request).between_steps(lambda: engine_view.live_state(eng, since))
            since = snap["last_step"]
            yield f"data: {json.dumps(snap)}\n\n"
            await asyncio.sleep(LIVE_INTERVAL_S)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

@router.post("/inspect/api/demo", summary="Send a few demo requests to watch batching (they run as usual)")
async def demo(request: Request, body: DemoBody):
    eng = context_of(request).get_engine()

    async def one(prompt):
        async for _ in eng.generate(prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=body.max_tokens)):
            pass

    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(body.count)]
    for p in set(prompts):  # the context check, before any is sent
        context_of(request).core().encode_prompt(p, SamplingParams(max_tokens=body.max_tokens))
    for p in prompts:
        task = asyncio.get_running_loop().create_task(one(p))
        context_of(request).state.demo_tasks.add(task)
        task.add_done_callback(context_of(request).state.demo_tasks.discard)
    return {"sent": len(prompts), "max_tokens": body.max_tokens}

@router.get("/inspect/api/quant/tensors", summary="Stored tensors by format, bytes against bf16 and fp32")
async def quant_tensors(request: Request):
    eng = context_of(request).core()
    if not str(eng.model_path).endswith(".gguf"):
        raise NotFound("the stored-format view reads GGUF files; this model is a Hugging Face folder", "model")
    return await asyncio.to_thread(_stored, str(eng.model_path))

@router.get("/inspect/api/quant/error", summary="Error of re-quantizing one stored tensor to other formats")
async def quant_error(request: Request, tensor: str = Query(min_length=1, max_length=200)):
    eng = context_of(request).core()
    if not str(eng.model_path).endswith(".gguf"):
        raise NotFound("the re-quantization view reads GGUF files; this model is a Hugging Face folder", "model")
    return await asyncio.to_thread(model_view.requant_error, str(eng.model_path), tensor)
