"""`Speculator`: the engine's speculative decoding, in one object that owns the proposer (a
draft model or n-gram lookup), the verification and each request's adaptive draft length.

Per step the engine asks `propose` for the decoding requests' drafts, runs the target over the
last token plus the drafts, and hands each request's logits rows to `verify`, which emits the
accepted drafts plus one token (`spec.verify`) and sets the request's next draft length: one
more than were accepted, and after a verification that accepted nothing, no drafting for 1, 2,
4, then 8 steps (each drafted token costs a verification row).
"""

from __future__ import annotations

from typing import Callable

import torch

from nextoken.config import SpeculativeConfig
from nextoken.sample.sampler import SampleResult, Sampler
from nextoken.spec_decode.draft import DraftProposer
from nextoken.spec_decode.ngram import propose_ngram
from nextoken.spec_decode.stats import SpecStats
from nextoken.spec_decode.verify import verify



class Speculator:
    """Proposes and verifies drafts for `config` (`SpeculativeConfig`); `draft`: the draft
    model's proposer (method ``"draft"``), else None (n-gram lookup). `counts`: drafted and
    accepted tokens, verifications (one per request and step) and emitted tokens."""

    def __init__(self, config: SpeculativeConfig, draft: DraftProposer | None, max_model_len: int):
        self.config, self.draft, self.max_model_len = config, draft, max_model_len
        self.counts = {"drafted": 0, "accepted": 0, "steps": 0, "emitted": 0}

    @property
    def lookahead(self) -> int:
        """Tokens a request may need beyond its next one in a step (the scheduler reserves them)."""
        return self.config.num_speculative_tokens

    def propose(self, reqs: list, block_ids: Callable) -> dict:
        """Drafts for decoding requests `reqs`: request -> (tokens, the draft's distributions or
        None). Each at most num_speculative_tokens (and one more than its last verification
        accepted), never more than could be emitted before max_tokens or the context length;
        none in a step with more decodes than ``disable_by_batch_size``. block_ids(request) ->
        its block table (the draft model writes into the same blocks)."""
        sc = self.config
        if sc.disable_by_batch_size is not None and len(reqs) > sc.disable_by_batch_size:
            return {}
        batch = []
        for r in reqs:
            if r.spec_skip > 0:
                r.spec_skip -= 1
                continue
            k = min(r.spec_k or sc.num_speculative_tokens, r.params.max_tokens - len(r.output_ids) - 1,
                    self.max_model_len - r.num_tokens - 1)
            if k > 0 and r.num_computed_tokens == r.num_tokens - 1:
                batch.append((r, k))
        if self.draft is not None:
            out = self.draft.propose(batch, block_ids)
        else:
            out = {r: (_grammar_prefix(r, propose_ngram(r.all_token_ids, k, sc.ngram_max, sc.ngram_min)), None)
                   for r, k in batch}
        return {r: v for r, v in out.items() if v[0]}

    def verify(self, sampler: Sampler, r, logits: torch.Tensor, drafts: list[int], draft_probs,
               record: list | None = None) -> list[SampleResult]:
        """Verify request `r`'s `drafts` against the target's logits rows ``[k + 1, vocab]``: the
        tokens to emit. Advances ``r.num_computed_tokens`` past the accepted drafts (the rest of
        the keys and values roll back) and sets its next draft length. `record`: the step log's
        list, which gets this verification (`verification_record`)."""
        p_target = [] if record is not None else None
        results, accepted = verify(sampler, logits, drafts, draft_probs, r.sampler_row, p_target)
        if record is not None:
            record.append(verification_record(r, drafts, p_target, draft_probs, accepted, results))
        c = self.counts
        c["drafted"] += len(drafts)
        c["accepted"] += accepted
        c["steps"] += 1
        c["emitted"] += len(results)
        r.num_computed_tokens += accepted
        if self.config.adapt_length:
            r.spec_k = min(self.config.num_speculative_tokens, accepted + 1)
            r.spec_backoff = 0 if accepted else min(8, 2 * r.spec_backoff or 1)
            r.spec_skip = r.spec_backoff
        return results

    def on_verified(self, r) -> None:
        """After `r`'s emitted tokens are appended: the draft's cache keeps only accepted tokens."""
        if self.draft is not None:
            self.draft.on_verified(r)

    def forget(self, r) -> None:
        """`r` finished or was aborted: drop what the draft remembers of it."""
        if self.draft is not None:
            self.draft.forget(r)

    @classmethod
    def idle(cls) -> Speculator:
        """A speculator that never ran (its `stats` are zeros): the engine's without speculation."""
        return cls(SpeculativeConfig(), None, 0)

    def reset_counts(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)

    def stats(self) -> SpecStats:
        """Drafted and accepted token counts, the acceptance rate, and the mean number of tokens
        emitted per verification (accepted drafts plus one)."""
        c = self.counts
        return SpecStats(c["drafted"], c["accepted"], c["steps"], c["accepted"] / c["drafted"] if c["drafted"] else 0.0,
                         c["emitted"] / c["steps"] if c["steps"] else 0.0)


def _grammar_prefix(r, drafts: list[int]) -> list[int]:
    """Guessed drafts cut at the first token the request's grammar would refuse (a draft
    model's are drawn from masked distributions already)."""
    grammar = r.sampler_row.grammar
    return drafts[: grammar.valid_prefix(drafts)] if grammar is not None and drafts else drafts


def verification_record(r, drafts: list[int], p_target: list[float], draft_probs, accepted: int, results) -> dict:
    """One speculative verification for the step log: the drafted tokens, how many the target
    accepted, the target probability the acceptance test used for each draft it checked (drafts
    after a rejection are not checked) and each draft's probability under the draft model (1 for
    an n-gram guess), and the tokens emitted."""
    q = [float(d[t]) for d, t in zip(draft_probs, drafts)] if draft_probs is not None else [1.0] * len(drafts)
    return {"request_id": r.group_id, "drafted": drafts, "accepted": accepted,
            "p_target": [round(x, 4) for x in p_target], "q_draft": [round(x, 4) for x in q],
            "emitted": [res.token for res in results]}


def build_speculator(args, tokenizer, target_config, dtype, watermark, draft_source=None, cheap_verification=False):
    """The `Speculator` `args` (`EngineArgs`) asks for, or None without ``speculative``; with
    method ``"draft"`` it loads the draft model from the opened `draft_source`. N-gram drafts keep
    their full length when `cheap_verification` (the target's plan: a few more rows cost about one
    row's pass), else they adapt (`SpeculativeConfig.adapt_length`). Returns
    ``(speculator, draft runner or None)``. Raises `InvalidRequest` when the draft model is
    missing or has sliding-window layers, `ModelLoadError` when its vocabulary is not the
    target's."""
    from nextoken.errors import InvalidRequest
    from nextoken.loader.source import load_tokenizer
    from nextoken.runner.device import resolve_device
    from nextoken.runner.model_runner import ModelRunner
    from nextoken.spec_decode.draft import check_same_vocabulary, hot_ranges

    if args.speculative is None:
        return None, None
    config = SpeculativeConfig(args.speculative, args.speculative_model, args.num_speculative_tokens,
                               adapt_length=not (args.speculative == "ngram" and cheap_verification))
    max_model_len = min(target_config.context_length, args.max_model_len or target_config.context_length)
    if args.speculative != "draft":
        return Speculator(config, None, max_model_len), None
    if draft_source is None:
        raise InvalidRequest("speculative method 'draft' needs a draft model", "speculative_model")
    draft_tok = load_tokenizer(draft_source, args.prepared_cache)
    draft_source.release_metadata()
    runner = ModelRunner(draft_source, dtype, dense_weights=False, enforce_eager=args.enforce_eager,
                         device=resolve_device(args.device), attention_backend=args.attention_backend,
                         batch_invariant=args.batch_invariant)
    check_same_vocabulary(tokenizer, draft_tok, target_config.vocab_size, runner.config.vocab_size,
                          config.model or "draft")
    if runner.config.sliding_layers:
        raise InvalidRequest("a draft model with sliding-window layers is not supported", "speculative_model")
    hot = hot_ranges(runner.config.vocab_size, tokenizer.special_ids, args.speculative_draft_vocab)
    proposer = DraftProposer(runner, Sampler.for_plan(tokenizer.eog_token_ids, watermark, runner.plan), hot)
    return Speculator(config, proposer, max_model_len), runner
