"""The inspector's views of one traced prompt (a `trace.recorder.TraceRecorder`, the recorder
`nextoken explain` uses too): each head's label, a layer's attention map for the browser, the
logit lens. The engine runs the traced request in a forward pass of its own on the reference
attention, so only that request pays for tracing.
"""

from __future__ import annotations

import base64

import torch

from nextoken.errors import NotFound
from nextoken.inspect.text import display
from nextoken.trace.recorder import TraceRecorder

MAX_TRACE_TOKENS = 512  # attention traces keep [layers, heads, T, T] weights

# a head's label: the pattern that takes at least this share of its attention on average
LABEL_THRESHOLD = 0.5
BROAD_ENTROPY = 0.7  # normalised entropy at or above which an unlabelled head is "broad"
LABEL_RULE = (f"over every query row after the first: the mean weight on the previous token, on the first "
              f"token and on itself; the largest of the three names the head (previous token / first token "
              f"(sink) / self) when it is at least {LABEL_THRESHOLD}; otherwise 'broad' when the mean "
              f"normalised entropy of the rows (entropy / log(keys seen)) is at least {BROAD_ENTROPY}, "
              f"else 'mixed'")


def head_stats(rec: TraceRecorder, layer: int) -> list[dict]:
    """Per head of `layer` of a recorded prompt: mean weight on the previous token, the first
    token and itself, the mean normalised entropy, and the label `LABEL_RULE` gives."""
    a = rec.attention[layer].float()  # [H, T, T]
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

def attention_payload(rec: TraceRecorder, layer: int) -> dict:
    """`layer`'s weights for the browser: uint8 ``[heads, T, T]`` (weight x 255, rounded),
    base64; rows sum to 1 within the rounding."""
    a = rec.attention[layer].float()
    q = (a * 255).round().clamp(0, 255).to(torch.uint8).contiguous()
    return {"layer": layer, "heads": a.shape[0], "tokens": a.shape[1], "scale": 255,
            "data": base64.b64encode(q.numpy().tobytes()).decode()}


def lens_probs(model, residual: torch.Tensor) -> torch.Tensor:
    """What residual streams ``[n, hidden]`` predict if the model stopped there: softmax of the LM
    head after the final norm, float32 ``[n, vocab]`` on the CPU (nostalgebraist 2020). The
    residuals (a recorder's, on the CPU) go to the model's device for the head."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        return model.compute_logits(model.final_norm(residual.to(device, model.dtype))).float().softmax(-1).cpu()


def ranked(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest of each row of `scores` ``[rows, n]`` (k capped at n) and their indices,
    best first, equal scores in index order: the order greedy decoding ranks tokens in (`argmax`
    takes the lowest id among equal logits), where `torch.topk` leaves equal ones in any order.
    bf16 logits tie often: SmolLM2's lens gave "," and "." the same probability after a layer.
    Returns (values, indices), each ``[rows, k]``."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, dim=-1).values[:, -1]
    vals, ids = [], []
    for row, least in zip(scores, kth):
        cand = (row >= least).nonzero().squeeze(1)  # ascending ids; ties at the k-th may add more
        order = row[cand].sort(descending=True, stable=True).indices[:k]
        vals.append(row[cand[order]])
        ids.append(cand[order])
    return torch.stack(vals), torch.stack(ids)


def logit_lens(rec: TraceRecorder, model, tokenizer, position: int, top: int = 5) -> list[dict]:
    """For each residual stream at `position` (embeddings, then after each layer): the top
    tokens it predicts through the final norm and the LM head (nostalgebraist 2020)."""
    if not 0 <= position < rec.num_tokens:
        raise NotFound(f"the trace has no position {position} (it has 0..{rec.num_tokens - 1})", "position")
    vals, ids = ranked(lens_probs(model, rec.residual[:, position]), top)
    return [{"layer": "embedding" if l == 0 else l - 1,
             "top": [{"id": int(i), "token": display(tokenizer.token_text(int(i))), "prob": round(float(v), 4)}
                     for v, i in zip(vals[l], ids[l])]} for l in range(vals.shape[0])]


MAX_LENS_POSITIONS = 64  # the heatmap's columns: the last 64 positions of a longer trace


def lens_grid(rec: TraceRecorder, model, tokenizer) -> dict:
    """The logit lens at every position (the last `MAX_LENS_POSITIONS`) and every residual stream
    (embeddings, then after each layer): the top token and its probability through the final
    norm and the LM head, a layer at a time. ``cells[l][p]``: row l (0: embeddings, l: after layer
    l - 1), column p (position ``first + p``)."""
    t = rec.num_tokens
    first = max(0, t - MAX_LENS_POSITIONS)
    cells = []
    for l in range(rec.residual.shape[0]):
        vals, ids = lens_probs(model, rec.residual[l, first:t]).max(-1)
        cells.append([{"id": int(i), "token": display(tokenizer.token_text(int(i))), "prob": round(float(v), 4)}
                      for v, i in zip(vals, ids)])
    return {"first": first, "positions": t - first, "rows": ["embedding"] + list(range(len(cells) - 1)), "cells": cells}
