"""The inspector's measured contrasts, on the loaded model and on demand: the KV cache on against
off, the served weights against a float32 reference (quantization's cost on the learner's prompt),
and speculative decoding for one request on a server started without it. Each runs as requests of
the engine, scheduled and counted like any other (see `routes`)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field

from nextoken.bodies import SEED_LIMIT, Body
from nextoken.errors import InvalidRequest, RequestFailed
from nextoken.inspect import contrast, quality, speculate, text
from nextoken.inspect.context import context_of
from nextoken.inspect.trace import MAX_TRACE_TOKENS
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams

router = APIRouter(tags=["inspector"])


class ContrastBody(Body):
    prompt: str = Field("The history of the printing press began", min_length=1, max_length=text.MAX_TEXT_CHARS)
    tokens: int = Field(24, ge=2, le=64)


class QualityBody(Body):
    prompt: str = Field("The quick brown fox jumps over the lazy dog. The quick brown fox", min_length=1,
                        max_length=text.MAX_TEXT_CHARS)
    chat: bool = False


class SpeculateBody(Body):
    method: Literal["ngram", "engine"] = Field("ngram", description="ngram: n-gram drafts verified here, on any "
                                               "server; engine: the server's own --speculative-method (n-gram or a "
                                               "draft model), read from its step log")
    prompt: str = Field("one two three four five, one two three four five, one two", min_length=1,
                        max_length=text.MAX_TEXT_CHARS)
    num_speculative_tokens: int = Field(4, ge=1, le=8)
    max_tokens: int = Field(24, ge=1, le=64)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    seed: int = Field(0, ge=0, le=SEED_LIMIT)


@router.post("/inspect/api/kv/contrast", summary="The same greedy continuation with the KV cache and by recomputing the prefix")
async def kv_contrast(request: Request, body: ContrastBody):
    ctx = context_of(request)
    ids = ctx.encode(body.prompt, False, MAX_TRACE_TOKENS - body.tokens)
    params = SamplingParams(temperature=0, max_tokens=body.tokens, ignore_eos=True)
    cached, with_ms, t = [], [], time.perf_counter()
    async for out in ctx.get_engine().generate(ids, params):  # with the cache: one request, a token per step
        new = out.outputs[0].token_ids[len(cached):]
        now = time.perf_counter()
        if new and cached:  # decode steps only (the first token includes the prompt's prefill)
            with_ms.append((now - t) * 1000 / len(new))
        cached += new
        t = now
    recomputed, without_ms = [], []
    for k in range(1, len(cached)):  # without: each step recomputes the prompt and the k tokens before it
        t = time.perf_counter()
        async for out in ctx.get_engine().generate(ids + cached[:k], SamplingParams(temperature=0, max_tokens=1),
                                                    options=RequestOptions(tracer=contrast.Recompute())):
            pass
        without_ms.append((time.perf_counter() - t) * 1000)
        recomputed += out.outputs[0].token_ids
    positions = [len(ids) + i for i in range(1, body.tokens)]
    return {"positions": positions, "with_cache_ms": [round(x, 2) for x in with_ms],
            "without_cache_ms": [round(x, 2) for x in without_ms], "prompt_tokens": len(ids),
            "tokens": cached, "same_tokens": cached[1:] == recomputed,
            "slope_with": round(contrast.slope(positions[: len(with_ms)], with_ms), 4),
            "slope_without": round(contrast.slope(positions, without_ms), 4)}


@router.post("/inspect/api/quant/kl", summary="Per position: KL divergence and top-1 agreement of the served weights "
                                            "against a float32 reference")
async def quant_kl(request: Request, body: QualityBody):
    ctx = context_of(request)
    eng = ctx.whole_model()
    ids = ctx.encode(body.prompt, body.chat, MAX_TRACE_TOKENS)
    if len(ids) < 2:
        raise InvalidRequest("the prompt needs at least 2 tokens: each position is scored on the next", "prompt")
    t = time.perf_counter()
    reference, ref_hidden = await asyncio.to_thread(ctx.state.reference.hidden, eng, ids)
    out = None
    async for out in ctx.get_engine().generate(ids, quality.served_params(), options=RequestOptions(keep_prompt_hidden=True)):
        pass
    if out.error is not None:
        raise RequestFailed(out.error)
    view = await asyncio.to_thread(quality.compare, eng, reference, ids, out.prompt_hidden, ref_hidden)
    return {**view, "prompt_tokens": len(ids), "ms": round((time.perf_counter() - t) * 1000, 1),
            "served": quality.describe(eng), "reference": {
                "bytes": quality.reference_bytes(eng), "cap_bytes": quality.REFERENCE_MAX_BYTES,
                "build_s": round(ctx.state.reference.build_s, 2), "dtype": "float32"}}


@router.post("/inspect/api/quant/layers", summary="Per layer: how far the served residual stream is from a float32 "
                                                "reference's, and the KL divergence at the head")
async def quant_layers(request: Request, body: QualityBody):
    """The same prompt traced on the served engine and on the float32 reference (`quality`):
    per layer the residual streams' mean cosine similarity and relative difference, so a user
    sees where the served weights and arithmetic drift, and KL(reference || served) of the next
    token."""
    from nextoken.trace.recorder import TraceRecorder

    ctx = context_of(request)
    eng = ctx.whole_model()
    ids = ctx.encode(body.prompt, body.chat, MAX_TRACE_TOKENS)
    t = time.perf_counter()
    ref = await asyncio.to_thread(ctx.state.reference.traced, eng, ids)
    served = TraceRecorder(eng.config, last_row_only=True)
    await ctx.run_traced(ids, SamplingParams(temperature=0, max_tokens=1), served)
    view = await asyncio.to_thread(quality.layer_diff, served, ref)
    return {**view, "prompt_tokens": len(ids), "ms": round((time.perf_counter() - t) * 1000, 1),
            "served": quality.describe(eng), "reference": {"dtype": "float32", "build_s": round(ctx.state.reference.build_s, 2)}}


@router.post("/inspect/api/spec/run", summary="Speculative decoding for one request, on demand: each verification's "
                                              "drafts, acceptance and p_target / q_draft")
async def spec_run(request: Request, body: SpeculateBody):
    ctx = context_of(request)
    eng = ctx.core()
    ids = ctx.encode(body.prompt, False, MAX_TRACE_TOKENS - body.max_tokens - body.num_speculative_tokens)
    params = SamplingParams(temperature=body.temperature, seed=body.seed,
                            max_tokens=body.max_tokens).validate(eng.config.vocab_size)
    t = time.perf_counter()
    if body.method == "engine":
        view = await speculate.run_in_engine(ctx, ids, params)
    else:
        view = await speculate.run(ctx, ids, params, body.num_speculative_tokens)
    return {**view, "prompt_tokens": len(ids), "ms": round((time.perf_counter() - t) * 1000, 1)}
