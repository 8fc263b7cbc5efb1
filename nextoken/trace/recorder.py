"""`TraceRecorder`: the one recorder of a traced request, behind `nextoken explain` (rendered by
`trace.explain` as text or JSON) and the inspector (`inspect.trace`'s views: head labels,
attention maps, the logit lens).

It implements the `Tracer` hooks (`trace.Tracer`): the engine runs the traced request in a
forward pass of its own on the reference attention, whose probabilities reach `on_layer`
through the attention metadata's sink. For the prompt's rows (prefill chunks are stitched
together by position) it keeps the residual stream after the embedding, inside every layer
after attention, and after every layer, and the attention weights (every query row, or with
`last_row_only` the prompt's last one); for every pass the time per layer and the KV cache's
size; for every sampled token the logits' top candidates with the sampler's kept mask and
distribution, and the first token's whole logits.
"""

from __future__ import annotations

import time

import torch

TOP_KEPT = 20  # candidates kept per sampled token


class TraceRecorder:
    """Records one request. After the run: `token_ids` (the prompt), `attention[layer]` float16
    ``[heads, T, T]`` (row = query position; with `last_row_only` ``[heads, T]``, the last
    prompt position's row), `residual[l]` float32 ``[T, hidden]`` (l = 0: the embeddings, l = i
    + 1: after layer i), `mid[i]` float32 ``[T, hidden]`` (inside layer i: after the attention's
    residual add, before the feed-forward), `layer_ms` (per layer, summed over passes), `passes`
    (per pass: prompt rows recorded, tokens in the cache, KV bytes, ms), `steps` (per sampled
    token: `chosen`, the `TOP_KEPT` candidates by logit with ``logit``, ``prob``, ``kept``,
    ``sample_prob``, and ``kept_count``), `first_logits` float32 ``[vocab]`` (what the first token was drawn from)."""

    wants_probs = True

    def __init__(self, config, last_row_only: bool = False):
        self.cfg, self.last_row_only = config, last_row_only
        self.token_ids: list[int] = []
        self.attention: list[torch.Tensor] = []
        self.residual = torch.empty(0)
        self.mid = torch.empty(0)
        self.layer_ms = [0.0] * config.num_layers
        self.passes: list[dict] = []
        self.steps: list[dict] = []
        self.first_logits: torch.Tensor | None = None
        self.ablation = None  # a `layers.attention.Ablation` the traced pass applies (the inspector's interventions)
        # activation patching: (layer, position, vector [hidden]): the residual stream after `layer`
        # at prompt `position` is replaced by `vector` (another prompt's, `inspect.interventions`)
        self.patch: tuple[int, int, torch.Tensor] | None = None
        self._at = 0  # prompt rows recorded so far
        self._q = 0  # prompt rows in this pass
        self._t = 0.0
        self._pass_start = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    # -- the hooks ------------------------------------------------------------------------
    def on_prefill_start(self, prompt_ids: list[int]) -> None:
        cfg, t = self.cfg, len(prompt_ids)
        self.token_ids = list(prompt_ids)
        shape = (cfg.num_heads, t) if self.last_row_only else (cfg.num_heads, t, t)
        self.attention = [torch.zeros(shape, dtype=torch.float16, device="cpu") for _ in range(cfg.num_layers)]
        self.residual = torch.zeros(cfg.num_layers + 1, t, cfg.hidden_size, device="cpu")
        self.mid = torch.zeros(cfg.num_layers, t, cfg.hidden_size, device="cpu")

    def on_embedding(self, h: torch.Tensor, cos, sin) -> None:
        now = time.perf_counter()
        self._pass_start = self._pass_start or now
        self._q = min(h.shape[0], self.num_tokens - self._at)
        if self._q > 0:
            self.residual[0, self._at : self._at + self._q] = h[: self._q].float()
        self._t = now

    def on_layer(self, i: int, h: torch.Tensor, probs: list | None, mid: torch.Tensor | None = None) -> None:
        now = time.perf_counter()
        self.layer_ms[i] += (now - self._t) * 1000
        self._t = now
        if self._q <= 0:
            return
        a, b = self._at, self._at + self._q
        self.residual[i + 1, a:b] = h[: self._q].float()
        if mid is not None:
            self.mid[i, a:b] = mid[: self._q].float()
        if not probs:
            return
        p = probs[0]  # [heads, rows of this pass, keys]
        if not self.last_row_only:
            self.attention[i][:, a:b, :b] = p[:, : self._q, :b].to(torch.float16)
        elif b == self.num_tokens:  # the pass that holds the prompt's last row
            self.attention[i][:, :b] = p[:, self._q - 1, :b].to(torch.float16)

    def on_forward_done(self, num_tokens: int, kv_bytes: int) -> None:
        now = time.perf_counter()
        self.passes.append({"tokens": max(self._q, 0), "cached_tokens": num_tokens, "kv_bytes": kv_bytes,
                            "ms": (now - (self._pass_start or now)) * 1000})
        self._at += max(self._q, 0)
        self._pass_start = 0.0

    def on_sample(self, logits: torch.Tensor, res, params) -> None:
        logits = logits.float().cpu()
        if self.first_logits is None:
            self.first_logits = logits.clone()
        probs = logits.softmax(-1)
        vals, ids = logits.topk(min(TOP_KEPT, logits.shape[0]))
        self.steps.append({
            "chosen": res.token,
            "candidates": [{"id": t, "logit": v, "prob": float(probs[t]),
                            "kept": bool(res.kept[t]) if res.kept is not None else None,
                            "sample_prob": float(res.probs[t]) if res.probs is not None else None}
                           for v, t in zip(vals.tolist(), ids.tolist())],
            "kept_count": int(res.kept.sum()) if res.kept is not None else None})

    def patched(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer `i`'s output rows ``[rows, hidden]`` of this pass with `patch` applied where it
        falls in them (prefill chunks: the rows after the ones recorded so far)."""
        if self.patch is None or self.patch[0] != i:
            return h
        row = self.patch[1] - self._at
        if not 0 <= row < max(self._q, 0):
            return h
        h = h.clone()
        h[row] = self.patch[2].to(h.dtype)
        return h

    # -- what the renderers read ------------------------------------------------------------
    def last_row(self, layer: int) -> torch.Tensor:
        """`layer`'s attention from the prompt's last position, float32 ``[heads, T]``."""
        a = self.attention[layer]
        return (a if self.last_row_only else a[:, -1, :]).float()
