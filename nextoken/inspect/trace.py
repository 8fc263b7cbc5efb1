"""One prompt traced through the model as an engine request: attention weights of every layer
and head, the residual stream after every layer (for the logit lens), and time per layer.

`InspectTracer` implements the tracer hooks (`nextoken.trace`); the engine runs the traced
request in a forward pass of its own on the reference attention, so only that request pays for
tracing. Prefill chunks are stitched together by position.
"""

from __future__ import annotations

import base64
import time

import torch

from nextoken.errors import NotFound
from nextoken.inspect.text import display

MAX_TRACE_TOKENS = 512  # attention traces keep [layers, heads, T, T] weights

# a head's label: the pattern that takes at least this share of its attention on average
LABEL_THRESHOLD = 0.5
BROAD_ENTROPY = 0.7  # normalised entropy at or above which an unlabelled head is "broad"
LABEL_RULE = (f"over every query row after the first: the mean weight on the previous token, on the first "
              f"token and on itself; the largest of the three names the head (previous token / first token "
              f"(sink) / self) when it is at least {LABEL_THRESHOLD}; otherwise 'broad' when the mean "
              f"normalised entropy of the rows (entropy / log(keys seen)) is at least {BROAD_ENTROPY}, "
              f"else 'mixed'")


class InspectTracer:
    """Records one request's prompt pass. After the run: `attention[layer]` float16
    ``[heads, T, T]`` (row = query position), `residual[l]` float32 ``[T, hidden]`` (l = 0: the
    embeddings, l = i + 1: after layer i), `layer_ms` (per layer, summed over chunks), and the
    logits the first token was sampled from (`last_logits`, ``[vocab]``)."""

    def __init__(self, config, num_tokens: int):
        heads, layers = config.num_heads, config.num_layers
        self.num_tokens = num_tokens
        self.attention = [torch.zeros(heads, num_tokens, num_tokens, dtype=torch.float16) for _ in range(layers)]
        self.residual = torch.zeros(layers + 1, num_tokens, config.hidden_size)
        self.layer_ms = [0.0] * layers
        self.embed_ms = 0.0
        self.passes: list[dict] = []
        self.last_logits: torch.Tensor | None = None
        self.token_ids: list[int] = []
        self._at = 0  # prompt rows recorded so far
        self._q = 0  # rows in this pass
        self._t = 0.0
        self._pass_start = 0.0

    def on_prefill_start(self, prompt_ids: list[int]) -> None:
        self.token_ids = list(prompt_ids)

    def on_embedding(self, h: torch.Tensor, cos, sin) -> None:
        now = time.perf_counter()
        self._pass_start = self._pass_start or now
        self._q = min(h.shape[0], self.num_tokens - self._at)
        if self._q > 0:
            self.residual[0, self._at : self._at + self._q] = h[: self._q].float()
        self._t = now

    def on_layer(self, i: int, h: torch.Tensor, probs) -> None:
        now = time.perf_counter()
        self.layer_ms[i] += (now - self._t) * 1000
        self._t = now
        if self._q <= 0:
            return
        a, b = self._at, self._at + self._q
        self.residual[i + 1, a:b] = h[: self._q].float()
        if probs:
            p = probs[0][:, : self._q, : b]
            self.attention[i][:, a:b, :b] = p.to(torch.float16)

    def on_forward_done(self, num_tokens: int, kv_bytes: int) -> None:
        now = time.perf_counter()
        self.passes.append({"tokens": max(self._q, 0), "ms": (now - (self._pass_start or now)) * 1000,
                            "kv_bytes": kv_bytes})
        self._at += max(self._q, 0)
        self._pass_start = 0.0

    def on_sample(self, logits: torch.Tensor, res, params) -> None:
        if self.last_logits is None:
            self.last_logits = logits.float().clone()

    # -- views ------------------------------------------------------------------------------
    def head_stats(self, layer: int) -> list[dict]:
        """Per head of `layer`: mean weight on the previous token, the first token and itself,
        the mean normalised entropy, and the label `LABEL_RULE` gives."""
        a = self.attention[layer].float()  # [H, T, T]
        t = a.shape[1]
        out = []
        if t < 2:
            return [{"label": "self", "prev": 0.0, "first": 0.0, "self": 1.0, "entropy": 0.0}] * a.shape[0]
        rows = torch.arange(1, t)
        prev = a[:, rows, rows - 1].mean(-1)
        first = a[:, rows, 0].mean(-1)
        self_w = a[:, rows, rows].mean(-1)
        ent = -(a[:, 1:] * a[:, 1:].clamp_min(1e-12).log()).sum(-1)  # [H, T-1]
        ent = (ent / (rows.float() + 1).log()).mean(-1)
        for h in range(a.shape[0]):
            scores = {"previous token": float(prev[h]), "first token (sink)": float(first[h]), "self": float(self_w[h])}
            best = max(scores, key=scores.get)
            if scores[best] >= LABEL_THRESHOLD:
                label = best
            else:
                label = "broad" if float(ent[h]) >= BROAD_ENTROPY else "mixed"
            out.append({"label": label, "prev": round(float(prev[h]), 4), "first": round(float(first[h]), 4),
                        "self": round(float(self_w[h]), 4), "entropy": round(float(ent[h]), 4)})
        return out

    def attention_payload(self, layer: int) -> dict:
        """`layer`'s weights for the browser: uint8 ``[heads, T, T]`` (weight x 255, rounded),
        base64; rows sum to 1 within the rounding."""
        a = self.attention[layer].float()
        q = (a * 255).round().clamp(0, 255).to(torch.uint8).contiguous()
        return {"layer": layer, "heads": a.shape[0], "tokens": a.shape[1], "scale": 255,
                "data": base64.b64encode(q.numpy().tobytes()).decode()}

    def logit_lens(self, model, tokenizer, position: int, top: int = 5) -> list[dict]:
        """For each residual stream at `position` (embeddings, then after each layer): the top
        tokens it predicts through the final norm and the LM head (nostalgebraist 2020)."""
        if not 0 <= position < self.num_tokens:
            raise NotFound(f"the trace has no position {position} (it has 0..{self.num_tokens - 1})", "position")
        with torch.inference_mode():
            h = self.residual[:, position].to(model.dtype)
            probs = model.compute_logits(model.final_norm(h)).softmax(-1)
        vals, ids = probs.topk(top, dim=-1)
        return [{"layer": "embedding" if l == 0 else l - 1,
                 "top": [{"id": int(i), "token": display(tokenizer.token_text(int(i))), "prob": round(float(v), 4)}
                         for v, i in zip(vals[l], ids[l])]} for l in range(probs.shape[0])]
