"""What one engine step did (`StepStats`), and the inspector's memory of recent steps and
requests (`StepHistory`), which subscribes to them.

`LLMEngine.step` builds one `StepStats` per step that did any work and hands it to every
subscriber (`LLMEngine.subscribe`): the one observability channel. The inspector's history is
one subscriber, the server's Prometheus metrics another.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

from nextoken.tokenizer.detokenizer import NO_TEXT

STEP_LOG_LEN = 512  # steps kept in `StepHistory.steps`
RECENT_REQUESTS = 32  # finished requests kept in `StepHistory.requests`


@dataclass
class StepStats:
    """One step: its number, start (``time.perf_counter``) and duration (ms); the prefill chunks
    (``[request id, tokens]``), decoding and preempted request ids; the speculative
    verifications (`spec.speculator.verification_record`); the requests that finished (their
    `RequestGroup`s and final `RequestOutput`s) and the ids of those that failed. Under async
    scheduling (`overlapped`), `wait_ms` is how long the host waited for the last step's tokens
    to come back: near 0 when the device keeps ahead of the host (the host sets the pace), near a
    pass's time when the host keeps ahead (the device does)."""

    step: int
    time: float
    prefill: list = field(default_factory=list)
    decode: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    spec: list = field(default_factory=list)
    ms: float = 0.0
    finished: list = field(default_factory=list)  # (RequestGroup, RequestOutput)
    failed: list = field(default_factory=list)
    overlapped: bool = False
    wait_ms: float = 0.0

    def record(self) -> dict:
        """The step as the inspector's JSON shows it."""
        return {"step": self.step, "time": self.time, "prefill": self.prefill, "decode": self.decode,
                "preempted": self.preempted, "spec": self.spec, "ms": self.ms, "overlapped": self.overlapped,
                "wait_ms": self.wait_ms}


class StepHistory:
    """The last `STEP_LOG_LEN` steps (`steps`, as `StepStats.record` dictionaries, a few hundred
    bytes each) and the last `RECENT_REQUESTS` finished requests (`requests`), for the inspector
    (`nextoken.inspect`). blocks_for(tokens) -> KV blocks that many tokens take."""

    def __init__(self, blocks_for: Callable[[int], int]):
        self.blocks_for = blocks_for
        self.steps: collections.deque[dict] = collections.deque(maxlen=STEP_LOG_LEN)
        self.requests: collections.deque[dict] = collections.deque(maxlen=RECENT_REQUESTS)

    def __call__(self, stats: StepStats) -> None:
        self.steps.append(stats.record())
        for group, _ in stats.finished:
            self.requests.append(self._summary(group))

    def _summary(self, group) -> dict:
        m = group.metrics
        return {
            "request_id": group.request_id, "prompt_ids": group.prompt_ids,
            # (text None: its server process made it, `RequestOptions.detokenize`; the inspector decodes the ids)
            "outputs": [{"token_ids": list(c.token_ids), "text": None if d is NO_TEXT else c.text,
                         "finish_reason": c.finish_reason, "logprobs": c.logprobs}
                        for c, d in zip(group.completions, group.detoks)],
            "skip_special_tokens": group.seqs[0].params.skip_special_tokens,
            "arrival_time": m.arrival_time, "first_token_time": m.first_token_time,
            "finished_time": m.finished_time, "num_cached_tokens": group.seqs[0].num_cached_tokens,
            "priority": m.priority, "queue_time": m.queue_time,
            "num_preemptions": sum(s.num_preemptions for s in group.seqs),
            "num_blocks": [self.blocks_for(s.num_tokens) for s in group.seqs]}
