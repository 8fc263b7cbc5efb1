"""Per-request edits of the logits before sampling, on a batch of rows at once: the min_tokens
block, the allowed tokens and bad words, logit bias, repetition / presence / frequency penalties,
and the watermark.

Order (as in vLLM): min_tokens block and bad words -> allowed tokens -> logit bias -> repetition
-> presence/frequency penalties, then the watermark's green-list bias (`watermark.py`). `process_rows` edits rows of a tensor the
caller owns, in place; each edit is one sparse operation over every row that asks for it (the
penalties touch only the tokens a request has seen, never the whole vocabulary).
`process_logits` is the same for one row, on a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nextoken.sample.watermark import WatermarkConfig, apply_watermark
from nextoken.sampling_params import SamplingParams

LOGIT_LIMIT = 1e30  # finite even after the smallest temperature (1e-5) in float32 (max 3.4e38)


def has_processors(p: SamplingParams) -> bool:
    """Whether any edit can apply to a row of `p` (min_tokens counts while it is above 0)."""
    return bool(p.min_tokens or p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty
                or p.frequency_penalty or p.watermark or has_masks(p))


def needs_edits(p: SamplingParams, num_output: int) -> bool:
    """Whether an edit applies to a row of `p` with `num_output` output tokens so far."""
    return num_output < p.min_tokens or bool(p.logit_bias) or has_penalties(p) or p.watermark or has_masks(p)


def has_masks(p: SamplingParams) -> bool:
    """Whether `p` restricts the tokens (allowed_token_ids, bad_words)."""
    return p.allowed_token_ids is not None or bool(p.bad_words_token_ids)


def bad_word_blocks(words: list[list[int]], output_ids: list[int], ahead: list[int] = ()) -> list[int]:
    """The tokens that would complete one of the bad `words` (token id sequences) after the
    output so far (`output_ids`, then the tokens `ahead` of them): a one-token word's token, and
    the last token of a word whose other tokens end the output (vLLM's rule). Reads only the
    output's last tokens (as many as the longest word has but one), not its whole length."""
    n = max(len(w) for w in words) - 1
    tail = ((output_ids[-n:] if n else []) + list(ahead))[-n:] if n else []
    return [w[-1] for w in words if len(w) == 1 or (len(tail) >= len(w) - 1 and tail[len(tail) - len(w) + 1:] == w[:-1])]


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


class TokenHistory:
    """The distinct token ids of a request's prompt and output, each with its count in the output,
    kept up to date as tokens are emitted (`sync`): what the penalties read, without a pass over
    the whole history or the vocabulary each step. Arrays grow by doubling."""

    __slots__ = ("ids", "counts", "pos", "n", "synced")

    def __init__(self, prompt_ids: list[int]):
        uniq = list(dict.fromkeys(prompt_ids))
        cap = max(64, 2 * len(uniq))
        self.ids = np.zeros(cap, np.int64)
        self.counts = np.zeros(cap, np.float32)
        self.ids[: len(uniq)] = uniq
        self.pos = {t: i for i, t in enumerate(uniq)}
        self.n = len(uniq)
        self.synced = 0

    def _add(self, token: int) -> None:
        i = self.pos.get(token)
        if i is None:
            if self.n == len(self.ids):
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            i = self.pos[token] = self.n
            self.ids[i] = token
            self.n += 1
        self.counts[i] += 1

    def sync(self, output_ids: list[int]) -> None:
        """Count the output tokens emitted since the last call."""
        for t in output_ids[self.synced :]:
            self._add(t)
        self.synced = len(output_ids)

    def arrays(self, ahead: list[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 ``[n]``, output counts float32 ``[n]``), with the tokens of `ahead` (drafts
        past the output) counted as output too."""
        ids, counts = self.ids[: self.n], self.counts[: self.n]
        if not ahead:
            return ids, counts
        extra: dict[int, int] = {}
        for t in ahead:
            extra[t] = extra.get(t, 0) + 1
        ids, counts = ids.copy(), counts.copy()
        new = [t for t in extra if t not in self.pos]
        for t, c in extra.items():
            if t in self.pos:
                counts[self.pos[t]] += c
        if new:
            ids = np.concatenate([ids, np.array(new, np.int64)])
            counts = np.concatenate([counts, np.array([extra[t] for t in new], np.float32)])
        return ids, counts


@dataclass
class RowEdits:
    """What one row of the batch needs: its params, its prompt, its output history (the
    request's output ids, plus any tokens ahead of them), and its `TokenHistory`."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    ahead: list[int]
    history: TokenHistory | None


def apply_repetition_penalty(values: torch.Tensor, penalty: torch.Tensor | float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019) as in `transformers`/vLLM, on the logits of
    tokens already seen (prompt and output): a positive logit is divided by `penalty`, a negative
    one multiplied. The results stay within +-`LOGIT_LIMIT`, so that a tiny penalty (5e-324)
    cannot make them infinite (a softmax of several +inf is NaN). Returns a new tensor."""
    return torch.where(values > 0, values / penalty, values * penalty).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)


def apply_presence_frequency(values: torch.Tensor, counts: torch.Tensor, presence, frequency) -> torch.Tensor:
    """OpenAI's penalties: ``logit - frequency * count - presence * (count > 0)``, count being how
    often the token occurs in the output so far (`values`, `counts`: the same shape). New tensor."""
    return values - (frequency * counts + presence * (counts > 0).to(values.dtype))


def process_rows(work: torch.Tensor, rows: list[RowEdits], eog_ids: frozenset[int],
                 watermark: WatermarkConfig | None = None) -> None:
    """Apply every enabled edit of each row's params to `work` ``[len(rows), vocab]`` float32, in
    place (row j of `work` belongs to ``rows[j]``; on any device: the indices go to it)."""
    V, dev = work.shape[1], work.device
    flat = work.view(-1)
    blocked = [j * V + i for j, r in enumerate(rows) if len(r.output_ids) + len(r.ahead) < r.params.min_tokens
               for i in (*eog_ids, *r.params.stop_token_ids) if i < V]
    blocked += [j * V + t for j, r in enumerate(rows) if r.params.bad_words_token_ids
                for t in bad_word_blocks(r.params.bad_words_token_ids, r.output_ids, r.ahead)]
    if blocked:
        flat[torch.tensor(blocked, dtype=torch.long, device=dev)] = float("-inf")
    for j, r in enumerate(rows):
        if r.params.allowed_token_ids is not None:
            keep = torch.tensor(r.params.allowed_token_ids, dtype=torch.long, device=dev)
            kept = work[j, keep].clone()
            work[j] = float("-inf")
            work[j, keep] = kept
    bias = [(j * V + t, v) for j, r in enumerate(rows) if r.params.logit_bias for t, v in r.params.logit_bias.items()]
    if bias:
        idx = torch.tensor([i for i, _ in bias], dtype=torch.long, device=dev)
        flat[idx] += torch.tensor([v for _, v in bias], dtype=work.dtype, device=dev)
    _apply_penalties(flat, V, rows)
    for j, r in enumerate(rows):
        if r.params.watermark:
            history = r.output_ids + r.ahead
            apply_watermark(work[j], history[-1] if history else r.prompt_ids[-1], watermark or WatermarkConfig())


def _apply_penalties(flat: torch.Tensor, V: int, rows: list[RowEdits]) -> None:
    """Repetition, presence and frequency penalties of every row that has one, as one gather and
    one scatter over the (row, seen token) pairs."""
    parts = []
    for j, r in enumerate(rows):
        p = r.params
        if not has_penalties(p):
            continue
        hist = r.history or TokenHistory(r.prompt_ids)
        hist.sync(r.output_ids)
        ids, counts = hist.arrays(r.ahead)
        parts.append((j, ids, counts, p.repetition_penalty, p.presence_penalty, p.frequency_penalty))
    if not parts:
        return
    lengths = [len(ids) for _, ids, _, _, _, _ in parts]
    dev = flat.device
    idx = torch.from_numpy(np.concatenate([ids + j * V for j, ids, *_ in parts])).to(dev)
    counts = torch.from_numpy(np.concatenate([c for _, _, c, *_ in parts])).to(dev)

    def per_token(k: int) -> torch.Tensor:
        return torch.from_numpy(np.repeat(np.array([part[k] for part in parts], np.float32), lengths)).to(dev)

    rep, presence, frequency = per_token(3), per_token(4), per_token(5)
    vals = flat[idx]
    vals = torch.where(rep != 1.0, apply_repetition_penalty(vals, rep), vals)
    flat[idx] = apply_presence_frequency(vals, counts, presence, frequency)


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int], eog_ids: frozenset[int],
                   watermark: WatermarkConfig | None = None) -> torch.Tensor:
    """`process_rows` on one row ``[vocab]``: the row itself when nothing applies (no copy),
    else an edited copy; the caller's logits are never changed."""
    if not needs_edits(params, len(output_ids)):
        return logits
    work = logits.float().clone()[None]
    process_rows(work, [RowEdits(params, prompt_ids, list(output_ids), [], None)], eog_ids, watermark)
    return work[0]
