"""Per-request output state: detokenization, stop checks, and the `RequestOutput` a step
returns; `OutputProcessor` keeps the engine's requests and ends them (finished, aborted,
failed).

A user's request is a `RequestGroup` of `n` sequences (`Request`s); each sequence has its own
`IncrementalDetokenizer` and `CompletionOutput`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from nextoken.engine.request import Request
from nextoken.outputs import CompletionOutput, CompletionSnapshot, Prefix, RequestMetrics, RequestOutput
from nextoken.sample.sampler import SampleResult
from nextoken.tokenizer.detokenizer import NO_TEXT, FinalText, IncrementalDetokenizer

log = logging.getLogger("nextoken.engine")


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
    logits: list | None = None  # with return_logits: completion 0's raw logits per sampled token
    final_only: bool = False  # no output until it finishes (`RequestOptions.final_only`)
    output_tokens: int = -1  # its output tokens at its last output (-1: no output yet)

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].finished if len(seqs) == 1 else all(s.finished for s in seqs)


def process_token(group: RequestGroup, req: Request, res: SampleResult, eog_ids: frozenset[int],
                  context_length: int) -> bool:
    """Append sampled token `res` to sequence `req`, update its text and decide whether it
    stops. Returns True when the sequence is finished."""
    p = req.params
    out = group.completions[req.index]
    detok = group.detoks[req.index]
    token = res.token
    req.output_ids.append(token)  # (`Request.append_output`, inlined: once per token of every row)
    req.all_token_ids.append(token)
    metrics = group.metrics
    if metrics.first_token_time is None:
        metrics.first_token_time = time.perf_counter()
        metrics.first_scheduled_time = req.first_scheduled_time
    out.token_ids.append(token)
    out.delta_token_ids.append(token)
    if res.logprob is not None:
        out.logprobs.append({token: res.logprob, **dict(res.top_logprobs)})
        out.cumulative_logprob += res.logprob

    text = detok is not NO_TEXT  # (a front end that makes the text: nothing to do here for it)
    if token in eog_ids and not p.ignore_eos:
        out.finish_reason = "stop"
    elif token in p.stop_token_ids:
        out.finish_reason, out.stop_reason = "stop", token
    elif text and detok.add_token(token):
        out.finish_reason, out.stop_reason = "stop", detok.stop_reason
    elif len(out.token_ids) >= p.max_tokens or len(req.all_token_ids) >= context_length:
        out.finish_reason = "length"
    finished = out.finish_reason is not None
    if text:
        if finished:
            detok.flush()
        delta = detok.emit(finished)
        if delta:
            out.delta += delta
            out.text += delta
    group.changed = True
    return finished


def finish_sequence(group: RequestGroup, req: Request, reason: str | None = None) -> None:
    """Mark the sequence's completion finished (with `reason` when it is not already)."""
    out = group.completions[req.index]
    if out.finish_reason is None:
        out.finish_reason = reason
        detok = group.detoks[req.index]
        if type(detok) is FinalText:  # (ended before a token of its own finished it: its text so far)
            out.text = out.delta = detok.so_far()
    if group.finished and group.metrics.finished_time is None:
        group.metrics.finished_time = time.perf_counter()
    group.changed = True


def num_output_tokens(group: RequestGroup) -> int:
    """The tokens the group's sequences have generated, together."""
    comps = group.completions
    return len(comps[0].token_ids) if len(comps) == 1 else sum(len(c.token_ids) for c in comps)


def count_output(group: RequestGroup) -> RequestMetrics:
    """The group's metrics brought up to date for an output (its tokens so far, its cached
    prompt tokens); its output-token count kept for `stream_interval`."""
    m = group.metrics
    m.num_output_tokens = group.output_tokens = num_output_tokens(group)
    m.num_cached_tokens = group.seqs[0].num_cached_tokens
    return m


def output_made(group: RequestGroup) -> None:
    """An output of the group went out: its per-output deltas start again."""
    for c in group.completions:
        c.delta = ""
        c.delta_token_ids = []
    group.changed = False


def make_output(group: RequestGroup, finished: bool | None = None) -> RequestOutput:
    """A snapshot of the group for the caller; resets the per-step deltas. `finished`: the
    group's `finished`, when the caller has it already."""
    if finished is None:
        finished = group.finished
    m = count_output(group)
    outs = [CompletionSnapshot(c.index, c.text, c.delta, Prefix(c.token_ids, len(c.token_ids)), c.delta_token_ids,
                               c.finish_reason, c.stop_reason,
                               None if c.logprobs is None else Prefix(c.logprobs, len(c.logprobs)),
                               c.cumulative_logprob)
            for c in group.completions]  # (the constructor: dataclasses.replace took 15 us a call)
    output_made(group)
    return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished, RequestMetrics(**vars(m)),
                         group.error, None if group.prompt_logprobs is None else list(group.prompt_logprobs),
                         None if group.logits is None else list(group.logits),
                         group.prompt_hidden if finished else None)


def new_group(request_id: str, prompt: str | None, prompt_ids: list[int], params, seqs: list[Request],
              tokenizer, keep_prompt_hidden: bool = False, return_logits: bool = False,
              final_only: bool = False, detokenize: bool = True) -> RequestGroup:
    """The output state of a new request: one detokenizer (`NoText` when not `detokenize`: its
    front end makes the text; `FinalText` for a `final_only` request without stop strings) and
    one empty `CompletionOutput` per sequence (logprob lists when
    `params.logprobs` asks), its arrival time, and with `params.prompt_logprobs` a slot per
    prompt position (and the prompt's hidden states when `keep_prompt_hidden`, sized on the
    first chunk)."""
    import torch

    def detokenizer():
        if not detokenize:
            return NO_TEXT
        if final_only and not params.stop:
            return FinalText(tokenizer, params.skip_special_tokens)
        return IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop,
                                      params.include_stop_str_in_output)

    group = RequestGroup(
        request_id, prompt, prompt_ids, seqs, [detokenizer() for _ in seqs],
        [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None,
                          cumulative_logprob=0.0 if params.logprobs is not None else None) for i in range(len(seqs))],
        RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_ids), priority=seqs[0].priority),
        final_only=final_only)
    if return_logits:
        group.logits = []
    if params.prompt_logprobs is not None:
        group.prompt_logprobs = [None] * len(prompt_ids)
        if keep_prompt_hidden:
            group.prompt_hidden = torch.empty(0)
    return group


def store_prompt_scores(group: RequestGroup, start: int, entries: list, hidden) -> None:
    """Keep the prompt log-probabilities `entries` of positions ``start + 1 ..`` (the row of
    position p scores prompt token p + 1) and, when the group keeps them, their final hidden
    states ``[n, hidden]`` (row p: position p)."""
    n = len(entries)
    group.prompt_logprobs[start + 1 : start + 1 + n] = entries
    if group.prompt_hidden is not None:
        if group.prompt_hidden.numel() == 0:  # sized on the first chunk
            group.prompt_hidden = hidden.new_empty(len(group.prompt_ids) - 1, hidden.shape[1])
        group.prompt_hidden[start : start + n] = hidden


class OutputProcessor:
    """The engine's requests as their users see them: each `RequestGroup` by id (`groups`) and
    by sequence, the sampled tokens appended and detokenized (`emit`), the outputs of a step
    (`collect`), aborts and failures. tokenizer: for the detokenizers and the end-of-generation
    ids; max_model_len: tokens per sequence; release(seq, uncache): the engine frees an ending
    sequence's blocks (with `uncache`, out of the prefix cache too); stream_interval: a request's
    first token makes an output at once, later ones each `stream_interval` new tokens (of all its
    sequences) and at its end (vLLM's ``--stream-interval``; the deltas in between are joined)."""

    def __init__(self, tokenizer, max_model_len: int, release: Callable[[Request, bool], None],
                 stream_interval: int = 1):
        self.tokenizer, self.max_model_len, self.release = tokenizer, max_model_len, release
        self.stream_interval = stream_interval
        self.groups: dict[str, RequestGroup] = {}
        self._by_seq: dict[Request, RequestGroup] = {}
        self.num_aborted = 0  # requests aborted before they finished
        self.num_failed = 0  # requests ended by a fault of their own (non-finite logits, a raising processor)

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for s in group.seqs:
            self._by_seq[s] = group

    def group_of(self, r: Request) -> RequestGroup:
        return self._by_seq[r]

    def emit(self, r: Request, results) -> None:
        """Append sampled tokens to `r` in order (its grammar accepting each) until one finishes
        it. A grammar or detokenizer that raises fails `r`'s request alone (`fail`)."""
        group = self._by_seq[r]
        grammar = r.sampler_row.grammar
        for res in results:
            try:
                if grammar is not None:
                    grammar.accept(res.token)
                done = process_token(group, r, res, self.tokenizer.eog_token_ids, self.max_model_len)
            except Exception as exc:  # noqa: BLE001 - one row's fault ends only its own request
                self.fail(r, f"emitting token {res.token} failed ({type(exc).__name__}: {exc})")
                return
            if done:
                self.finish(r)
                return

    def finish(self, r: Request, reason: str | None = None) -> None:
        """`r` is done (`reason` when its completion has none yet): its blocks are released."""
        self.release(r, False)
        finish_sequence(self._by_seq[r], r, reason)

    def fail(self, r: Request, why: str) -> None:
        """Finish every unfinished sequence of `r`'s request with reason ``"error"`` (`n` > 1:
        the request fails as a whole), its message in `RequestOutput.error` and the log, with
        the request id; blocks only it holds leave the prefix cache (they may hold non-finite
        keys and values)."""
        group = self._by_seq[r]
        group.error = f"{why} of request {group.request_id}; its output so far is kept, nothing more is computed"
        log.error("%s", group.error)
        self.num_failed += 1
        for s in group.seqs:
            if not s.finished:
                self.release(s, True)
                finish_sequence(group, s, "error")

    def abort(self, request_id: str) -> None:
        """Stop request `request_id` now and release its blocks (no-op for unknown or finished ids)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        if not group.finished:
            self.num_aborted += 1
        for s in group.seqs:
            if not s.finished:
                self.release(s, False)
                finish_sequence(group, s, "abort")
            self._by_seq.pop(s, None)

    def collect(self, make=None, plain=()) -> tuple[list, list[tuple[RequestGroup, object]]]:
        """The outputs of the requests that changed (a `final_only` one's when it finishes; the
        others' as `stream_interval` says), and the finished requests (group, final output),
        which leave. `make(group, finished)`: what an output is, for the requests not in `plain`
        (default `make_output`: a `RequestOutput`; the engine process's wire records instead)."""
        outputs, finished = [], []
        for rid, group in list(self.groups.items()):
            done = group.finished
            out = None
            if group.changed and (done or self._due(group)):
                out = (make_output if make is None or rid in plain else make)(group, done)
            if out is not None:
                outputs.append(out)
            if done:
                del self.groups[rid]
                finished.append((group, out or make_output(group, done)))
                for s in group.seqs:
                    self._by_seq.pop(s, None)
        return outputs, finished

    def _due(self, group: RequestGroup) -> bool:
        """Whether an unfinished request that changed makes an output now: never when
        `final_only`; its first tokens at once; then once `stream_interval` tokens wait."""
        if group.final_only:
            return False
        if self.stream_interval == 1 or group.output_tokens < 0:
            return True
        return num_output_tokens(group) - group.output_tokens >= self.stream_interval
