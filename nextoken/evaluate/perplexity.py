"""Perplexity of a text, llama.cpp's way (``llama-perplexity``), and what a fast path costs.

The text's tokens are cut into chunks of `ctx` tokens (the remainder is dropped); each chunk is
one prompt scored on its own, its first token replaced by BOS where the model adds one. Only the
second half of each chunk counts, so every scored token sees at least ctx/2 tokens before it:
tokens ``ctx/2 + 1 .. ctx - 1`` of each chunk, whose negative log-likelihoods ``nll_i`` give

    PPL = exp(mean nll),   uncertainty = PPL * std(nll) / sqrt(N - 1)

(the standard error of the mean, carried through exp to first order, as llama.cpp prints it).

With a reference engine (the float32, plain-PyTorch path: `reference_args`), the same positions
also give the KL divergence KL(P_ref || P_fast) = sum_v p_ref(v) (log p_ref(v) - log p_fast(v))
over the whole vocabulary, and how often both put the same token first: llama.cpp's
``--kl-divergence``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nextoken.errors import InvalidRequest, RequestFailed
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams


def reference_args(args):
    """The float32 reference of the configuration `args` (`EngineArgs`), what ``--kl-divergence``
    and the inspector's quality view measure it against: the same model file with float32 weights
    (GGUF codes de-quantized, no ``--quantization``), plain PyTorch and the reference attention,
    the model's dtype in the KV cache (never int8: that is a cost to measure), and no speculation,
    LoRA, tensor parallelism or disk tier. Its weights stay where the loader put them (no
    huge-page arena: its speed is not what is measured, and copying SmolLM2's float32 weights into
    fresh 2 MiB pages made its build 5.7-6.5 s instead of 1.5-2.0 s on a 2-core VM)."""
    return args.replace(dtype="float32", enforce_eager=True, reference_attention=True, quantization=None,
                        speculative_model=None, speculative_method=None, enable_lora=False, tensor_parallel_size=1,
                        kv_cache_dtype="auto", kv_cache_dir="off", huge_pages=False)


@dataclass
class PerplexityResult:
    ppl: float
    ppl_uncertainty: float
    num_chunks: int
    num_tokens_scored: int
    nll: list[float] = field(repr=False, default_factory=list)
    kl_mean: float | None = None
    kl_uncertainty: float | None = None
    top1_agreement: float | None = None


def chunk_tokens(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """`ids` cut into whole chunks of `ctx` tokens, each starting with `bos` when given."""
    if ctx < 4:
        raise InvalidRequest(f"ctx must be at least 4 tokens, got {ctx}", "ctx")
    chunks = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    if not chunks:
        raise InvalidRequest(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}; give more text or "
                             "a smaller --ctx", "ctx")
    if bos is not None:
        chunks = [[bos, *c[1:]] for c in chunks]
    return chunks


def score_prompts(engine, chunks: list[list[int]], keep_hidden: bool, on_done=None) -> list:
    """Score every prompt in `chunks` (one request each, batched by the engine, `max_tokens=0`);
    returns each one's `RequestGroup`, with its final hidden states when `keep_hidden`."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    groups = {}
    try:
        for c in chunks:
            rid = engine.add_request(c, params, options=RequestOptions(keep_prompt_hidden=keep_hidden))
            groups[rid] = engine.outputs.groups[rid]
        left = set(groups)
        while left:
            for out in engine.step():
                if out.finished and out.request_id in left:
                    left.discard(out.request_id)
                    if on_done is not None:
                        on_done(groups[out.request_id])
    finally:
        for rid in groups:
            engine.abort_request(rid)
    return list(groups.values())


def perplexity(engine, text: str, ctx: int = 512, reference=None, max_chunks: int | None = None,
               progress: bool = True) -> PerplexityResult:
    """Perplexity of `text` under `engine` (an `LLMEngine`), and with `reference` (another
    engine on the same model) the KL divergence and top-1 agreement of `engine` against it.
    Raises `InvalidRequest` when the text is shorter than one chunk or ctx exceeds the model."""
    tok = engine.tokenizer
    if ctx > engine.max_model_len:
        raise InvalidRequest(f"ctx {ctx} exceeds the model's context ({engine.max_model_len})", "ctx")
    ids = tok.encode(text, add_bos=False, parse_special=False)
    chunks = chunk_tokens(ids, ctx, tok.bos_token_id if tok.add_bos else None)[:max_chunks]
    first = ctx // 2
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(chunks), unit="chunk", desc="perplexity")
    nll: list[float] = []

    def done(group):
        if group.error is not None:  # a model fault: no number is better than a wrong one
            raise RequestFailed(group.error)
        nll.extend(-group.prompt_logprobs[j][group.prompt_ids[j]] for j in range(first + 1, ctx))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(ppl=f"{math.exp(sum(nll) / len(nll)):.4f}")

    fast = score_prompts(engine, chunks, reference is not None, done)
    if bar is not None:
        bar.close()
    n = len(nll)
    mean = sum(nll) / n
    var = sum((x - mean) ** 2 for x in nll) / n
    ppl = math.exp(mean)
    res = PerplexityResult(ppl, ppl * math.sqrt(var / max(1, n - 1)), len(chunks), n, nll)
    if reference is not None:
        ref = score_prompts(reference, chunks, True)
        failed = next((g.error for g in ref if g.error is not None), None)
        if failed is not None:
            raise RequestFailed(f"the reference engine: {failed}")
        kls, same = [], 0
        for g_fast, g_ref in zip(fast, ref):
            kl, agree = kl_and_agreement(log_probs(engine, g_fast.prompt_hidden[first:]),
                                         log_probs(reference, g_ref.prompt_hidden[first:]))
            kls += kl.tolist()
            same += int(agree.sum())
        km = sum(kls) / len(kls)
        res.kl_mean = km
        res.kl_uncertainty = math.sqrt(sum((k - km) ** 2 for k in kls) / len(kls) / max(1, len(kls) - 1))
        res.top1_agreement = same / len(kls)
    return res


def log_probs(engine, hidden: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax ``[n, vocab]`` of final hidden states ``[n, hidden]`` through
    `engine`'s LM head (the distributions its prompt log-probabilities come from)."""
    runner = engine.runner
    return runner.model.compute_logits(hidden.to(runner.device.torch, runner.dtype)).float().log_softmax(-1)


def kl_and_agreement(lp: torch.Tensor, lr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, for log-probabilities ``[n, vocab]`` of a fast path (`lp`) and its reference
    (`lr`): KL(P_ref || P_fast) in nats ``[n]``, and whether both put the same token first
    (bool ``[n]``)."""
    return (lr.exp() * (lr - lp)).sum(-1), lp.argmax(-1) == lr.argmax(-1)
