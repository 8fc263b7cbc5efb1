"""`LLMEngine`: requests in, tokens out, one batched step at a time.

    add_request -> [step: schedule -> execute (one forward pass over every scheduled request)
                    -> sample or verify -> outputs]* -> finished

The engine owns the tokenizer, the model runner, the KV cache manager, the scheduler, the
sampler and the `Speculator`. `step` returns a `RequestOutput` for every request that produced
something, and hands a `StepStats` to every subscriber (`subscribe`: the inspector's
`StepHistory`, the server's metrics). The offline `LLM` and the async wrapper
(`async_engine.py`) drive it. A fault of one request's row (non-finite logits, a processor or
grammar that raises) ends that request with ``finish_reason="error"``; the step goes on.

With ``async_scheduling`` (vLLM's), a step is launched before the previous one is read back:

    step k:  schedule k -> launch k (inputs, pass, draw; decodes take step k-1's tokens on the
             device) -> read back step k-1 (its tokens, detokenized, stop checks) -> outputs

so on a GPU the host's work for one step runs while the device computes the next. A request that
stops in step k-1 has run in step k too: that row is dropped. A request whose tokens need the
host between steps (a grammar, logit processors, a tracer, prompt logprobs, first tokens, kept
logits), a beam search or speculative decoding makes the steps run in order while it is there.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from nextoken import sampling_defaults
from nextoken.config import SchedulerConfig
from nextoken.engine.beam_groups import BeamGroups
from nextoken.engine.output_processor import OutputProcessor, new_group, store_prompt_scores
from nextoken.engine.request import RUNNING, Request, make_sequences
from nextoken.engine.scheduler import Scheduler
from nextoken.engine.stats import SchedulerStats
from nextoken.engine.step_stats import StepHistory, StepStats
from nextoken.engine.validation import (bad_words_token_ids, check_priority, check_request, encode_prompt, read_template,
                                       resolve_lora)
from nextoken.engine_args import EngineArgs
from nextoken.errors import InvalidRequest
from nextoken.kv_cache.budget import allocate_kv_cache
from nextoken.loader.gguf import GGUFFile
from nextoken.loader.hf import HFModelDir
from nextoken.loader.opened import OpenedModel
from nextoken.loader.prepared import content_key
from nextoken.loader.source import load_tokenizer, model_dtype
from nextoken.outputs import RequestOutput
from nextoken.runner.cuda_graphs import MAX_GRAPH_BATCH
from nextoken.runner.device import Device, batch_defaults
from nextoken.runner.model_runner import ModelRunner, SequenceInput
from nextoken.sample.rng import DrawGenerator
from nextoken.sample.sampler import SampleLaunch, SampleResult, Sampler
from nextoken.sample.logits_processors import has_processors
from nextoken.sample.watermark import WatermarkConfig
from nextoken.request_options import DEFAULT, RequestOptions
from nextoken.sampling_params import SamplingParams
from nextoken.spec_decode.speculator import SpecStats, build_speculator
from nextoken.structured.backend import GrammarCompiler

log = logging.getLogger("nextoken.engine")


def with_batch_defaults(args: EngineArgs, device: Device) -> EngineArgs:
    """`args` with ``max_num_seqs`` and ``max_num_batched_tokens`` set where they were left to
    the device (None): `runner.device.batch_defaults`, logged with the reason."""
    if args.max_num_seqs is not None and args.max_num_batched_tokens is not None:
        return args
    seqs, tokens, why = batch_defaults(device)
    args = args.replace(max_num_seqs=args.max_num_seqs or seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens or tokens)
    log.info("batches: at most %d sequences and %d new tokens a step (%s)", args.max_num_seqs,
             args.max_num_batched_tokens, why)
    return args


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Raises `ModelLoadError` if the model cannot be read, `InvalidRequest` from `add_request` for
    bad input (naming the field).
    """

    def __init__(self, args: EngineArgs, source: GGUFFile | HFModelDir,
                 draft_source: GGUFFile | HFModelDir | None = None, tp=None, tokenizer=None):
        """An engine for the opened model `source` (and with ``args.speculative == "draft"`` the
        draft model `draft_source`), as `args` asks; `tp`: rank 0 of a tensor-parallel group
        (`distributed.group`), or None. Raises `ModelLoadError` when the draft's vocabulary is
        not the target's, `InvalidRequest` for settings the model cannot take. Most callers use
        `from_engine_args`, which resolves and opens the models (and starts the ranks).
        `tokenizer`: the model's, when the caller built it already from `source`."""
        self.args = args
        self.model_path = source.path
        self.max_logprobs = args.max_logprobs  # the most a request may ask for (-1: the vocabulary)
        # the model creator's sampling defaults (`sampling_defaults`): requests that leave a field unset take them
        self.sampling_defaults = sampling_defaults.resolve(str(self.model_path), args.generation_config,
                                                           args.override_generation_config)
        if self.sampling_defaults:
            log.info("sampling defaults of requests that set none: %s (the model's generation config; "
                     "--generation-config vllm for none)", self.sampling_defaults)
        dtype = model_dtype(source, args.dtype)
        self.tokenizer = tokenizer or load_tokenizer(source, args.prepared_cache)
        if args.chat_template is not None:
            self.tokenizer.chat_template = read_template(args.chat_template)
        source.release_metadata()  # the vocabulary lists are in the tokenizer now
        if tp is not None and args.speculative == "draft":
            raise InvalidRequest("a draft model is not supported with tensor parallelism; use --speculative-method "
                                 "ngram", "speculative_model")
        self.runner = ModelRunner.from_engine_args(args, source, tp)
        args = self.args = with_batch_defaults(args, self.runner.device)
        self.config = self.runner.config
        ctx = self.config.context_length
        # tokens per sequence: the model's context, or less when asked (a smaller default KV cache)
        self.max_model_len = min(ctx, args.max_model_len or ctx)
        self.watermark = WatermarkConfig(args.watermark_gamma, args.watermark_delta)
        self.speculator, draft_runner = build_speculator(args, self.tokenizer, self.config, dtype, self.watermark,
                                                         draft_source, self.runner.plan.cheap_verification)
        self.speculative = self.speculator.config if self.speculator else None
        self.cache_config = args.cache_config()
        self.scheduler_config = SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens if args.enable_chunked_prefill
            else max(args.max_num_batched_tokens, self.max_model_len),  # without chunks a whole prompt fits a step
            args.enable_chunked_prefill, self.max_model_len, args.scheduling_policy)
        lookahead = self.speculator.lookahead if self.speculator else 0
        self.kv = allocate_kv_cache(self.runner, draft_runner, self.cache_config, args.max_num_seqs, self.max_model_len,
                                    lookahead, content_key(source.path) if args.disk_dir else None,
                                    args.gpu_memory_utilization, self.scheduler_config.max_num_batched_tokens)
        if self.runner.plan.cuda_graphs:
            self.runner.capture_decode_graphs(min(args.max_num_seqs, MAX_GRAPH_BATCH), self.max_model_len + lookahead)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, lookahead)
        self.sampler = Sampler.for_plan(self.tokenizer.eog_token_ids, self.watermark, self.runner.plan)
        # structured output: llguidance over our vocabulary, built on the first request that asks
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self._release, args.stream_interval)
        self.beams = BeamGroups()  # the beam searches the engine drives (`add_beam_search`)
        self._ids = itertools.count()
        self._seeds = DrawGenerator(args.seed) if args.seed is not None else None  # (`add_request`)
        # async scheduling: the step launched and not read back yet, and the sequences that need
        # the steps in order (`_needs_order`)
        wanted = args.async_scheduling if args.async_scheduling is not None else self.runner.device.is_cuda
        self.async_scheduling = wanted and self.speculator is None and tp is None
        if wanted:
            log.info("async scheduling: %s", ("on" if args.async_scheduling else "on (a GPU's default)")
                     if self.async_scheduling else "off (speculative decoding or tensor parallelism runs in order)")
        self._in_flight: InFlight | None = None
        self._ordered: set[Request] = set()
        self.num_steps = 0
        self.history = StepHistory(self.kv.blocks_for)  # what the inspector shows (`nextoken.inspect`)
        self.subscribers: list[Callable[[StepStats], None]] = [self.history]

    @classmethod
    def from_engine_args(cls, args: EngineArgs, opened: OpenedModel | None = None) -> LLMEngine:
        """The engine `args` describes, its models resolved and opened, the tensor-parallel
        ranks started (`engine.launch.launch_engine`, which documents `opened`)."""
        from nextoken.engine.launch import launch_engine

        return launch_engine(cls, args, opened)

    # -- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int], params: SamplingParams, truncate: bool = False) -> list[int]:
        """Token ids of `prompt` fitted to the context window (`engine.validation.encode_prompt`)."""
        return encode_prompt(self.tokenizer, self.config.vocab_size, self.max_model_len, prompt, params, truncate)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    options: RequestOptions = DEFAULT) -> str:
        """Queue a request; returns its id. `options`: how it runs (`RequestOptions`: its text,
        truncation, tracer, kept hidden states, first tokens, raw logits, LoRA adapter). Raises
        `InvalidRequest` for bad parameters, a prompt that does not fit the context window, or
        one that could never fit in the KV cache."""
        o = options
        params = (params or SamplingParams()).validate(self.config.vocab_size, self.max_logprobs)
        ids = self.encode_prompt(prompt, params, o.truncate_prompt)
        if params.seed is None and self._seeds is not None:  # --seed: the next of the engine's seeds
            params = dataclasses.replace(params, seed=self._seeds.next_u64() >> 1)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        check_request(self.kv, len(ids), params, o.tracer is not None, self.runner.tp is not None)
        lora_id = resolve_lora(self.runner.loras, o.lora_request)
        check_priority(o.priority, self.scheduler_config.scheduling_policy)
        text = o.prompt_text if o.prompt_text is not None else (prompt if isinstance(prompt, str) else None)
        spec = params.structured_outputs  # compiled (or found in the cache) before anything is queued
        grammars = [self.grammars.sequence_grammar(spec) for _ in range(params.n)] if spec else [None] * params.n
        if o.cache_salt is not None and (not isinstance(o.cache_salt, str) or not o.cache_salt):
            raise InvalidRequest(f"cache_salt must be a non-empty string, got {o.cache_salt!r}", "cache_salt")
        seqs = make_sequences(request_id, ids, params, grammars, o.tracer, o.first_tokens, lora_id, o.priority,
                              o.client, o.continuation)
        for s in seqs:
            s.cache_salt = o.cache_salt
        self.outputs.add(new_group(request_id, text, ids, params, seqs, self.tokenizer, o.keep_prompt_hidden,
                                   o.return_logits, o.final_only, o.detokenize or bool(params.stop)))
        if self.async_scheduling and _needs_order(params, o):
            self._ordered.update(seqs)
        for s in seqs:
            self.scheduler.add(s)
        if o.tracer is not None:
            o.tracer.on_prefill_start(ids)
        return request_id

    def abort_request(self, request_id: str) -> None:  # frees its blocks; a no-op for unknown or finished ids
        self.beams.abort(self, request_id)
        self.outputs.abort(request_id)

    def add_beam_search(self, prompt_ids: list[int], search, request_id: str | None = None,
                        options: RequestOptions = DEFAULT) -> str:
        """Queue `search` (a `beam.BeamSearch` over `prompt_ids` alone) as one request the engine
        drives (`engine.beam_groups`); returns its id. Its one output, when it ends, holds the
        beams as completions. Raises `InvalidRequest` for a prompt that does not fit."""
        request_id = request_id if request_id is not None else f"beam-{next(self._ids)}"
        if request_id in self.outputs.groups or request_id in self.beams:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        self.beams.add(self, request_id, prompt_ids, search, options)
        return request_id

    def load_lora(self, lora_request) -> int:
        """Load an adapter (`lora.manager.LoRAManager.add`); its id. Raises `InvalidRequest` when
        LoRA is off or the adapter is refused."""
        return resolve_lora(self.runner.loras, lora_request)

    def unload_lora(self, lora_id: int) -> None:
        """Unload an adapter. Raises `InvalidRequest` while a request still uses it (its tokens
        would silently go to the base model), or when it is not loaded."""
        sched = self.scheduler
        users = [r for q in (sched.running, sched.waiting, sched.forking) for r in q if r.lora_id == lora_id]
        if users:
            raise InvalidRequest(f"{len(users)} requests still use this adapter; unload it when they finish",
                                 "lora_name")
        if self.runner.loras is None or not self.runner.loras.remove(lora_id):
            raise InvalidRequest("this adapter is not loaded", "lora_name")

    def _release(self, r: Request, uncache: bool = False) -> None:
        """Free an ending sequence's blocks (with `uncache`, out of the prefix cache first)."""
        if uncache:
            self.kv.uncache(r)
        self._ordered.discard(r)
        self.scheduler.finish(r)
        if self.speculator is not None:
            self.speculator.forget(r)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks in memory (vLLM's ``reset_prefix_cache``: a benchmark's
        cold start, a changed model), so later prompts are computed in full; the disk tier keeps
        its own. Only between requests: with any unfinished, nothing changes and the answer is False."""
        if self.has_unfinished_requests() or not self.kv.reset_prefix_cache():
            log.warning("the prefix cache was not reset: requests still hold blocks")
            return False
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- one step ---------------------------------------------------------------------------
    def step(self, make=None) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample (or verify drafts), and return the outputs that
        changed; every subscriber gets this step's `StepStats`. `make(group, finished)`: builds
        each output in place of `output_processor.make_output` (the engine process's wire
        records, `core.OutputWire.encode_group`); a beam search's own requests, and its final
        output, stay `RequestOutput`s."""
        start = time.perf_counter()
        overlap = self.async_scheduling and not self._ordered and not self.beams.groups
        if not overlap:
            self._read_back()  # a step in order: the one in flight first
        plan = self.scheduler.schedule()
        stats = StepStats(self.num_steps, start,
                          prefill=[[r.group_id, n] for r, n in plan.scheduled.items()
                                   if r.num_computed_tokens < r.num_prompt_tokens],
                          decode=[r.group_id for r in plan.scheduled if r.num_computed_tokens >= r.num_prompt_tokens],
                          preempted=[r.group_id for r in plan.preempted])
        if plan.block_copies or plan.sliding_copies:  # before any pass reads or writes them
            self.runner.copy_blocks(plan.block_copies, plan.sliding_copies)
        launched = None
        if plan.scheduled and overlap:
            launched = self._launch(plan.scheduled)
        elif plan.scheduled:
            traced = [r for r in plan.scheduled if r.tracer is not None]
            plain = {r: n for r, n in plan.scheduled.items() if r.tracer is None} if traced else plan.scheduled
            if plain:
                self._run(plain, plan.lookahead, spec_log=stats.spec)
            for r in traced:  # tracing costs only the traced request: a pass of its own
                self._run({r: plan.scheduled[r]}, tracer=r.tracer)
        if overlap:
            stats.overlapped = True
            stats.wait_ms = self._read_back()
            self._in_flight = launched
        outputs, stats.finished = self.outputs.collect(make, self.beams.step_requests)
        if self.beams.groups:
            outputs = self.beams.on_outputs(self, outputs)
        stats.failed = [g.request_id for g, _ in stats.finished if g.error is not None]
        if plan.scheduled or plan.preempted:
            self.num_steps += 1
        if plan.scheduled or plan.preempted or stats.finished:
            stats.ms = (time.perf_counter() - start) * 1000
            for subscriber in self.subscribers:
                subscriber(stats)
        return outputs

    def subscribe(self, subscriber: Callable[[StepStats], None]) -> None:
        """Call `subscriber` with each step's `StepStats` (on the thread that steps the engine)."""
        self.subscribers.append(subscriber)

    def _run(self, scheduled: dict[Request, int], lookahead: set[Request] = frozenset(), tracer=None,
             spec_log: list | None = None) -> None:
        """One forward pass over `scheduled` (request -> new tokens), then sampling or
        verification. `tracer`: the one traced request's recorder; `spec_log`: this step's list
        of speculative verifications (`StepStats.spec`)."""
        reqs = list(scheduled)
        drafts = {}
        if lookahead:
            drafts = self.speculator.propose([r for r in reqs if r in lookahead],
                                             lambda r: self.kv.block_ids(r.request_id))
        seqs = [self._sequence_input(r, n, drafts.get(r)) for r, n in scheduled.items()]
        scored = [(r, r.num_computed_tokens) for r, s in zip(reqs, seqs) if s.keep_hidden]
        logits = self.runner.execute(seqs, tracer)
        if scored:
            self._score_prompts(scored)
        for r, n in scheduled.items():
            r.num_computed_tokens += n
            if r not in drafts and not r.finished:  # (a request failed by its prompt scores is freed)
                self.kv.cache_full_blocks(r)
        if tracer is not None:
            r = reqs[0]
            tracer.on_forward_done(r.num_computed_tokens, r.num_computed_tokens * self.runner.kv.bytes_per_token)
        rows, at = {}, 0  # each sequence's logits rows
        for r, s in zip(reqs, seqs):
            if s.needs_logits:
                k = len(s.token_ids) if s.as_decodes else 1
                rows[r] = (at, at + k)
                at += k
        for r in [r for r in reqs if r in rows and r.params.max_tokens == 0 and not r.finished]:  # scored only
            self.outputs.finish(r, "length")
        if drafts or tracer is not None or not self._sample_checked(logits, reqs, rows):
            self._fail_nonfinite(logits, {r: ab for r, ab in rows.items() if not r.finished})
            self._sample(logits, [r for r in reqs if r in rows and r not in drafts and not r.finished], rows, tracer)
        for r, (toks, qs) in drafts.items():
            if not r.finished:
                self._verify(r, logits[rows[r][0] : rows[r][1]], toks, qs, spec_log)

    def _launch(self, scheduled: dict[Request, int]) -> InFlight | None:
        """Async scheduling: one forward pass over `scheduled` and the draw of its sampled rows,
        left in flight on the device (`Sampler.launch`); a decode whose last token is still in
        flight takes it from the last step's draw there. Returns what `_read_back` reads, or
        None when nothing was sampled."""
        last = self._in_flight
        seqs = [self._sequence_input(r, n, None) for r, n in scheduled.items()]
        logits = self.runner.execute(seqs, fed=last.draw.tokens if last is not None else None)
        for r, n in scheduled.items():
            r.num_computed_tokens += n
            if not r.num_pending:  # (else its blocks are cached when its token is read back)
                self.kv.cache_full_blocks(r)
        sampled = [r for r, s in zip(scheduled, seqs) if s.needs_logits]
        if not sampled:
            return None
        draw = self.sampler.launch(logits, [r.sampler_row for r in sampled])
        for j, r in enumerate(sampled):
            r.num_pending += 1
            r.fed_row = j
        return InFlight(sampled, draw)

    def _read_back(self) -> float:
        """Read the step in flight back (waiting for its copies) and emit its tokens, as a step in
        order would: a request with non-finite logits fails, one that has finished since
        (stopped, aborted) drops its row. Returns the milliseconds spent waiting for the copies."""
        done, self._in_flight = self._in_flight, None
        if done is None:
            return 0.0
        start = time.perf_counter()
        done.draw.wait()
        waited = (time.perf_counter() - start) * 1000
        results, finite = done.draw.results()
        for r, res, ok in zip(done.reqs, results, finite):
            if r.finished:
                continue
            r.num_pending -= 1
            if not ok:
                self.outputs.fail(r, _nonfinite(r.num_tokens))
                continue
            self.outputs.emit(r, [res])
            if r.status is RUNNING:
                self.kv.cache_full_blocks(r)
        return waited

    def _sequence_input(self, r: Request, n: int, drafted: tuple | None) -> SequenceInput:
        """The runner's input for `n` new tokens of `r` (with `drafted`: its last token and the
        drafts, each as a decode row, for verification; with a token in flight, `n` is 1 and the
        token is fed from the last step's draw)."""
        block_ids, ring_ids = self.kv.block_ids(r.request_id), self.kv.ring_ids(r.request_id)
        off_ring = self.kv.off_ring(r.request_id) if ring_ids else None
        if r.num_pending:
            return SequenceInput([0], r.num_computed_tokens, block_ids, True, ring_ids=ring_ids, lora_id=r.lora_id,
                                 fed_from=r.fed_row)
        toks = r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
        if drafted is not None:
            return SequenceInput(toks + drafted[0], r.num_computed_tokens, block_ids, True, as_decodes=True,
                                 ring_ids=ring_ids, lora_id=r.lora_id)
        return SequenceInput(toks, r.num_computed_tokens, block_ids, r.num_computed_tokens + n == r.num_tokens,
                             ring_ids=ring_ids, off_ring=off_ring, keep_hidden=_scores_prompt(r), lora_id=r.lora_id,
                             prefill_len=r.num_tokens)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], rows: dict, tracer) -> None:
        """One token for each of `reqs` from its logits row, in one batched sampler call; a row
        whose processors or grammar raise fails its request alone."""
        if any(r.first_tokens for r in reqs):  # drawn already (the quick start's first token): no draw
            for r in [r for r in reqs if r.first_tokens]:
                self.outputs.emit(r, [SampleResult(r.first_tokens.pop(0))])
                reqs.remove(r)
        if not reqs:
            return
        idx = [rows[r][0] for r in reqs]
        picked = logits if idx == list(range(logits.shape[0])) else logits[idx]  # (every row in order: no copy)
        results = self.sampler(picked, [r.sampler_row for r in reqs], keep_details=tracer is not None)
        for i, (r, res) in enumerate(zip(reqs, results)):
            if res.error is not None:
                self.outputs.fail(r, f"sampling failed ({res.error})")
                continue
            if tracer is not None:
                tracer.on_sample(logits[idx[i]], res, r.params)
            group = self.outputs.group_of(r)
            if group.logits is not None and r.index == 0:
                group.logits.append(logits[idx[i]].to("cpu", copy=True))
            self.outputs.emit(r, [res])

    def _sample_checked(self, logits: torch.Tensor, reqs: list[Request], rows: dict) -> bool:
        """`_fail_nonfinite` and `_sample` in one read-back (`Sampler.draw_checked`), for a step whose
        rows all take the plain draw, one row each, none with a quick start's token or kept logits:
        on a GPU one wait for the device instead of two (as async scheduling's `_read_back`).
        Returns False, having done nothing, for other steps."""
        sampled = [r for r in reqs if r in rows and not r.finished]
        if not sampled or any(rows[r][1] - rows[r][0] != 1 or r.first_tokens
                              or self.outputs.group_of(r).logits is not None for r in sampled):
            return False
        idx = [rows[r][0] for r in sampled]
        picked = logits if idx == list(range(logits.shape[0])) else logits[idx]
        drawn = self.sampler.draw_checked(picked, [r.sampler_row for r in sampled])
        if drawn is None:
            return False
        for r, res, ok in zip(sampled, *drawn):
            if not ok:
                self.outputs.fail(r, _nonfinite(r.num_computed_tokens))
            else:
                self.outputs.emit(r, [res])
        return True

    def _verify(self, r: Request, logits: torch.Tensor, drafts: list[int], draft_probs, spec_log) -> None:
        """Verify `r`'s drafts against its logits rows and emit the tokens that survive."""
        try:
            results = self.speculator.verify(self.sampler, r, logits, drafts, draft_probs, spec_log)
        except Exception as exc:  # noqa: BLE001 - one row's fault ends only its own request
            self.outputs.fail(r, f"verification failed ({type(exc).__name__}: {exc})")
            return
        self.outputs.emit(r, results)
        if not r.finished:
            self.kv.cache_full_blocks(r)
            self.speculator.on_verified(r)

    def _fail_nonfinite(self, logits: torch.Tensor, rows: dict[Request, tuple[int, int]]) -> None:
        """Fail every request whose logits rows (``rows``: request -> [a, b) rows of `logits`)
        hold a NaN or an infinity (a model fault: overflowing activations, a broken weight): it
        finishes with reason ``"error"``, the batch's other requests go on (`Sampler.finite_rows`)."""
        if not rows:
            return
        finite = self.sampler.finite_rows(logits)
        for r, (a, b) in rows.items():
            if not all(finite[a:b]):
                self.outputs.fail(r, _nonfinite(r.num_computed_tokens))

    def _score_prompts(self, scored: list[tuple[Request, int]]) -> None:
        """Prompt log-probabilities from this pass's kept hidden states (`scored`: each request
        and the position its chunk starts at): the row of position p scores prompt token p + 1
        (`SamplingParams.prompt_logprobs`)."""
        for i, ((r, start), hidden) in enumerate(zip(scored, self.runner.kept_hidden)):
            n = min(hidden.shape[0], r.num_prompt_tokens - 1 - start)
            if n <= 0:
                continue
            entries = self.runner.score_kept(i, n, r.prompt_ids[start + 1 : start + 1 + n],
                                             r.params.prompt_logprobs)
            if not all(math.isfinite(v) for e in entries for v in e.values()):
                self.outputs.fail(r, f"the model produced non-finite prompt log-probabilities (NaN or inf) at "
                                      f"positions {start + 1}..{start + n}")
                continue
            store_prompt_scores(self.outputs.group_of(r), start, entries, hidden[:n])

    def run_until_finished(self, request_ids: list[str],
                           on_finished: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Step until every request of `request_ids` has finished; their final outputs, in that
        order (`on_finished` is called with each as it finishes). Whatever is left unfinished
        (an exception, an interrupt) is aborted."""
        final: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        try:
            while len(final) < len(wanted):
                for out in self.step():
                    if out.finished and out.request_id in wanted:  # (others' requests run beside them)
                        final[out.request_id] = out
                        if on_finished is not None:
                            on_finished(out)
        finally:
            for rid in request_ids:
                if rid not in final:
                    self.abort_request(rid)
        return [final[rid] for rid in request_ids]

    def close(self) -> None:
        """Write the disk tier's queued blocks, stop the tensor-parallel ranks; also done at exit."""
        self.kv.close()
        if self.runner.tp is not None:
            self.runner.tp.close()

    # -- introspection ----------------------------------------------------------------------
    def scheduler_stats(self) -> SchedulerStats:
        """The queues and the totals since the start, typed (`engine.stats.SchedulerStats`)."""
        return SchedulerStats.now(self)

    def stats(self) -> dict:
        """`scheduler_stats` as one flat dictionary (`SchedulerStats.as_dict`), for JSON."""
        return self.scheduler_stats().as_dict()

    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counts (`Speculator.stats`; zeros without it)."""
        return self.speculator.stats() if self.speculator is not None else SpecStats()


@dataclass(slots=True)
class InFlight:
    """A step launched and not read back (async scheduling): its sampled sequences, in the rows
    of its draw."""

    reqs: list[Request]
    draw: SampleLaunch


def _nonfinite(position: int) -> str:
    return f"the model produced non-finite logits (NaN or inf) predicting position {position}"


def _needs_order(params: SamplingParams, o: RequestOptions) -> bool:
    """Whether a request needs the host between its steps, so the steps run in order while it is
    there: its grammar or logit processors read its tokens, its tracer, prompt scores, first
    tokens or kept logits are host work around the pass (`sampler.plain_row`)."""
    return bool(params.structured_outputs is not None or has_processors(params) or o.tracer is not None
                or params.prompt_logprobs is not None or o.first_tokens or o.return_logits or params.max_tokens == 0)


def _scores_prompt(r: Request) -> bool:
    """Whether this step's chunk of `r` holds prompt positions to score (completion 0 only:
    the others share its prompt)."""
    return r.params.prompt_logprobs is not None and r.index == 0 and r.num_computed_tokens < r.num_prompt_tokens - 1
