"""Per-request edits of the logits before sampling: penalties, bias, blocked tokens.

The ``apply_*`` functions edit one row of float32 logits ``[vocab]`` in place and return it;
`process_logits` copies the row first, and only when an edit applies. Order (as in
vLLM): min_tokens block -> logit bias -> repetition -> presence/frequency penalties, then the
watermark's green-list bias (`watermark.py`).
"""

from __future__ import annotations

import torch

from nextoken.sample.watermark import WatermarkConfig, apply_watermark
from nextoken.sampling_params import SamplingParams


LOGIT_LIMIT = 1e30  # finite even after the smallest temperature (1e-5) in float32 (max 3.4e38)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019) as in `transformers`/vLLM: for every token in
    `seen` (prompt and output ids), divide a positive logit by `penalty`, multiply a negative one.
    The results stay within +-`LOGIT_LIMIT`, so that a tiny penalty (5e-324) cannot make them
    infinite (a softmax of several +inf is NaN)."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    vals = logits[seen]
    logits[seen] = torch.where(vals > 0, vals / penalty, vals * penalty).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)
    return logits


def apply_presence_frequency(logits: torch.Tensor, output_counts: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's penalties: ``logit -= frequency * count + presence * (count > 0)`` where count is
    how often the token occurs in the output so far. output_counts: ``[vocab]``."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    counts = output_counts.to(logits.dtype)
    logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int], eog_ids: frozenset[int],
                   watermark: WatermarkConfig | None = None) -> torch.Tensor:
    """Apply every enabled processor of `params` to one row ``[vocab]``. Returns the row itself
    when nothing applies (the common greedy case costs no copy), else an edited copy: the
    caller's logits are never changed. `watermark`: the engine's gamma and delta, used when
    ``params.watermark``."""
    if not (len(output_ids) < params.min_tokens or params.logit_bias or params.repetition_penalty != 1.0
            or params.presence_penalty or params.frequency_penalty or params.watermark):
        return logits
    logits = logits.clone()
    if len(output_ids) < params.min_tokens:
        blocked = [i for i in (*eog_ids, *params.stop_token_ids) if i < logits.shape[0]]
        logits[blocked] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=logits.shape[0])
        apply_presence_frequency(logits, counts[: logits.shape[0]], params.presence_penalty,
                                 params.frequency_penalty)
    if params.watermark:
        apply_watermark(logits, output_ids[-1] if output_ids else prompt_ids[-1], watermark or WatermarkConfig())
    return logits
