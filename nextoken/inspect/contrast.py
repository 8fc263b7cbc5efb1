"""The KV cache's effect, measured live on the loaded model (``POST /inspect/api/kv/contrast``):
the same greedy continuation generated with the cache (one request: each step computes the new
token only) and without it (each step a request that recomputes the whole prefix: a traced
request computes every token, `engine.scheduler`, and `Recompute` keeps the usual kernels).
"""

from __future__ import annotations

import numpy as np

class Recompute:
    """A tracer that records nothing: its request skips the prefix cache and computes every
    token, on the usual kernels (``wants_probs`` False)."""

    wants_probs = False

    def on_prefill_start(self, prompt_ids) -> None:
        pass

    def on_embedding(self, h, cos, sin) -> None:
        pass

    def on_layer(self, i, h, probs, mid=None) -> None:
        pass

    def on_forward_done(self, num_tokens, kv_bytes) -> None:
        pass

    def on_sample(self, logits, res, params) -> None:
        pass


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (ms per position): how a series grows with the context."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return 0.0
    return float(np.polyfit(xs, ys, 1)[0])
