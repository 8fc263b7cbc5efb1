"""The generation loop for one request: prefill once, then decode token by token.

    prompt ids -> prefill (one forward pass over the prompt, fills the KV cache)
               -> [sample -> stop checks -> detokenize -> decode one token]*  -> finish

`n > 1` completions share the prompt's prefill (its KV cache is copied) and each draws from its
own random stream. Every step yields a `RequestOutput` whose completions carry the text added
since the previous step (`delta`), so callers can stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from nextoken.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nextoken.runner.kv_cache import KVCache
from nextoken.sample.sampler import Sampler, SamplerRequest, make_generator
from nextoken.sampling_params import SamplingParams
from nextoken.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class _Completion:
    """The running state of one completion."""

    out: CompletionOutput
    kv: KVCache
    row: SamplerRequest
    detok: IncrementalDetokenizer
    logits: torch.Tensor  # [vocab] logits for the next token
    extra: dict = field(default_factory=dict)


def completion_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion `index` of a request seeded with `seed` (completion 0 uses `seed`)."""
    if seed is None or index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index) & 0xFFFF_FFFF_FFFF_FFFF


def generate_stream(runner, tokenizer, prompt_ids: list[int], params: SamplingParams,
                    request_id: str = "0", prompt: str | None = None, tracer=None) -> Iterator[RequestOutput]:
    """Generate the completions of one prompt, yielding a `RequestOutput` after every step.

    The caller has validated `params` and checked that the prompt fits the context window.
    `tracer` (see `nextoken.trace`) is told about every forward pass and every sampled token.
    """
    metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_ids))
    sampler = Sampler(tokenizer.eog_token_ids)
    kv = runner.new_kv_cache(len(prompt_ids) + params.max_tokens)
    if tracer is not None:
        tracer.on_prefill_start(prompt_ids)
    logits = runner.forward(prompt_ids, kv, tracer)
    if tracer is not None:
        tracer.on_forward_done(kv)
    completions = [_new_completion(i, kv if i == 0 else _copy_kv(kv), logits, prompt_ids, params, tokenizer)
                   for i in range(params.n)]
    while True:
        for c in completions:
            if not c.out.finished:
                _step(c, runner, sampler, params, tokenizer, metrics, tracer)
        done = all(c.out.finished for c in completions)
        if done:
            metrics.finished_time = time.perf_counter()
        metrics.num_output_tokens = sum(len(c.out.token_ids) for c in completions)
        yield RequestOutput(request_id, prompt, prompt_ids, [_snapshot(c.out) for c in completions], done, metrics)
        if done:
            return


def _snapshot(out: CompletionOutput) -> CompletionOutput:
    """A copy of `out` as it is now, so that outputs a caller keeps do not change later."""
    return replace(out, token_ids=list(out.token_ids),
                   logprobs=None if out.logprobs is None else list(out.logprobs))


def _copy_kv(kv: KVCache) -> KVCache:
    new = KVCache(kv.config, kv.dtype, kv.capacity)
    new.k.copy_(kv.k)
    new.v.copy_(kv.v)
    new.num_tokens = kv.num_tokens
    return new


def _new_completion(i, kv, logits, prompt_ids, params, tokenizer) -> _Completion:
    out = CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
    row = SamplerRequest(params, prompt_ids, out.token_ids, make_generator(completion_seed(params.seed, i)))
    detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop,
                                   params.include_stop_str_in_output)
    return _Completion(out, kv, row, detok, logits)


def _step(c: _Completion, runner, sampler: Sampler, params: SamplingParams, tokenizer,
          metrics: RequestMetrics, tracer) -> None:
    """Sample one token for completion `c`, check the stop conditions, and (if it goes on) run
    the decode forward pass for that token."""
    res = sampler(c.logits[None], [c.row], keep_details=tracer is not None)[0]
    if metrics.first_token_time is None:
        metrics.first_token_time = time.perf_counter()
    token = res.token
    out = c.out
    out.token_ids.append(token)
    if res.logprob is not None:
        out.logprobs.append({token: res.logprob, **dict(res.top_logprobs)})
        out.cumulative_logprob += res.logprob
    if tracer is not None:
        tracer.on_sample(c.logits, res, params)

    if token in tokenizer.eog_token_ids and not params.ignore_eos:
        out.finish_reason = "stop"
    elif token in params.stop_token_ids:
        out.finish_reason, out.stop_reason = "stop", token
    elif c.detok.add_token(token):
        out.finish_reason, out.stop_reason = "stop", c.detok.stop_reason
    elif len(out.token_ids) >= params.max_tokens or c.kv.num_tokens + 1 >= runner.config.context_length:
        out.finish_reason = "length"
    if out.finished:
        c.detok.flush()
    out.delta = c.detok.emit(finished=out.finished)
    out.text += out.delta
    if not out.finished:
        c.logits = runner.forward([token], c.kv, tracer)
        if tracer is not None:
            tracer.on_forward_done(c.kv)
