"""Speculative decoding on demand, for one request from the page, on a server started without it.

Each verification proposes up to k tokens with the engine's n-gram proposer (`spec.ngram`, prompt
lookup over the request's tokens), runs the served model once over the request's tokens plus
the drafts, and hands the k + 1 rows of logits to the engine's own verification
(`spec.verify.verify`: Leviathan et al. 2023, Algorithm 1), which emits the accepted drafts and
one token more. So the tokens are what speculation inside the engine would emit (greedy: the
greedy text; sampled: the target's distribution), and each verification shows what was drafted,
what was accepted, and the acceptance test's p_target against q_draft (1 for an n-gram guess).

Unlike the engine's own speculation (``--speculative-method``), each verification here is one
request that recomputes its prompt: the page shows the mechanism and how many tokens one target
pass yields, not the speed-up.
"""

from __future__ import annotations

import torch

from nextoken.config import SpeculativeConfig
from nextoken.errors import RequestFailed
from nextoken.inspect.text import display
from nextoken.sample.sampler import SamplerRequest, make_generator
from nextoken.sampling_params import SamplingParams
from nextoken.spec.ngram import propose_ngram
from nextoken.spec.verify import verify


async def run(ctx, ids: list[int], params: SamplingParams, k: int) -> dict:
    """Generate ``params.max_tokens`` tokens after `ids` by n-gram speculation with up to `k`
    drafts per verification, on the engine behind `ctx` (`routes.InspectContext`). Returns every
    verification and the tokens. Raises `RequestFailed` when a target pass fails."""
    eng = ctx.core()
    cfg = SpeculativeConfig("ngram", None, k)
    row = SamplerRequest(params, ids, [], make_generator(params.seed))
    steps, out = [], row.output_ids
    while len(out) < params.max_tokens and not (out and out[-1] in eng.sampler.eog_ids):
        drafts = propose_ngram(ids + out, min(k, params.max_tokens - len(out) - 1), cfg.ngram_max, cfg.ngram_min)
        logits = await _target_logits(ctx, ids + out, drafts)
        p_target: list[float] = []
        results, accepted = await ctx.between_steps(lambda: verify(eng.sampler, logits, drafts, None, row, p_target))
        emitted = [r.token for r in results][: params.max_tokens - len(out)]
        steps.append({"drafted": [_tok(eng, t) for t in drafts], "accepted": accepted,
                      "p_target": [round(x, 4) for x in p_target], "q_draft": [1.0] * len(drafts),
                      "emitted": [_tok(eng, t) for t in emitted]})
        out.extend(emitted)
    drafted = sum(len(s["drafted"]) for s in steps)
    accepted = sum(s["accepted"] for s in steps)
    return {"steps": steps, "token_ids": list(out), "text": eng.tokenizer.decode(out, skip_special_tokens=True),
            "verifications": len(steps), "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "tokens_per_verification": round(len(out) / max(1, len(steps)), 3), "method": "ngram",
            "num_speculative_tokens": k}


async def _target_logits(ctx, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """The served model's raw logits ``[len(drafts) + 1, vocab]``: row i after `tokens` and the
    first i drafts. One request over ``tokens + drafts``: the kept prompt hidden states through the
    LM head for the rows inside it, and the request's own logits for the last row."""
    eng = ctx.core()
    full = tokens + drafts
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0 if drafts else None)
    out = None
    async for out in ctx.get_engine().generate(full, params, return_logits=True, keep_prompt_hidden=bool(drafts)):
        pass
    if out.error is not None:
        raise RequestFailed(out.error)
    last = out.logits[0].float()[None]
    if not drafts:
        return last
    hidden = out.prompt_hidden[len(tokens) - 1:]
    inner = await ctx.between_steps(lambda: eng.runner.model.compute_logits(hidden.to(eng.runner.dtype)).float())
    return torch.cat([inner, last])


def _tok(eng, t: int) -> dict:
    return {"id": t, "token": display(eng.tokenizer.token_text(t))}
