"""The row-by-row sampler the batched one must equal: every row on its own, every edit written
out plainly (the sampler before it was batched), the filters by a sort of the whole vocabulary,
the draw by the inverse CDF of the kept tokens in id order with one uniform number per draw.
Only the tests use it."""

from __future__ import annotations

import torch

from nextoken.sample.sampler import SamplerRequest
from nextoken.sample.watermark import WatermarkConfig, green_mask

LOGIT_LIMIT = 1e30


def process(logits: torch.Tensor, row: SamplerRequest, history: list[int], eog_ids, watermark) -> torch.Tensor:
    """min_tokens block -> logit bias -> repetition -> presence/frequency -> watermark, on a copy."""
    p = row.params
    out = logits.clone()
    V = out.shape[0]
    if len(history) < p.min_tokens:
        out[[i for i in (*eog_ids, *p.stop_token_ids) if i < V]] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        out[t] += torch.tensor(b, dtype=out.dtype)
    if p.repetition_penalty != 1.0:
        for t in sorted(set(row.prompt_ids) | set(history)):
            v = out[t]
            v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            out[t] = v.clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
    if p.presence_penalty or p.frequency_penalty:
        for t in set(history):
            c = torch.tensor(float(history.count(t)))
            out[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0).float()
    if p.watermark:
        prev = history[-1] if history else row.prompt_ids[-1]
        cfg = watermark or WatermarkConfig()
        out[green_mask(prev, V, cfg.gamma)] += cfg.delta
    return out


def kept_mask(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row of temperature-scaled logits: sort, keep the first k, then while the mass before
    (float64, exclusive) < top_p * the top-k mass, then e >= min_p (e = exp(x - max))."""
    V = x.shape[0]
    xs, order = x.sort(descending=True, stable=True)
    e = (xs - xs[0]).exp()
    keep = torch.ones(V, dtype=torch.bool)
    if 0 < top_k < V:
        keep[top_k:] = False
    if top_p < 1.0:
        ed = torch.where(keep, e.double(), 0.0)
        zk = float(ed.sum())
        before = 0.0
        limit = torch.tensor(top_p, dtype=torch.float32).double().item() * zk
        for j in range(V):
            if not keep[j]:
                break
            if j > 0 and not before < limit:
                keep[j:] = False
                break
            before += float(ed[j])
    if min_p > 0.0:
        keep &= e >= torch.tensor(min_p, dtype=torch.float32)
    keep[0] = True
    out = torch.empty_like(keep)
    out[order] = keep
    return out


def distribution(logits: torch.Tensor, row: SamplerRequest, history: list[int], eog_ids=frozenset(),
                 watermark=None):
    """(kept, weights) of one row, or (argmax token, None) when greedy; grammar masks applied."""
    p = row.params
    out = process(logits, row, history, eog_ids, watermark)
    if row.grammar is not None:
        refused = row.grammar.refused(history[len(row.output_ids):])
        masked = out.masked_fill(refused, float("-inf"))
        if len(history) < p.min_tokens and not torch.isfinite(masked).any():
            masked = logits.masked_fill(refused, float("-inf"))
        out = masked
    if p.greedy:
        return int(out.argmax()), None
    x = out / torch.tensor(p.temperature, dtype=torch.float32)
    kept = kept_mask(x, p.top_k, p.top_p, p.min_p)
    e = (x - x.max()).exp()
    return kept, torch.where(kept, e, 0.0)


def draw(weights: torch.Tensor, u: float) -> int:
    """The first token (in id order) whose running float64 sum exceeds u times the total."""
    total = float(weights.double().sum())
    target = u * total
    run = 0.0
    for t, w in enumerate(weights.double().tolist()):
        run += w
        if run > target and w > 0:
            return t
    return int((weights > 0).nonzero().max())


def sample(logits: torch.Tensor, rows: list[SamplerRequest], eog_ids=frozenset(), watermark=None) -> list[int]:
    """One token per row, row after row (masked first under a grammar: one uniform per sampled row)."""
    tokens = []
    for i, row in enumerate(rows):
        kept, w = distribution(logits[i], row, row.output_ids, eog_ids, watermark)
        if w is None:
            tokens.append(kept)
        else:
            tokens.append(draw(w, row.generator.uniform()))
    return tokens
