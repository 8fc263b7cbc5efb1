"""The inspector's interventions (OpenAI's Transformer Debugger, NDIF Workbench): zero-ablate one
head, one attention block or one MLP of the loaded model and show what changes: the next token's
distribution (its top candidates before and after, the KL divergence of the ablated distribution
from the plain one) and the greedy continuation with the component ablated at every step.

Each pass is a traced request of the engine (`trace.recorder.TraceRecorder` with an `ablation`:
a pass of its own on the reference attention, so no other request sees the intervention); the
plain side runs the same traced pass without it, so both sides share their arithmetic and only
the ablation differs.
"""

from __future__ import annotations

from typing import Literal

import torch
from fastapi import APIRouter, Request
from pydantic import Field

from nextoken.bodies import Body, TokenId, model_limit
from nextoken.errors import InvalidRequest
from nextoken.inspect import text
from nextoken.inspect.context import context_of
from nextoken.inspect.trace import MAX_TRACE_TOKENS
from nextoken.layers.attention import Ablation
from nextoken.sampling_params import SamplingParams
from nextoken.trace.recorder import TraceRecorder

router = APIRouter(tags=["inspector"])
TOP = 5


class AblateBody(Body):
    prompt: str = Field("The capital of France is", min_length=1, max_length=text.MAX_TEXT_CHARS)
    chat: bool = False
    generated: list[TokenId] = Field(default_factory=list, max_length=64)
    layer: int = Field(0, ge=0, json_schema_extra=model_limit("layer"))
    kind: Literal["head", "attention", "mlp"] = "head"
    head: int = Field(0, ge=0, json_schema_extra=model_limit("head"), description="the query head, with kind head")
    continue_tokens: int = Field(6, ge=0, le=12, description="greedy tokens generated with the ablation")


async def traced_logits(ctx, ids: list[int], ablation: Ablation | None = None,
                        patch: tuple | None = None) -> tuple[torch.Tensor, TraceRecorder]:
    """The next-token logits float32 ``[vocab]`` after `ids` from a traced pass of the engine with
    `ablation` and/or `patch` (`TraceRecorder.patch`; None: none), and its recorder (the residual
    stream)."""
    tracer = TraceRecorder(ctx.core().config, last_row_only=True)
    tracer.ablation, tracer.patch = ablation, patch
    await ctx.run_traced(ids, SamplingParams(temperature=0, max_tokens=1), tracer)
    return tracer.first_logits, tracer


def _top(tok, probs: torch.Tensor) -> list[dict]:
    vals, ids = probs.topk(TOP)
    return [{"id": int(i), "token": text.display(tok.token_text(int(i))), "prob": round(float(v), 5)}
            for v, i in zip(vals, ids)]


@router.post("/inspect/api/ablate", summary="Zero-ablate a head, an attention block or an MLP: what changes")
async def ablate(request: Request, body: AblateBody):
    """The next token's distribution with and without the ablation (top candidates, KL(plain ||
    ablated) in nats, whether the top token changed) and both greedy continuations. Raises
    `InvalidRequest` for a layer or head the model does not have."""
    ctx = context_of(request)
    eng = ctx.core()
    cfg, tok = eng.config, eng.tokenizer
    if body.layer >= cfg.num_layers:
        raise InvalidRequest(f"layer {body.layer}: the model has layers 0..{cfg.num_layers - 1}", "layer")
    if body.head >= cfg.num_heads:  # (the schema's bound, whatever the kind)
        raise InvalidRequest(f"head {body.head}: the model has heads 0..{cfg.num_heads - 1}", "head")
    ids = ctx.encode(body.prompt, body.chat, MAX_TRACE_TOKENS) + list(body.generated)
    if len(ids) + body.continue_tokens > MAX_TRACE_TOKENS:  # (counted with the continuation)
        raise InvalidRequest(f"prompt has {len(ids) + body.continue_tokens} tokens; traces take at most "
                             f"{MAX_TRACE_TOKENS}", "generated")
    ablation = Ablation(body.layer, body.kind, body.head)
    runs = {}
    for name, abl in (("plain", None), ("ablated", ablation)):
        (logits, _), seq = await traced_logits(ctx, ids, abl), []
        first = logits
        for _ in range(body.continue_tokens):  # greedy, the component ablated at every step
            seq.append(int(logits.argmax()))
            if seq[-1] in tok.eog_token_ids:
                break
            logits, _ = await traced_logits(ctx, ids + seq, abl)
        runs[name] = (first, seq)
    lp, la = runs["plain"][0].log_softmax(-1), runs["ablated"][0].log_softmax(-1)
    kl = float((lp.exp() * (lp - la)).sum())
    return {"layer": body.layer, "kind": body.kind, "head": body.head if body.kind == "head" else None,
            "kl": round(kl, 6), "top_changed": int(lp.argmax()) != int(la.argmax()),
            "plain": {"top": _top(tok, lp.exp()), "continuation_ids": runs["plain"][1],
                      "continuation": tok.decode(runs["plain"][1])},
            "ablated": {"top": _top(tok, la.exp()), "continuation_ids": runs["ablated"][1],
                        "continuation": tok.decode(runs["ablated"][1])}}


class PatchBody(Body):
    clean: str = Field("The Eiffel Tower is in the city of", min_length=1, max_length=text.MAX_TEXT_CHARS,
                       description="prompt A, the run patched")
    corrupt: str = Field("The Colosseum is in the city of", min_length=1, max_length=text.MAX_TEXT_CHARS,
                         description="prompt B, whose residual stream is patched in (the same number of tokens)")
    chat: bool = False


@router.post("/inspect/api/patch", summary="Activation patching: each layer's residual of prompt B patched into "
             "prompt A's last position (the patch lens)")
async def patch(request: Request, body: PatchBody):
    """For each layer l: prompt A's traced pass with its residual stream after layer l at the last
    position replaced by prompt B's, and how much of B's answer that restores: with a = A's top
    token and b = B's, the logit difference d = logit(b) - logit(a), restored = (d_patched - d_A)
    / (d_B - d_A) (1 at the last layer, whose residual is B's whole answer). Raises
    `InvalidRequest` when the prompts' token counts differ or both answer alike."""
    ctx = context_of(request)
    tok = ctx.core().tokenizer
    a_ids = ctx.encode(body.clean, body.chat, MAX_TRACE_TOKENS)
    b_ids = ctx.encode(body.corrupt, body.chat, MAX_TRACE_TOKENS)
    if len(a_ids) != len(b_ids):
        raise InvalidRequest(f"the prompts must have as many tokens: {len(a_ids)} and {len(b_ids)}", "corrupt")
    la, _ = await traced_logits(ctx, a_ids)
    lb, rec_b = await traced_logits(ctx, b_ids)
    a_tok, b_tok = int(la.argmax()), int(lb.argmax())
    if a_tok == b_tok:
        raise InvalidRequest(f"both prompts answer {text.display(tok.token_text(a_tok))!r}: nothing to restore",
                             "corrupt")

    def diff(logits):
        return float(logits[b_tok] - logits[a_tok])

    d_a, d_b, last = diff(la), diff(lb), len(a_ids) - 1
    layers = []
    for layer in range(ctx.core().config.num_layers):
        logits, _ = await traced_logits(ctx, a_ids, patch=(layer, last, rec_b.residual[layer + 1, last]))
        d = diff(logits)
        layers.append({"layer": layer, "logit_diff": round(d, 4), "restored": round((d - d_a) / (d_b - d_a), 4)})
    show = lambda t: {"id": t, "token": text.display(tok.token_text(t))}  # noqa: E731
    return {"tokens": len(a_ids), "answer_clean": show(a_tok), "answer_corrupt": show(b_tok),
            "logit_diff_clean": round(d_a, 4), "logit_diff_corrupt": round(d_b, 4), "layers": layers}
