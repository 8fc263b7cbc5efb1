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
pass yields, not the speed-up. On a server started with speculation (n-gram or a draft model),
`run_in_engine` runs the request as usual and reads its verifications from the engine's step log.
"""

from __future__ import annotations

import asyncio

import torch

from nextoken.config import SpeculativeConfig
from nextoken.errors import InvalidRequest, RequestFailed
from nextoken.inspect.text import display
from nextoken.sample.sampler import SamplerRequest, make_generator
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams
from nextoken.spec_decode.ngram import propose_ngram
from nextoken.spec_decode.verify import verify


async def run(ctx, ids: list[int], params: SamplingParams, k: int) -> dict:
    """Generate ``params.max_tokens`` tokens after `ids` by n-gram speculation with up to `k`
    drafts per verification, on the engine behind `ctx` (`context.InspectContext`). Returns every
    verification and the tokens. Raises `RequestFailed` when a target pass fails, `InvalidRequest`
    under tensor parallelism (the inner rows go through this process's LM head)."""
    eng = ctx.whole_model()
    cfg = SpeculativeConfig("ngram", None, k)
    row = SamplerRequest(params, ids, [], make_generator(params.seed))
    steps, out = [], row.output_ids
    while len(out) < params.max_tokens and not (out and out[-1] in eng.sampler.eog_ids):
        drafts = propose_ngram(ids + out, min(k, params.max_tokens - len(out) - 1), cfg.ngram_max, cfg.ngram_min)
        logits = await _target_logits(ctx, ids + out, drafts)
        p_target: list[float] = []
        results, accepted = await asyncio.to_thread(verify, eng.sampler, logits, drafts, None, row, p_target)
        emitted = [r.token for r in results][: params.max_tokens - len(out)]
        steps.append({"drafted": [_tok(eng, t) for t in drafts], "accepted": accepted,
                      "p_target": [round(x, 4) for x in p_target], "q_draft": [1.0] * len(drafts),
                      "emitted": [_tok(eng, t) for t in emitted]})
        out.extend(emitted)
    return _summary(eng, steps, list(out), "ngram", k, len(steps))


async def run_in_engine(ctx, ids: list[int], params: SamplingParams) -> dict:
    """One ordinary request on an engine that speculates (``--speculative-method``): its
    verifications as the engine's step log recorded them (drafts from n-gram lookup or the draft
    model, with the draft's q), in the shape `run` returns. Raises `InvalidRequest` when the
    engine runs without speculation, `RequestFailed` when the request fails."""
    eng = ctx.core()
    if eng.speculative is None:
        raise InvalidRequest("this server runs without speculative decoding in its steps; use method 'ngram', or "
                             "start it with --speculative-method", "method")
    out = None
    async for out in ctx.get_engine().generate(ids, params):
        pass
    if out.error is not None:
        raise RequestFailed(out.error)
    records = await ctx.between_steps(lambda: [v for s in eng.history.steps for v in s["spec"]
                                               if v["request_id"] == out.request_id])
    steps = [{"drafted": [_tok(eng, t) for t in v["drafted"]], "accepted": v["accepted"], "p_target": v["p_target"],
              "q_draft": v["q_draft"], "emitted": [_tok(eng, t) for t in v["emitted"]]} for v in records]
    tokens = list(out.outputs[0].token_ids)
    plain = len(tokens) - 1 - sum(len(s["emitted"]) for s in steps)  # decode steps without a verification
    return _summary(eng, steps, tokens, eng.speculative.method, eng.speculative.num_speculative_tokens,
                    len(steps) + max(0, plain) + 1)


def _summary(eng, steps: list[dict], tokens: list[int], method: str, k: int, passes: int) -> dict:
    drafted = sum(len(s["drafted"]) for s in steps)
    accepted = sum(s["accepted"] for s in steps)
    return {"steps": steps, "token_ids": tokens, "text": eng.tokenizer.decode(tokens, skip_special_tokens=True),
            "verifications": sum(1 for s in steps if s["drafted"]), "target_passes": passes, "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "tokens_per_pass": round(len(tokens) / max(1, passes), 3), "method": method, "num_speculative_tokens": k}


async def _target_logits(ctx, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """The served model's raw logits ``[len(drafts) + 1, vocab]``: row i after `tokens` and the
    first i drafts. One request over ``tokens + drafts``: the kept prompt hidden states through the
    LM head for the rows inside it, and the request's own logits for the last row."""
    eng = ctx.core()
    full = tokens + drafts
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0 if drafts else None)
    out = None
    async for out in ctx.get_engine().generate(full, params, options=RequestOptions(return_logits=True,
                                                                            keep_prompt_hidden=bool(drafts))):
        pass
    if out.error is not None:
        raise RequestFailed(out.error)
    last = out.logits[0].float()[None]
    if not drafts:
        return last
    hidden = out.prompt_hidden[len(tokens) - 1:]
    inner = await asyncio.to_thread(eng.compute_logits, hidden)
    return torch.cat([inner.cpu(), last.cpu()])  # (on a GPU the head's rows come from the device)


def _tok(eng, t: int) -> dict:
    return {"id": t, "token": display(eng.tokenizer.token_text(t))}
