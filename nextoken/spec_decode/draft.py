"""Draft-model proposals: a smaller model with the target's vocabulary guesses k tokens.

The draft runs on the same block tables as the target (one block id holds a block of the
target's keys and values and one of the draft's, in two tensors), so it needs no allocator of
its own. It remembers, per request, how many tokens its cache holds; each step it first catches
up on the tokens it has not seen (the whole prompt the first time, then the tokens accepted
since), then drafts one token per pass. Its distributions q are kept for the verification.

On a large vocabulary the draft's head scores only the hot tokens (`hot_ranges`: FR-Spec, Zhao
et al. 2025, "Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling"): a 0.5B model's head over Qwen's 151936 tokens is a quarter of its decode step, and
the tokens a text needs are nearly all among the first merges of the BPE. The other logits are
-inf (the draft never proposes those tokens); the verification is unchanged, so the target's
output is too (greedy: the same tokens; sampled: the same distribution).
"""

from __future__ import annotations

import torch

from nextoken.errors import ModelLoadError
from nextoken.runner.model_runner import ModelRunner, SequenceInput
from nextoken.sample.sampler import Sampler, draw, uniform


def check_same_vocabulary(target_tok, draft_tok, target_vocab: int, draft_vocab: int, draft_name: str) -> None:
    """Raises `ModelLoadError` naming the first difference when the draft's vocabulary is not
    the target's (then its token ids would mean other tokens)."""
    if target_vocab != draft_vocab:
        raise ModelLoadError(f"draft model {draft_name} has {draft_vocab} logits per token and the target "
                             f"{target_vocab}: a draft must share the target's vocabulary")
    a, b = target_tok.tokens, draft_tok.tokens
    if a != b:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise ModelLoadError(f"draft model {draft_name} has another vocabulary than the target: token {i} is "
                             f"{b[i] if i < len(b) else None!r} there, {a[i] if i < len(a) else None!r} in the "
                             "target")


def hot_ranges(vocab_size: int, special_ids, hot: int) -> list[tuple[int, int]] | None:
    """The token ids the draft's head scores: ``[0, hot)`` (BPE ids follow the merges' order, the
    most frequent first: FR-Spec ranks by corpus counts, this by the tokenizer's own) and, from the
    first special token past them (rounded down to the head's 16-row tiles), the rest of the
    vocabulary (chat and end-of-generation markers live there). None (the whole head) where
    `hot` is 0 or the vocabulary is under twice `hot`."""
    hot = hot // 16 * 16
    if hot <= 0 or vocab_size < 2 * hot:
        return None
    tail = [i for i in special_ids if i >= hot]
    return [(0, hot)] + ([(min(tail) // 16 * 16, vocab_size)] if tail else [])


class DraftProposer:
    """Owns the draft `ModelRunner`; `propose` drafts for a batch of decoding requests. With
    `head_ranges` (`hot_ranges`) the draft model's head keeps those rows only."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, head_ranges: list[tuple[int, int]] | None = None):
        self.runner = runner
        self.sampler = sampler
        self._computed: dict[str, tuple[int, int]] = {}  # request id -> (tokens in cache, preemptions)
        self.head_ranges = None
        model = runner.model
        head = model.lm_head.row_subset(head_ranges) if head_ranges else None
        if head is not None:
            model.lm_head, self.head_ranges = head, head_ranges
        self.vocab_size = runner.config.vocab_size
        self._full: torch.Tensor | None = None  # `_full_logits`'s rows: -inf outside the head, kept between steps

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's rows back at their token ids, -inf elsewhere: ``[rows, vocab]``. A row
        whose grammar allows only tokens outside the head proposes nothing real (greedy: token 0;
        sampled: a NaN distribution): the verification rejects it and the target draws alone.
        The rows are a buffer kept from step to step (the sampler never writes its logits): only the
        head's columns are copied in, where a fresh -inf row of the whole vocabulary cost its fill."""
        if self.head_ranges is None:
            return logits
        n = logits.shape[0]
        if self._full is None or self._full.shape[0] < n or self._full.dtype != logits.dtype:
            self._full = logits.new_full((max(n, 8), self.vocab_size), float("-inf"))
        full = self._full[:n]
        at = 0
        for a, b in self.head_ranges:
            full[:, a:b] = logits[:, at : at + b - a]
            at += b - a
        return full

    def computed(self, req) -> int:
        n, preemptions = self._computed.get(req.request_id, (0, req.num_preemptions))
        return n if preemptions == req.num_preemptions else 0  # preempted: its blocks are new

    def propose(self, batch: list[tuple], block_ids) -> dict:
        """batch: ``(request, k)`` pairs, each request with every token but its last computed by
        the target; block_ids(request) -> its block table. Returns request -> (drafts, q list or
        None for greedy rows)."""
        out = {r: ([], [] if not r.params.greedy else None) for r, _ in batch}
        active = [(r, k) for r, k in batch if k > 0]
        for j in range(max((k for _, k in active), default=0)):
            rows = [(r, k) for r, k in active if k > j]
            seqs = []
            for r, _ in rows:
                if j == 0:  # catch up on everything not in the draft's cache, up to the last token
                    start = min(self.computed(r), r.num_tokens - 1)
                    toks = r.all_token_ids[start:]
                else:
                    start, toks = r.num_tokens - 1 + j, [out[r][0][-1]]
                seqs.append(SequenceInput(toks, start, block_ids(r), True, as_decodes=len(toks) <= 8))
                self._computed[r.request_id] = (start + len(toks), r.num_preemptions)
            logits = self.runner.execute(seqs)
            idx, last = 0, []
            for s in seqs:
                idx += len(s.token_ids) if s.as_decodes else 1  # as_decodes returns a row per token
                last.append(idx - 1)
            dists = self.sampler.distributions(self._full_logits(logits[last]), [r.sampler_row for r, _ in rows],
                                               [r.output_ids + out[r][0] for r, _ in rows])
            for (r, _), (kept, probs) in zip(rows, dists):
                drafts, qs = out[r]
                if probs is None:
                    drafts.append(kept)
                else:
                    drafts.append(int(draw(probs, uniform(r.generator))))
                    qs.append(probs)
        return out

    def on_verified(self, req) -> None:
        """After verification: only the accepted tokens' keys and values stay valid."""
        if req.request_id in self._computed:
            n, p = self._computed[req.request_id]
            self._computed[req.request_id] = (min(n, req.num_computed_tokens), p)

    def forget(self, req) -> None:
        self._computed.pop(req.request_id, None)
