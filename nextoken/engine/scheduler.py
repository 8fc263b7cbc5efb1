"""The scheduler: which requests run this step, and how many new tokens each.

Continuous batching (Yu et al. 2022, "Orca"; vLLM's V1 scheduler): every step, running requests
first (first come, first served), then waiting ones while the token budget, the limit on
running sequences and the free blocks allow. A long prompt is split into chunks that fit the
budget (chunked prefill) and mixes with other requests' decodes in the same step. When blocks
run out, the newest running request is preempted: it gives its blocks back and waits to be
recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nextoken.config import SchedulerConfig
from nextoken.kv_cache.manager import KVCacheManager
from nextoken.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The plan of one step: `scheduled` maps each request to its number of new tokens, in
    batch order; `preempted` lists the requests sent back to waiting."""

    scheduled: dict[Request, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    lookahead: set[Request] = field(default_factory=set)  # decodes with room for drafted tokens


class Scheduler:
    """`num_lookahead` (speculative decoding): running decodes also get KV slots, and budget,
    for that many drafted tokens, when the blocks are free (else they decode plainly)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, num_lookahead: int = 0):
        self.config = config
        self.kv = kv
        self.num_lookahead = num_lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.forking: list[Request] = []  # completions waiting for their parent's prompt
        self.num_preemptions = 0  # since the start
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache, since the start
        self.prefix_cache_hits = 0  # ... and found there

    # -- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        (self.forking if req.parent is not None else self.waiting).append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.forking)

    def finish(self, req: Request) -> None:
        """Take `req` out of every queue and free its blocks (finished or aborted)."""
        for q in (self.running, self.waiting, self.forking):
            if req in q:
                q.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._release_forks()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            extra = self.num_lookahead if n == 1 and req.num_tokens - req.num_computed_tokens == 1 else 0
            extra = min(extra, budget - n)
            if extra > 0 and self.kv.allocate_slots(req, n + extra):
                out.scheduled[req] = n
                out.lookahead.add(req)
                budget -= n + extra
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()  # the newest running request gives its blocks back
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.scheduled[req] = n
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # a traced or scored request computes every token (its trace, its prompt logprobs)
            full = req.tracer is not None or req.params.prompt_logprobs is not None
            lookup = req.num_computed_tokens == 0 and not full and self.kv.enable_caching
            computed = self.kv.get_computed_blocks(req) if lookup else []
            num_cached = len(computed) * self.kv.block_size
            n = req.num_tokens - req.num_computed_tokens - num_cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    return
                n = budget
            if not self.kv.allocate_slots(req, n, computed):
                return
            self.waiting.popleft()
            if lookup:  # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
            req.num_computed_tokens += num_cached
            if not req.admitted:
                req.num_cached_tokens = req.num_computed_tokens
                req.admitted = True
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled[req] = n
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _release_forks(self) -> None:
        """Completions 1..n-1 join the waiting queue once completion 0 has computed the prompt,
        sharing its prompt blocks."""
        for child in list(self.forking):
            parent = child.parent
            if parent.finished or parent.num_computed_tokens >= parent.num_prompt_tokens:
                self.forking.remove(child)
                if not parent.finished and parent.num_computed_tokens >= parent.num_prompt_tokens:
                    # share full blocks of the prompt but its last token: that one is recomputed
                    child.num_computed_tokens = self.kv.share_prefix(parent, child, child.num_prompt_tokens - 1)
                self.waiting.append(child)
