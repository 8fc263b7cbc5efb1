"""The sampler: logits of a batch of requests -> one token id each.

For each row: processors (penalties, bias, watermark; `logits_processors`) -> the grammar's
allowed tokens (structured output; `nextoken.structured`) -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> a draw from the remaining softmax with the request's
own ``torch.Generator`` (so a seeded request draws the same tokens whatever else is in the
batch). Log-probabilities are taken from the raw logits, before any of that (as vLLM does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nextoken.sample.logits_processors import process_logits
from nextoken.sample.watermark import WatermarkConfig
from nextoken.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerRequest:
    """One row of the batch: its params, its history (for penalties), its random stream and,
    under structured output, its grammar state (`structured.backend.SequenceGrammar`)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    grammar: object | None = None


@dataclass(slots=True)
class SampleResult:
    """The token drawn for one row and, when asked, its log-probabilities.

    logprob: log-probability of `token` under the raw distribution (or None);
    top_logprobs: the N most likely ``(token, logprob)`` pairs, best first;
    kept: bool ``[vocab]`` mask of the candidates the settings allowed (only with keep_details);
    probs: float32 ``[vocab]`` distribution the token was drawn from (only with keep_details).
    """

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    kept: torch.Tensor | None = None
    probs: torch.Tensor | None = None


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed` (a fresh random seed when None)."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def filter_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Which tokens survive top-k, then top-p, then min-p on one row of (temperature-scaled)
    logits ``[vocab]``; returns bool ``[vocab]``. The most likely token always survives."""
    vocab = logits.shape[0]
    sorted_logits, order = logits.sort(descending=True)
    keep_sorted = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep_sorted[top_k:] = False
    if top_p < 1.0:
        probs = sorted_logits.masked_fill(~keep_sorted, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # probability mass of the better tokens
        keep_sorted &= before < top_p
    if min_p > 0.0:
        probs = sorted_logits.masked_fill(~keep_sorted, float("-inf")).softmax(-1)
        keep_sorted &= probs >= min_p * probs[0]
    keep_sorted[0] = True
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def _mask_commutes(p: SamplingParams) -> bool:
    """Whether masking commutes with this row's sampling (no top-k, top-p or min-p, which pick
    their candidates from the unmasked logits otherwise), so `Sampler._draw_unmasked` is exact."""
    return p.greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p == 0.0)


def _mask(logits: torch.Tensor, refused: torch.Tensor, raw: torch.Tensor, blocked_eog: bool) -> torch.Tensor:
    """`logits` with the `refused` tokens at -inf. When min_tokens blocked every token the
    grammar allows (it allows only the end), the grammar wins: `raw` masked instead."""
    out = logits.masked_fill(refused, float("-inf"))
    if blocked_eog and not torch.isfinite(out).any():
        out = raw.masked_fill(refused, float("-inf"))
    return out


class Sampler:
    """Samples one token per row; see the module docstring for the order of operations."""

    def __init__(self, eog_ids: frozenset[int] = frozenset(), watermark: WatermarkConfig | None = None):
        self.eog_ids = eog_ids
        self.watermark = watermark

    def __call__(self, logits: torch.Tensor, rows: list[SamplerRequest],
                 keep_details: bool = False) -> list[SampleResult]:
        """logits: float32 ``[batch, vocab]``; rows: one `SamplerRequest` per logits row."""
        need_lp = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = logits.log_softmax(-1) if need_lp else None
        results = []
        for i, row in enumerate(rows):
            res = self._sample_row(logits[i], row, keep_details)
            if row.params.logprobs is not None:
                lp = raw_logprobs[i]
                res.logprob = float(lp[res.token])
                n = row.params.logprobs
                if n:
                    vals, ids = lp.topk(n)
                    res.top_logprobs = list(zip(ids.tolist(), vals.tolist()))
                else:
                    res.top_logprobs = []
            results.append(res)
        return results

    def distribution(self, logits: torch.Tensor, row: SamplerRequest, output_ids: list[int] | None = None):
        """The distribution a token of `row` is drawn from: ``(kept, probs)`` for one row of
        logits ``[vocab]``, after the processors (with `output_ids` as the history, the row's own
        by default), temperature and filters; for a greedy row ``(argmax token, None)``.
        Speculative verification uses it for the target's and the draft's distributions (the
        grammar, if any, then sees the tokens of `output_ids` past the row's own as ahead)."""
        history = row.output_ids if output_ids is None else output_ids
        processed = process_logits(logits, row.params, row.prompt_ids, history, self.eog_ids, self.watermark)
        return self._distribution(processed, logits, row, history)

    def _distribution(self, processed: torch.Tensor, raw: torch.Tensor, row: SamplerRequest, history: list[int]):
        """`distribution` from logits already through the processors (`raw`: before them)."""
        p = row.params
        if row.grammar is not None:
            refused = row.grammar.refused(history[len(row.output_ids):])
            processed = _mask(processed, refused, raw, len(history) < p.min_tokens)
        if p.greedy:
            return int(processed.argmax()), None
        logits = processed / p.temperature
        kept = filter_mask(logits, p.top_k, p.top_p, p.min_p)
        return kept, logits.masked_fill(~kept, float("-inf")).softmax(-1)

    def _draw_unmasked(self, processed: torch.Tensor, row: SamplerRequest) -> int | None:
        """The fast path of structured output (as llama.cpp samples under a grammar): draw from
        the unmasked distribution (`processed`: the logits through the processors) and keep the
        token if the grammar allows it, else None (then the caller draws from the masked
        distribution). Exact: for greedy rows the unmasked argmax, when allowed, is the masked
        argmax; for sampled rows an allowed token x comes out with probability
        p(x) + (1 - A) p(x) / A = p(x) / A, A the allowed mass, which is the masked
        distribution. It saves the mask (tens of microseconds) on most tokens."""
        p = row.params
        if len(row.output_ids) < p.min_tokens or row.grammar.forced():
            return None  # (where bytes are forced, the mask is small and decides: see `allows`)
        if p.greedy:
            token = int(processed.argmax())
        else:
            token = int(torch.multinomial((processed / p.temperature).softmax(-1), 1, generator=row.generator))
        return token if row.grammar.allows(token) else None

    def _sample_row(self, logits: torch.Tensor, row: SamplerRequest, keep_details: bool) -> SampleResult:
        processed = process_logits(logits, row.params, row.prompt_ids, row.output_ids, self.eog_ids, self.watermark)
        if row.grammar is not None and not keep_details and _mask_commutes(row.params):
            token = self._draw_unmasked(processed, row)
            if token is not None:
                return SampleResult(token)
        kept, probs = self._distribution(processed, logits, row, row.output_ids)
        if probs is None:
            token = kept
            if not keep_details:
                return SampleResult(token)
            kept = torch.zeros_like(logits, dtype=torch.bool)
            kept[token] = True
            return SampleResult(token, kept=kept, probs=kept.float())
        token = int(torch.multinomial(probs, 1, generator=row.generator))
        return SampleResult(token, kept=kept if keep_details else None, probs=probs if keep_details else None)
