"""Per-request output state: detokenization, stop checks, and the `RequestOutput` a step returns.

A user's request is a `RequestGroup` of `n` sequences (`Request`s); each sequence has its own
`IncrementalDetokenizer` and `CompletionOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from nextoken.engine.request import Request
from nextoken.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nextoken.sample.sampler import SampleResult
from nextoken.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class RequestGroup:
    """The `n` sequences of one user request and what has been returned of them so far."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    completions: list[CompletionOutput]
    metrics: RequestMetrics
    error: str | None = None
    changed: bool = False  # something to report since the last output
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as the prompt is computed
    prompt_hidden: object | None = None  # with keep_prompt_hidden: ``[n_prompt - 1, hidden]``, row p scores token p + 1

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def process_token(group: RequestGroup, req: Request, res: SampleResult, eog_ids: frozenset[int],
                  context_length: int) -> bool:
    """Append sampled token `res` to sequence `req`, update its text and decide whether it
    stops. Returns True when the sequence is finished."""
    p = req.params
    out = group.completions[req.index]
    detok = group.detoks[req.index]
    token = res.token
    req.append_output(token)
    now = time.perf_counter()
    if group.metrics.first_token_time is None:
        group.metrics.first_token_time = now
    out.token_ids.append(token)
    out.delta_token_ids.append(token)
    if res.logprob is not None:
        out.logprobs.append({token: res.logprob, **dict(res.top_logprobs)})
        out.cumulative_logprob += res.logprob

    if token in eog_ids and not p.ignore_eos:
        out.finish_reason = "stop"
    elif token in p.stop_token_ids:
        out.finish_reason, out.stop_reason = "stop", token
    elif detok.add_token(token):
        out.finish_reason, out.stop_reason = "stop", detok.stop_reason
    elif len(out.token_ids) >= p.max_tokens or req.num_tokens >= context_length:
        out.finish_reason = "length"
    if out.finished:
        detok.flush()
    delta = detok.emit(finished=out.finished)
    out.delta += delta
    out.text += delta
    group.changed = True
    return out.finished


def finish_sequence(group: RequestGroup, req: Request, reason: str | None = None) -> None:
    """Mark the sequence's completion finished (with `reason` when it is not already)."""
    out = group.completions[req.index]
    if out.finish_reason is None:
        out.finish_reason = reason
    if group.finished and group.metrics.finished_time is None:
        group.metrics.finished_time = time.perf_counter()
    group.changed = True


def make_output(group: RequestGroup) -> RequestOutput:
    """A snapshot of the group for the caller; resets the per-step deltas."""
    m = group.metrics
    m.num_output_tokens = sum(len(c.token_ids) for c in group.completions)
    m.num_cached_tokens = group.seqs[0].num_cached_tokens
    outs = [replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
            for c in group.completions]
    for c in group.completions:
        c.delta = ""
        c.delta_token_ids = []
    group.changed = False
    return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, group.finished, replace(m),
                         group.error, None if group.prompt_logprobs is None else list(group.prompt_logprobs))
