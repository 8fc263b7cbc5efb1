"""Exact verification of drafted tokens (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

For drafted tokens x_1..x_k, with target distributions p_0..p_k (p_i after the prefix and
x_1..x_i) and draft distributions q_1..q_k (a point mass for n-gram guesses):

    for i = 1..k: accept x_i with probability min(1, p_{i-1}(x_i) / q_i(x_i));
                  on rejection emit a draw from norm(max(0, p_{i-1} - q_i)) and stop;
    all accepted: emit a draw from p_k (the bonus token).

Every emitted token is then distributed exactly as the target alone would draw it. Greedy rows
accept x_i exactly when it is the target's argmax, and emit the argmax where they stop, so
greedy text is unchanged. Penalties see the accepted tokens as history, as they would without
speculation.
"""

from __future__ import annotations

import torch

from nextoken.sample.sampler import SampleResult, Sampler, SamplerRequest, draw, uniform


def verify(sampler: Sampler, logits: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor] | None,
           row: SamplerRequest, target_probs: list[float] | None = None) -> tuple[list[SampleResult], int]:
    """logits: the target's raw float32 logits ``[k + 1, vocab]`` (row i: after x_1..x_i);
    drafts: x_1..x_k; draft_probs: q_1..q_k (each ``[vocab]``) or None for point masses.
    Returns the emitted tokens (accepted drafts, then the correction or bonus token), with
    log-probabilities when the row asks for them, and how many drafts were accepted.
    `target_probs`, when given, receives p_{i-1}(x_i) for each draft checked (the acceptance
    test's target probability; greedy rows: 1 for the argmax, else 0)."""
    p = row.params
    history = list(row.output_ids)
    emitted: list[int] = []
    accepted = len(drafts)
    # every target distribution at once: row i's history is the output plus x_1..x_i
    dists = sampler.distributions(logits[: len(drafts) + 1], [row] * (len(drafts) + 1),
                                  [history + drafts[:i] for i in range(len(drafts) + 1)])
    for i in range(len(drafts) + 1):
        kept, probs = dists[i]
        if i == len(drafts):  # every draft accepted: the bonus token
            emitted.append(kept if probs is None else int(draw(probs, uniform(row.generator))))
            break
        x = drafts[i]
        if probs is None:  # greedy
            ok = kept == x
            p_x = float(ok)
        else:
            q_x = float(draft_probs[i][x]) if draft_probs is not None else 1.0
            u = uniform(row.generator)
            p_x = float(probs[x])
            ok = u * q_x < p_x
        if target_probs is not None:
            target_probs.append(p_x)
        if ok:
            emitted.append(x)
            history.append(x)
            continue
        accepted = i
        if probs is None:
            emitted.append(kept)
        else:
            q = draft_probs[i] if draft_probs is not None else _point_mass(x, probs)
            residual = (probs - q).clamp_min(0)
            dist = residual if float(residual.sum()) > 0 else probs
            emitted.append(int(draw(dist, uniform(row.generator))))
        break
    results = [SampleResult(t) for t in emitted]
    if p.logprobs is not None:
        lp = logits[: len(emitted)].log_softmax(-1)
        for j, res in enumerate(results):
            res.logprob = float(lp[j, res.token])
            if p.logprobs:
                vals, ids = lp[j].topk(p.logprobs)
                res.top_logprobs = list(zip(ids.tolist(), vals.tolist()))
            else:
                res.top_logprobs = []
    return results, accepted


def _point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q
