"""Tracing: what each stage did for one request (`nextoken explain`, the inspector).

A tracer is attached to one request (``RequestOptions(tracer=...)`` to ``add_request``) and implements
`Tracer`; the engine runs that request in a forward pass of its own. The one recorder is
`trace.recorder.TraceRecorder`; `trace.explain` renders it as text or JSON, `inspect.trace`
as the inspector's views. Requests without a tracer cost nothing extra.
"""

from __future__ import annotations

from typing import Protocol


class Tracer(Protocol):
    """The hooks of a traced request, in order: ``on_prefill_start(ids)`` when it is added; per
    forward pass ``on_embedding(h, cos, sin)``, ``on_layer(i, h, probs, mid)`` (h: the layer's
    output; probs: its per-sequence attention weights ``[H, q_len, seq_len]`` from the attention
    metadata's sink, when `wants_probs`, the pass then running the reference attention; mid: the
    residual stream after the attention's residual add ``[T, hidden]``) and ``on_forward_done(tokens
    in the cache, KV bytes)``; per sampled token ``on_sample(logits, SampleResult, params)``."""

    wants_probs: bool

    def on_prefill_start(self, prompt_ids: list[int]) -> None: ...
    def on_embedding(self, h, cos, sin) -> None: ...
    def on_layer(self, i: int, h, probs: list | None, mid=None) -> None: ...
    def on_forward_done(self, num_tokens: int, kv_bytes: int) -> None: ...
    def on_sample(self, logits, res, params) -> None: ...
