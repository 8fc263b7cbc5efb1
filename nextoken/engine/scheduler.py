"""The scheduler: which requests run this step, and how many new tokens each.

Continuous batching (Yu et al. 2022, "Orca"; vLLM's V1 scheduler): every step, running requests
first, then waiting ones, in the order of the scheduling policy (`engine.request_queue`: first
come first served, priority, or fair), while the token budget, the limit on running sequences and
the free blocks allow. A long prompt is split into chunks that fit the budget (chunked prefill)
and mixes with other requests' decodes in the same step. When blocks run out, the last running
request is preempted: it gives its blocks back (its full blocks stay in the prefix cache) and
waits, at the front, to be recomputed. Under ``priority`` the running requests are kept in
priority order, so the last is the lowest priority's newest, and a waiting request of a strictly
higher priority than it takes its place when no sequence or block is free (vLLM's priority
preemption).

Under async scheduling (`LLMEngine`'s ``async_scheduling``) a running request's last token may
still be in flight (`Request.num_pending`): it counts as a token to compute (its decode takes the
token on the device), and a request whose token in flight ends it by length is not scheduled.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from nextoken.config import SchedulerConfig
from nextoken.kv_cache.manager import KVCacheManager
from nextoken.engine.request import Request, RequestStatus
from nextoken.engine.request_queue import WaitingQueue


@dataclass
class SchedulerOutput:
    """The plan of one step: `scheduled` maps each request to its number of new tokens, in
    batch order; `preempted` lists the requests sent back to waiting; `block_copies` the blocks
    its pass copies first (part-filled blocks a request goes on from)."""

    scheduled: dict[Request, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    lookahead: set[Request] = field(default_factory=set)  # decodes with room for drafted tokens
    # (source, destination) block ids to copy, in order, before the pass (`KVCacheManager.copies`)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    sliding_copies: list[tuple[int, int]] = field(default_factory=list)  # ... of the sliding-window rings' pool


class Scheduler:
    """`num_lookahead` (speculative decoding): running decodes also get KV slots, and budget,
    for that many drafted tokens, when the blocks are free (else they decode plainly)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, num_lookahead: int = 0):
        self.config = config
        self.kv = kv
        self.num_lookahead = num_lookahead
        self.waiting = WaitingQueue(config.scheduling_policy, config.priority_aging_s)
        self.running: list[Request] = []
        self.forking: list[Request] = []  # completions waiting for their parent's prompt
        self.num_preemptions = 0  # since the start
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache, since the start
        self.prefix_cache_hits = 0  # ... and found there

    # -- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.arrived(req)
        if req.parent is not None:
            self.forking.append(req)
        else:
            self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.forking)

    def finish(self, req: Request) -> None:
        """Take `req` out of every queue and free its blocks (finished or aborted)."""
        for q in (self.running, self.waiting, self.forking):
            if req in q:
                q.remove(req)
        if req.status is not RequestStatus.FINISHED:
            self.waiting.left(req)
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
        out.block_copies, out.sliding_copies = self.kv.take_copies()
        if self.waiting.policy == "fair":  # its service counters
            for req, n in out.scheduled.items():
                decode = req.num_computed_tokens + n > req.num_prompt_tokens
                self.waiting.charge(req, 0 if decode else n, n if decode else 0)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and req.ends_in_flight(self.config.max_model_len):
                i += 1
                continue
            left = req.num_tokens + req.num_pending - req.num_computed_tokens
            n = min(left, budget)
            extra = self.num_lookahead if n == 1 and left == 1 else 0
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
        if not self.waiting or (len(self.running) >= self.config.max_num_seqs and self.waiting.policy != "priority"):
            return  # (nothing can be admitted: no need to order the queue)
        now = time.perf_counter()
        for req in self.waiting.ordered(now):
            if budget <= 0:
                return
            rank = self.waiting.effective_priority(req, now)
            if len(self.running) >= self.config.max_num_seqs:
                budget, made_room = self._preempt_for(rank, out, budget)
                if not made_room:
                    return
            # a traced or scored request computes every token (its trace, its prompt logprobs)
            full = req.tracer is not None or req.params.prompt_logprobs is not None
            lookup = req.num_computed_tokens == 0 and not full and self.kv.enable_caching
            computed = self.kv.get_computed_blocks(req) if lookup else []
            partial = self.kv.get_partial_block(req, len(computed)) if lookup else None
            extra = partial.num_tokens if partial else 0  # (the blocks start with the cached full ones)
            num_cached = len(computed) * self.kv.block_size + extra
            n = req.num_tokens - req.num_computed_tokens - num_cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    return
                n = budget
            while not self.kv.allocate_slots(req, n + extra, computed):
                budget, made_room = self._preempt_for(rank, out, budget)
                if not made_room and not self.running and self._release_waiting(req):
                    continue
                if not made_room:
                    return
            if partial:  # its first new block starts as a copy of the cached part-filled one
                self.kv.copy_partial(req, partial, len(computed))
            self.waiting.remove(req)
            if lookup:  # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
            req.num_computed_tokens += num_cached
            if not req.admitted:
                req.num_cached_tokens = req.num_computed_tokens
                req.admitted = True
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status, req.rank = RequestStatus.RUNNING, rank
            self._run(req)
            out.scheduled[req] = n
            budget -= n

    def _run(self, req: Request) -> None:
        """Add `req` to the running requests: last, or under ``priority`` in the order of their
        effective priority when admitted (then arrival), so that the last is the one to preempt."""
        if self.waiting.policy == "priority":
            bisect.insort(self.running, req, key=lambda r: (r.rank, r.queue_seq))
        else:
            self.running.append(req)

    def _preempt_for(self, rank: int, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Under ``priority``, preempt the last running request for a waiting one of effective
        priority `rank` if that is strictly higher (lower) than the one it was admitted with; a
        step's tokens already given to it go back to the budget. Returns (the budget, whether a
        request made room). The preempted request waits again at its own priority, so it cannot
        take the place back at once."""
        if self.waiting.policy != "priority" or not self.running or self.running[-1].rank <= rank:
            return budget, False
        victim = self.running.pop()
        budget += out.scheduled.pop(victim, 0)
        out.lookahead.discard(victim)
        self._preempt(victim)
        out.preempted.append(victim)
        return budget, True

    def _release_waiting(self, head: Request) -> bool:
        """Nothing runs and `head` does not fit: free the blocks other waiting requests hold (a
        completion of ``n > 1`` holds its parent's prompt blocks from its fork on), or no request
        would ever free them and the queue would stall for good. They compute those tokens again
        when admitted (or find them in the prefix cache). Returns whether any block was freed."""
        holders = [r for r in self.waiting if r is not head and self.kv.block_tables.get(r.request_id)]
        for r in holders:
            self.kv.free(r)
            r.num_computed_tokens = 0
        return bool(holders)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.prepend(req)

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
                self.waiting.add(child)
