"""`LLMEngine`: requests in, tokens out, one batched step at a time.

    add_request -> [step: schedule -> model runner (one forward pass over every scheduled
                    request) -> sampler -> detokenize and stop checks -> outputs]* -> finished

The engine owns the tokenizer, the model runner, the KV cache manager and the scheduler.
`step` returns a `RequestOutput` for every request that produced something; the offline `LLM`
and the async wrapper (`async_engine.py`) drive it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import time

import torch

from nextoken import kernels
from nextoken.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from nextoken.engine_args import EngineArgs
from nextoken.kv_cache.manager import KVCacheManager
from nextoken.engine.output_processor import RequestGroup, finish_sequence, make_output, process_token
from nextoken.engine.request import Request
from nextoken.engine.scheduler import Scheduler
from nextoken.errors import InvalidRequest
from nextoken.loader.gguf import GGUFFile
from nextoken.loader.hf import HFModelDir
from nextoken.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nextoken.kv_cache.tensors import bytes_per_block, ring_blocks
from nextoken.runner.model_runner import ModelRunner, SequenceInput
from nextoken.sample.sampler import Sampler, SamplerRequest, make_generator
from nextoken.sample.watermark import WatermarkConfig
from nextoken.sampling_params import SamplingParams
from nextoken.spec.draft import DraftProposer, check_same_vocabulary
from nextoken.spec.ngram import propose_ngram
from nextoken.spec.verify import verify
from nextoken.structured.backend import GrammarCompiler
from nextoken.loader.source import load_tokenizer, model_dtype, open_model
from nextoken.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger("nextoken.engine")

DEFAULT_KV_SHARE = 0.25  # of available memory, when no budget is given
DEFAULT_KV_CAP = 1 << 30  # bytes
STEP_LOG_LEN = 512  # steps kept in `LLMEngine.step_log`
RECENT_REQUESTS = 32  # finished requests kept in `LLMEngine.recent_requests`


def default_kv_memory() -> int:
    """A quarter of the memory available now (from /proc/meminfo), at most 1 GiB."""
    avail = 8 << 30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return min(int(avail * DEFAULT_KV_SHARE), DEFAULT_KV_CAP)


def completion_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion `index` of a request seeded with `seed` (completion 0 uses `seed`)."""
    if seed is None or index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index) & 0xFFFF_FFFF_FFFF_FFFF


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
        dtype = model_dtype(source, args.dtype)
        self.tokenizer = tokenizer or load_tokenizer(source)
        if args.chat_template is not None:
            self.tokenizer.chat_template = _read_template(args.chat_template)
        source.release_metadata()  # the vocabulary lists are in the tokenizer now
        if tp is not None and args.speculative == "draft":
            raise InvalidRequest("a draft model is not supported with tensor parallelism; use --speculative-method "
                                 "ngram", "speculative_model")
        self.runner = ModelRunner.from_engine_args(args, source, tp)
        self.config = self.runner.config
        ctx = self.config.context_length
        # tokens per sequence: the model's context, or less when asked (a smaller default KV cache)
        self.max_model_len = min(ctx, args.max_model_len or ctx)
        method = args.speculative
        speculative = SpeculativeConfig(method, args.speculative_model, args.num_speculative_tokens) \
            if method is not None else None
        cache = CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory, args.enable_prefix_caching,
                            args.kv_cache_dtype)
        scheduler = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill,
                                    args.max_model_len)
        self.speculative = speculative
        self.watermark = WatermarkConfig(args.watermark_gamma, args.watermark_delta)
        self.draft: DraftProposer | None = None
        per_block = bytes_per_block(self.config, cache.block_size, dtype, cache.cache_dtype)
        if method == "draft":
            if draft_source is None:
                raise InvalidRequest("speculative method 'draft' needs a draft model", "speculative_model")
            draft_tok = load_tokenizer(draft_source)
            draft_source.release_metadata()
            draft_runner = ModelRunner(draft_source, dtype, dense_weights=False, enforce_eager=args.enforce_eager)
            check_same_vocabulary(self.tokenizer, draft_tok, self.config.vocab_size,
                                  draft_runner.config.vocab_size, speculative.model or "draft")
            self.draft = DraftProposer(draft_runner, Sampler(self.tokenizer.eog_token_ids, self.watermark,
                                                             draft_runner.plan.kernels.sampling))
            per_block += bytes_per_block(draft_runner.config, cache.block_size, dtype, cache.cache_dtype)  # its cache
        if self.draft is not None and self.draft.runner.config.sliding_layers:
            raise InvalidRequest("a draft model with sliding-window layers is not supported", "speculative_model")
        # default budget: a share of free memory, but no more than max_num_seqs full contexts
        bs = cache.block_size
        ring, per_ring = 0, 0
        if self.config.sliding_layers:  # each sequence's ring: its window plus this step's drafts
            lookahead = speculative.num_speculative_tokens if speculative else 0
            ring = ring_blocks(self.config.sliding_window, bs, 1 + lookahead)
            per_ring = ring * self.config.sliding_kv_bytes_per_token(torch.finfo(dtype).bits // 8) * bs
        full = scheduler.max_num_seqs * (-(-self.max_model_len // bs) * per_block + per_ring)
        budget = cache.memory_bytes or min(default_kv_memory(), full)
        # rings for max_num_seqs sequences when they fit in half the budget, else for fewer
        num_rings = max(1, min(scheduler.max_num_seqs, budget // 2 // per_ring)) if ring else 0
        if per_block:
            num_blocks = cache.num_blocks or max(1, (budget - num_rings * per_ring) // per_block)
        else:  # every layer slides (Mistral): block tables cost nothing, any number will do
            num_blocks = cache.num_blocks or scheduler.max_num_seqs * -(-self.max_model_len // bs)
        self.cache_config = cache
        if not scheduler.enable_chunked_prefill:  # a whole prompt must fit in one step
            scheduler = SchedulerConfig(scheduler.max_num_seqs,
                                        max(scheduler.max_num_batched_tokens, self.max_model_len), False,
                                        scheduler.max_model_len)
        self.scheduler_config = scheduler
        self.kv = KVCacheManager(num_blocks, bs, cache.enable_prefix_caching, num_rings * ring, ring)
        self.runner.init_kv_cache(num_blocks, bs, num_rings * ring, ring, cache.cache_dtype)
        rings = f", rings of {ring} blocks for {num_rings} sequences" if ring else ""
        log.info("KV cache: %d blocks of %d tokens (%s, %.1f MiB%s), max_model_len %d, max_num_seqs %d, "
                 "prefix caching %s", num_blocks, bs, cache.cache_dtype, self.runner.kv.nbytes / 2**20, rings,
                 self.max_model_len, scheduler.max_num_seqs, "on" if self.kv.enable_caching else "off")
        if self.draft is not None:
            self.draft.runner.init_kv_cache(num_blocks, cache.block_size, cache_dtype=cache.cache_dtype)
        self.scheduler = Scheduler(scheduler, self.kv, speculative.num_speculative_tokens if speculative else 0)
        # drafted / accepted tokens, verification steps (one per request and step), emitted tokens
        self.spec_counts = {"drafted": 0, "accepted": 0, "steps": 0, "emitted": 0}
        self.sampler = Sampler(self.tokenizer.eog_token_ids, self.watermark, self.runner.plan.kernels.sampling)
        # structured output: llguidance over our vocabulary, built on the first request that asks
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size)
        self.groups: dict[str, RequestGroup] = {}
        self._seq_group: dict[Request, RequestGroup] = {}
        self._ids = itertools.count()
        self.num_aborted = 0  # requests aborted before they finished
        self.num_failed = 0  # requests failed by a model fault (non-finite logits)
        self.num_steps = 0
        # what the inspector shows (`nextoken.inspect`): the last steps' batches and the last
        # finished requests, as small dictionaries (a few hundred bytes a step)
        self.step_log: collections.deque[dict] = collections.deque(maxlen=STEP_LOG_LEN)
        self.recent_requests: collections.deque[dict] = collections.deque(maxlen=RECENT_REQUESTS)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, opened=None) -> LLMEngine:
        """The engine `args` describes: starts or joins the tensor-parallel ranks (with
        ``tensor_parallel_size`` > 1), sets the compute threads, resolves the model (and the
        draft model) to a file or folder, pulling a catalog model when `args.auto_pull`, and
        opens them. Raises `ModelLoadError` when a model cannot be found or read.

        On a torchrun rank other than 0 this never returns: the process loads its shard, follows
        rank 0's steps (`distributed.follower`), and exits when rank 0 stops. `opened`: ``(the
        GGUFFile of args.model, its Tokenizer)`` when the caller opened them already (the quick
        start of ``nextoken run``), so they are not read twice."""
        from nextoken.catalog import resolve_model
        from nextoken.distributed.group import init_tensor_parallel, rank_threads
        from nextoken.distributed.sharding import partition
        from nextoken.runner.follower import follow
        from nextoken.runner.model_runner import read_config
        from nextoken.runner.threads import configure_threads

        source = opened[0] if opened else open_model(resolve_model(args.model, auto_pull=args.auto_pull))
        if args.tensor_parallel_size > 1:  # a size the model cannot take: one error here, before any rank starts
            partition(read_config(source), 0, args.tensor_parallel_size)
        tp = init_tensor_parallel(args.tensor_parallel_size, args.to_cli_args())
        if tp is not None and tp.rank != 0:
            raise SystemExit(follow(args, tp))
        configure_threads(args.num_threads if tp is None else rank_threads(args.num_threads))
        draft = None
        if args.speculative == "draft":
            draft = open_model(resolve_model(args.speculative_model, auto_pull=args.auto_pull))
        try:
            return cls(args, source, draft, tp, tokenizer=opened[1] if opened else None)
        except BaseException:
            if tp is not None:
                tp.close()
            raise

    # -- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int], params: SamplingParams, truncate: bool = False) -> list[int]:
        """Token ids of `prompt` (text, or ids already), fitted to the context window.

        Raises `InvalidRequest` when the prompt is empty, holds ids outside the vocabulary, or
        when prompt tokens plus max_tokens exceed the context length (naming both numbers) and
        `truncate` is False; with `truncate` the oldest prompt tokens are dropped instead.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary "
                                     f"[0, {self.config.vocab_size})", "prompt")
            ids = list(prompt)
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidRequest("prompt is empty", "prompt")
        ctx = self.max_model_len
        if len(ids) + params.max_tokens > ctx:
            if not truncate or params.max_tokens >= ctx:
                raise InvalidRequest(
                    f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                    f"{len(ids) + params.max_tokens} > the context length {ctx} (max_model_len); shorten the "
                    "prompt, lower max_tokens, or truncate the prompt (truncate_prompt)", "max_tokens")
            ids = ids[len(ids) + params.max_tokens - ctx :]
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_text: str | None = None,
                    truncate_prompt: bool = False, tracer=None, keep_prompt_hidden: bool = False) -> str:
        """Queue a request; returns its id. Raises `InvalidRequest` for bad parameters, a prompt
        that does not fit the context window, or one that could never fit in the KV cache.

        `keep_prompt_hidden` (with ``params.prompt_logprobs``): also keep the final hidden
        state of every scored prompt position, ``RequestGroup.prompt_hidden`` (``[n - 1, hidden]``
        once the prompt is computed; `nextoken.evaluate` turns them into whole distributions).

        `tracer` (see `nextoken.trace`) records every stage of this request: it runs in a
        forward pass of its own, on the reference attention, without the prefix cache or
        speculation; the other requests of the step are batched as usual."""
        params = (params or SamplingParams()).validate(self.config.vocab_size)
        ids = self.encode_prompt(prompt, params, truncate_prompt)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        needed = self.kv.blocks_for(len(ids) + params.max_tokens)
        if needed > self.kv.pool.num_blocks:
            raise InvalidRequest(
                f"the request needs {needed} KV cache blocks ({len(ids)} prompt + {params.max_tokens} new "
                f"tokens) but the cache holds {self.kv.pool.num_blocks}; raise the KV cache memory or "
                "lower max_tokens", "max_tokens")
        text = prompt_text if prompt_text is not None else (prompt if isinstance(prompt, str) else None)
        if tracer is not None and params.n != 1:
            raise InvalidRequest("a traced request takes n=1", "n")
        if tracer is not None and self.runner.tp is not None:
            raise InvalidRequest("tracing a request is not available with tensor parallelism", "trace")
        spec = params.structured_outputs  # compiled (or found in the cache) before anything is queued
        grammars = [self.grammars.sequence_grammar(spec) for _ in range(params.n)] if spec else [None] * params.n
        seqs = []
        for i in range(params.n):
            seqs.append(Request(f"{request_id}#{i}", ids, params, make_generator(completion_seed(params.seed, i)),
                                group_id=request_id, index=i, parent=seqs[0] if i else None))
        group = RequestGroup(
            request_id, text, ids, seqs,
            [IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                    params.include_stop_str_in_output) for _ in seqs],
            [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None,
                              cumulative_logprob=0.0 if params.logprobs is not None else None) for i in range(params.n)],
            RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(ids)))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(ids)
            if keep_prompt_hidden:
                group.prompt_hidden = torch.empty(0)  # sized on the first chunk
        self.groups[request_id] = group
        for s in seqs:
            s.sampler_row = SamplerRequest(params, s.prompt_ids, s.output_ids, s.generator, grammars[s.index])
            s.tracer = tracer
            self._seq_group[s] = group
            self.scheduler.add(s)
        if tracer is not None:
            tracer.on_prefill_start(ids)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (no-op for unknown or finished ids)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        if not group.finished:
            self.num_aborted += 1
        for s in group.seqs:
            if not s.finished:
                self.scheduler.finish(s)
                finish_sequence(group, s, "abort")
            self._seq_group.pop(s, None)
            if self.draft is not None:
                self.draft.forget(s)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and return the outputs that changed."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        record = {"step": self.num_steps, "time": start,
                  "prefill": [[r.group_id, n] for r, n in plan.scheduled.items() if r.num_computed_tokens < r.num_prompt_tokens],
                  "decode": [r.group_id for r in plan.scheduled if r.num_computed_tokens >= r.num_prompt_tokens],
                  "preempted": [r.group_id for r in plan.preempted], "spec": []}
        if plan.scheduled:
            traced = [r for r in plan.scheduled if r.tracer is not None]
            plain = {r: n for r, n in plan.scheduled.items() if r.tracer is None} if traced else plan.scheduled
            if plain:
                self._run(plain, plan.lookahead, record=record)
            for r in traced:  # tracing costs only the traced request: a pass of its own
                self._run({r: plan.scheduled[r]}, tracer=r.tracer)
        outputs = []
        for rid, group in list(self.groups.items()):
            if group.changed:
                outputs.append(make_output(group))
            if group.finished:
                del self.groups[rid]
                self._remember(group)
                for s in group.seqs:
                    self._seq_group.pop(s, None)
        if plan.scheduled or plan.preempted:
            record["ms"] = (time.perf_counter() - start) * 1000
            self.step_log.append(record)
            self.num_steps += 1
        return outputs

    def _remember(self, group: RequestGroup) -> None:
        """A finished request's summary for the inspector (`recent_requests`)."""
        m = group.metrics
        self.recent_requests.append({
            "request_id": group.request_id, "prompt_ids": group.prompt_ids,
            "outputs": [{"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": c.logprobs} for c in group.completions],
            "arrival_time": m.arrival_time, "first_token_time": m.first_token_time,
            "finished_time": m.finished_time, "num_cached_tokens": group.seqs[0].num_cached_tokens,
            "num_preemptions": sum(s.num_preemptions for s in group.seqs),
            "num_blocks": [self.kv.blocks_for(s.num_tokens) for s in group.seqs]})

    def _run(self, scheduled: dict[Request, int], lookahead: set[Request] = frozenset(), tracer=None,
             record: dict | None = None) -> None:
        """One forward pass over `scheduled` (request -> new tokens), then sampling or
        verification. `tracer`: the one traced request's recorder; `record`: this step's
        `step_log` entry, which gets the speculative verifications."""
        reqs = list(scheduled)
        drafts = self._propose([r for r in reqs if r in lookahead]) if lookahead else {}
        seqs = []
        for r, n in scheduled.items():
            toks = r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
            if r in drafts:  # verify: the last token and the drafts, each as a decode row
                seqs.append(SequenceInput(toks + drafts[r][0], r.num_computed_tokens, self.kv.block_ids(r.request_id),
                                          True, as_decodes=True, ring_ids=self.kv.ring_ids(r.request_id)))
            else:
                seqs.append(SequenceInput(toks, r.num_computed_tokens, self.kv.block_ids(r.request_id),
                                          r.num_computed_tokens + n == r.num_tokens,
                                          ring_ids=self.kv.ring_ids(r.request_id), keep_hidden=_scores_prompt(r)))
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
            self.scheduler.finish(r)
            finish_sequence(self._seq_group[r], r, "length")
        self._fail_nonfinite(logits, {r: ab for r, ab in rows.items() if not r.finished})
        to_sample = [r for r in reqs if r in rows and r not in drafts and not r.finished]
        drafts = {r: d for r, d in drafts.items() if not r.finished}
        if to_sample:
            idx = [rows[r][0] for r in to_sample]
            results = self.sampler(logits[idx], [r.sampler_row for r in to_sample], keep_details=tracer is not None)
            for i, (r, res) in enumerate(zip(to_sample, results)):
                if tracer is not None:
                    tracer.on_sample(logits[idx[i]], res, r.params)
                self._emit(r, [res])
        for r, (toks, qs) in drafts.items():
            a, b = rows[r]
            p_target = [] if record is not None else None
            results, accepted = verify(self.sampler, logits[a:b], toks, qs, r.sampler_row, p_target)
            if record is not None:
                record["spec"].append(_verification(r, toks, p_target, qs, accepted, results))
            c = self.spec_counts
            c["drafted"] += len(toks)
            c["accepted"] += accepted
            c["steps"] += 1
            c["emitted"] += len(results)
            r.num_computed_tokens += accepted  # the accepted drafts' keys and values stay; the rest roll back
            # draft one more than were accepted next time (each drafted token costs a verification
            # row); after nothing accepted, pause drafting for 1, 2, 4, 8 steps
            r.spec_k = min(self.speculative.num_speculative_tokens, accepted + 1)
            r.spec_backoff = 0 if accepted else min(8, 2 * r.spec_backoff or 1)
            r.spec_skip = r.spec_backoff
            self._emit(r, results)
            if not r.finished:
                self.kv.cache_full_blocks(r)
                if self.draft is not None:
                    self.draft.on_verified(r)

    def _fail_nonfinite(self, logits: torch.Tensor, rows: dict[Request, tuple[int, int]]) -> None:
        """Fail every request whose logits rows (``rows``: request -> [a, b) rows of `logits`)
        hold a NaN or an infinity: a model fault (overflowing activations, a broken weight) that
        would otherwise end in the sampler's traceback, or, greedy, in a silent garbage token. The
        request finishes with reason ``"error"`` and `RequestOutput.error` saying what happened;
        the batch's other requests go on. One float32 sum per row: NaN and inf both survive it."""
        if not rows:
            return
        finite = torch.isfinite(logits.float().sum(dim=-1)).tolist()
        for r, (a, b) in rows.items():
            if not all(finite[a:b]):
                self._fail_request(r, f"the model produced non-finite logits (NaN or inf) predicting position "
                                      f"{r.num_computed_tokens}")

    def _fail_request(self, r: Request, why: str) -> None:
        """Finish every sequence of `r`'s request with reason ``"error"`` (`n` > 1: the request
        fails as a whole), its message in `RequestOutput.error`; blocks only it holds leave the
        prefix cache (they may hold non-finite keys and values)."""
        group = self._seq_group[r]
        group.error = f"{why} of request {group.request_id}; its output so far is kept, nothing more is computed"
        log.error("%s", group.error)
        self.num_failed += 1
        for s in group.seqs:
            if not s.finished:
                self.kv.uncache(s)
                self.scheduler.finish(s)
                finish_sequence(group, s, "error")
                if self.draft is not None:
                    self.draft.forget(s)

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
                self._fail_request(r, f"the model produced non-finite prompt log-probabilities (NaN or inf) at "
                                      f"positions {start + 1}..{start + n}")
                continue
            group = self._seq_group[r]
            group.prompt_logprobs[start + 1 : start + 1 + n] = entries
            if group.prompt_hidden is not None:  # row p: position p, which scores token p + 1
                if group.prompt_hidden.numel() == 0:
                    group.prompt_hidden = hidden.new_empty(r.num_prompt_tokens - 1, hidden.shape[1])
                group.prompt_hidden[start : start + n] = hidden[:n]

    def _emit(self, r: Request, results) -> None:
        """Append sampled tokens to `r` in order, until one of them finishes it."""
        group = self._seq_group[r]
        grammar = r.sampler_row.grammar
        for res in results:
            if grammar is not None:
                grammar.accept(res.token)
            if process_token(group, r, res, self.tokenizer.eog_token_ids, self.max_model_len):
                self.scheduler.finish(r)
                finish_sequence(group, r)
                if self.draft is not None:
                    self.draft.forget(r)
                return

    def _propose(self, reqs: list[Request]) -> dict[Request, tuple[list[int], list | None]]:
        """Drafted tokens for decoding requests: each at most num_speculative_tokens (and one
        more than its last verification accepted), and never more than could be emitted before
        max_tokens or the context length."""
        sc = self.speculative
        k_max = sc.num_speculative_tokens
        if sc.disable_by_batch_size is not None and len(reqs) > sc.disable_by_batch_size:
            return {}
        batch = []
        for r in reqs:
            if r.spec_skip > 0:
                r.spec_skip -= 1
                continue
            k = min(r.spec_k or k_max, r.params.max_tokens - len(r.output_ids) - 1, self.max_model_len - r.num_tokens - 1)
            if k > 0 and r.num_computed_tokens == r.num_tokens - 1:
                batch.append((r, k))
        if self.draft is not None:
            out = self.draft.propose(batch, lambda r: self.kv.block_ids(r.request_id))
        else:
            out = {r: (_grammar_prefix(r, propose_ngram(r.all_token_ids, k, sc.ngram_max, sc.ngram_min)), None)
                   for r, k in batch}
        return {r: v for r, v in out.items() if v[0]}

    def run_until_finished(self, request_ids: list[str]) -> list[RequestOutput]:
        """Step until every request of `request_ids` has finished; their final outputs, in that
        order. Whatever is left unfinished (an exception, an interrupt) is aborted."""
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(request_ids):
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
        finally:
            for rid in request_ids:
                if rid not in final:
                    self.abort_request(rid)
        return [final[rid] for rid in request_ids]

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (nothing to do otherwise);
        the engine cannot run afterwards. Also done at exit."""
        if self.runner.tp is not None:
            self.runner.tp.close()

    def import_prefix(self, token_ids: list[int], k, v) -> int:
        """Put keys and values computed elsewhere for the prompt `token_ids` into the prefix
        cache (`KVCacheManager.adopt_prefix`): k, v bf16 bits (uint16 NumPy arrays) ``[layers,
        Hkv, blocks, block_size, head_dim]``, block j holding positions ``j * block_size`` on,
        as `runner.quick_start` computes them. A request starting with these tokens then skips
        their prefill. Returns the tokens imported: 0 where the cache cannot take them (another
        dtype, block size or layout, int8 entries, sliding-window layers, prefix caching off)."""
        import numpy as np

        kv = self.runner.kv
        cfg = self.config
        shape = (len(cfg.full_layers), cfg.num_kv_heads, k.shape[2], kv.block_size, cfg.head_dim)
        if kv.quantized or kv.dtype != torch.bfloat16 or kv.sliding is not None or self.draft is not None or \
                k.shape != shape or v.shape != shape:  # a draft model's own cache would lack the prefix
            return 0
        ids = self.kv.adopt_prefix(token_ids)
        if ids:
            n = len(ids)
            index = torch.tensor(ids)
            for dst, src in ((kv.k, k), (kv.v, v)):
                part = torch.from_numpy(np.ascontiguousarray(src[:, :, :n])).view(torch.bfloat16)
                dst.index_copy_(2, index, part)
        return len(ids) * kv.block_size

    def warm_up(self) -> None:
        """Run one short greedy request (a prefill and a decode step) so that the first client
        does not pay for first-touch costs (the weights' pages, thread pools, kernel setup); a
        server answers /health only after it. The prefix-cache and speculative counters forget
        it. Raises `ModelLoadError` when the model's log-probabilities are not finite (a broken
        file or kernel: serving it would only give garbage)."""
        from nextoken.errors import ModelLoadError
        from nextoken.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
        rid = self.add_request(self.tokenizer.encode("Hello"), params, request_id="warm-up")
        result = self.run_until_finished([rid])[0]
        out = result.outputs[0]
        if result.error is not None or not out.logprobs_finite():
            raise ModelLoadError(f"the model gave non-finite log-probabilities on a warm-up prompt "
                                 f"({result.error or out.logprobs}); its weights or this build's kernels are broken "
                                 "(try --enforce-eager)")
        self.scheduler.prefix_cache_queries = self.scheduler.prefix_cache_hits = 0
        self.kv.pool.hits = self.kv.pool.queries = 0
        self.spec_counts = dict.fromkeys(self.spec_counts, 0)

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        """Queue lengths, KV cache usage (0..1), the prefix cache's block hit rate and its token
        counts (prompt tokens looked up, and found), preemptions, aborted and failed requests, the
        kernel fallbacks (calls a kernel the plan chose refused, by kernel), speculative decoding's
        counts."""
        pool = self.kv.pool
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_cache_usage": pool.usage, "num_blocks": pool.num_blocks, "free_blocks": pool.num_free_blocks,
                "prefix_cache_hit_rate": pool.hits / pool.queries if pool.queries else 0.0,
                "prefix_cache_queries": self.scheduler.prefix_cache_queries,
                "prefix_cache_hits": self.scheduler.prefix_cache_hits,
                "num_preemptions": self.scheduler.num_preemptions, "num_aborted": self.num_aborted,
                "num_failed": self.num_failed, "kernel_fallbacks": dict(kernels.fallbacks), **self.spec_stats()}

    def spec_stats(self) -> dict:
        """Speculative decoding: drafted and accepted token counts, the acceptance rate, and the
        mean number of tokens emitted per verification (accepted drafts plus one)."""
        c = self.spec_counts
        return {"spec_num_drafted_tokens": c["drafted"], "spec_num_accepted_tokens": c["accepted"],
                "spec_num_verify_steps": c["steps"],
                "spec_acceptance_rate": c["accepted"] / c["drafted"] if c["drafted"] else 0.0,
                "spec_mean_accepted_length": c["emitted"] / c["steps"] if c["steps"] else 0.0}


def _scores_prompt(r: Request) -> bool:
    """Whether this step's chunk of `r` holds prompt positions to score (completion 0 only:
    the others share its prompt)."""
    return r.params.prompt_logprobs is not None and r.index == 0 and r.num_computed_tokens < r.num_prompt_tokens - 1


def _grammar_prefix(r: Request, drafts: list[int]) -> list[int]:
    """Guessed drafts cut at the first token the request's grammar would refuse (a draft
    model's are drawn from masked distributions already)."""
    grammar = r.sampler_row.grammar
    return drafts[: grammar.valid_prefix(drafts)] if grammar is not None and drafts else drafts


def _read_template(path: str) -> str:
    """The text of a chat template file (`--chat-template`); `ModelLoadError` when unreadable."""
    from nextoken.errors import ModelLoadError

    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise ModelLoadError(f"cannot read the chat template {path}: {exc.strerror}") from None


def _verification(r: Request, drafts: list[int], p_target: list[float], draft_probs, accepted: int,
                  results) -> dict:
    """One speculative verification for the step log: the drafted tokens, how many the target
    accepted, the target probability the acceptance test used for each draft it checked (drafts
    after a rejection are not checked) and each draft's probability under the draft model (1 for
    an n-gram guess), and the tokens emitted."""
    q = [float(d[t]) for d, t in zip(draft_probs, drafts)] if draft_probs is not None else [1.0] * len(drafts)
    return {"request_id": r.group_id, "drafted": drafts, "accepted": accepted,
            "p_target": [round(x, 4) for x in p_target], "q_draft": [round(x, 4) for x in q],
            "emitted": [res.token for res in results]}
