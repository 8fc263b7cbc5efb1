"""The order in which waiting requests are admitted, by scheduling policy (vLLM v1's
``core/sched/request_queue.py`` and ``--scheduling-policy``; SGLang's ``schedule_policy.py``):

- ``fcfs``: arrival order.
- ``priority``: lower `Request.priority` first (vLLM's convention), then arrival. The starvation
  guard: a request's effective priority improves by one for every `aging_s` seconds it has
  waited, so a long-waiting request of priority 10 eventually goes before newer ones of 0.
- ``fair``: the client that has been served least first (the Virtual Token Counter of Sheng et
  al., "Fairness in Serving Large Language Models", OSDI 2024, algorithm 2): each client's
  counter grows by the prompt tokens computed (weight 1) and the tokens generated (weight 2) of
  its requests; a client that comes back after `IDLE_S` seconds with nothing queued or running
  starts at the smallest counter of the clients queued (its lift), so idle time earns no credit,
  while one that sends its next request as its last one ends keeps its place in the share. Ties, and
  the requests of one client, go by arrival.

In every policy a request sent back to the queue (preempted) or continuing one that already held
a place (a beam search's next step: `Request.continuation`) goes before the requests that arrived
after it: it keeps its place. The queue is a list, ordered once per step (`ordered`): the waiting
queue of a 2-core server holds hundreds of requests, not millions.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterator

from nextoken.config import SCHEDULING_POLICIES as POLICIES
from nextoken.engine.request import Request

PREFILL_WEIGHT, DECODE_WEIGHT = 1.0, 2.0  # the Virtual Token Counter's w_p and w_q (the paper's defaults)
IDLE_S = 1.0  # a fair client with nothing in the engine this long is idle: its counter is lifted


class WaitingQueue:
    """The waiting requests of a `Scheduler` under `policy` (one of `POLICIES`); `aging_s`: the
    priority policy's starvation guard, in seconds per priority level (0: none). Raises
    `ValueError` for an unknown policy."""

    def __init__(self, policy: str = "fcfs", aging_s: float = 0.0):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy, self.aging_s = policy, aging_s
        self._items: list[Request] = []
        self._seq = itertools.count()  # queue order: arrivals count up ...
        self._front = itertools.count(-1, -1)  # ... requests that keep their place count down
        self.counters: dict[str, float] = {}  # fair: the service each client has had (weighted tokens)
        self._in_engine: dict[str, int] = {}  # fair: each client's requests queued or running
        self._left: dict[str, float] = {}  # fair: when each client's last request ended

    # -- membership -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a new request (a continuation keeps its place: `prepend`)."""
        if req.continuation:
            self.prepend(req)
            return
        self._lift(req)
        req.queue_seq, req.queued_time = next(self._seq), time.perf_counter()
        self._items.append(req)

    def prepend(self, req: Request) -> None:
        """Queue a request ahead of those that arrived after it (preempted, or a continuation)."""
        req.queue_seq, req.queued_time = next(self._front), time.perf_counter()
        self._items.append(req)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __contains__(self, req: Request) -> bool:
        return req in self._items

    def __getitem__(self, i: int) -> Request:
        """The `i`-th request in admission order now."""
        return self.ordered()[i]

    # -- order ------------------------------------------------------------------------------
    def ordered(self, now: float | None = None) -> list[Request]:
        """The waiting requests in admission order, at time `now` (perf_counter seconds)."""
        if self.policy == "fcfs":
            return sorted(self._items, key=lambda r: r.queue_seq)
        if self.policy == "priority":
            now = time.perf_counter() if now is None else now
            return sorted(self._items, key=lambda r: (self.effective_priority(r, now), r.queue_seq))
        return sorted(self._items, key=lambda r: (self.counters.get(r.client, 0.0), r.queue_seq))

    def effective_priority(self, req: Request, now: float) -> int:
        """`req`'s priority less one level per `aging_s` seconds it has waited."""
        if not self.aging_s:
            return req.priority
        return req.priority - int((now - req.queued_time) / self.aging_s)

    # -- the Virtual Token Counter (fair) ---------------------------------------------------
    def arrived(self, req: Request) -> None:
        """A request entered the engine (queued, or waiting for its prompt's fork)."""
        self._in_engine[req.client] = self._in_engine.get(req.client, 0) + 1

    def left(self, req: Request) -> None:
        """A request left the engine (finished or aborted)."""
        n = self._in_engine.get(req.client, 0) - 1
        if n <= 0:
            self._in_engine.pop(req.client, None)
            self._left[req.client] = time.perf_counter()
        else:
            self._in_engine[req.client] = n

    def charge(self, req: Request, prefill_tokens: int, decode_tokens: int) -> None:
        """Count a step's service to `req`'s client (the scheduler calls it under ``fair``)."""
        self.counters[req.client] = self.counters.get(req.client, 0.0) + \
            PREFILL_WEIGHT * prefill_tokens + DECODE_WEIGHT * decode_tokens

    def _lift(self, req: Request) -> None:
        """A client idle for `IDLE_S` (nothing queued or running) starts at the least counter of
        the clients queued."""
        if self.policy != "fair" or self._in_engine.get(req.client, 0) > 1 or \
                time.perf_counter() - self._left.get(req.client, float("-inf")) < IDLE_S:
            return
        others = [self.counters.get(r.client, 0.0) for r in self._items]
        if others:
            self.counters[req.client] = max(self.counters.get(req.client, 0.0), min(others))
