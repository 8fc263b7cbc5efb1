"""One prompt's journey: everything one decode step does to the learner's own prompt, stage by
stage, as the inspector's first view draws it (``POST /inspect/api/journey/step``).

A step runs two passes over the prompt and the tokens generated so far:
- a plain request, batched with the others as usual, that returns the next-token logits; the
  sampler's stages on that row (`engine_view.sampling_stages`) give the token with the
  learner's settings: greedy, or the seeded draw a request with that seed makes;
- a traced pass (`trace.recorder.TraceRecorder`, the last row only) for what happens inside:
  each layer's residual stream and the last token's attention per head.
`step_view` turns both into the stages, in the order the seeds tell it.
"""

from __future__ import annotations

import math

import torch

from nextoken.inspect.text import display
from nextoken.inspect.trace import lens_probs, logit_lens, ranked

TOP_LOGITS = 10  # candidates shown from the LM head
ROPE_PAIRS = 8  # dimension pairs shown, fast to slow
EMBED_VALUES = 16  # leading values of the embedding row shown


def _tokens(tokenizer, ids: list[int], prompt_len: int) -> list[dict]:
    return [{"id": i, "token": display(tokenizer.token_text(i)), "text": tokenizer.token_text(i),
             "special": i in tokenizer.special_ids,
             "generated": n >= prompt_len} for n, i in enumerate(ids)]


def _positions(model, position: int) -> dict:
    """RoPE at `position`: for a spread of dimension pairs, rate, angle (mod 2 pi), cos and sin."""
    inv = getattr(model, "inv_freq", None)
    if inv is None:
        return {"rope": False, "position": position}
    inv = inv.float()
    picks = sorted({round(i * (inv.numel() - 1) / (ROPE_PAIRS - 1)) for i in range(ROPE_PAIRS)})
    pairs = []
    for i in picks:
        angle = position * float(inv[i])
        pairs.append({"pair": i, "rate": float(inv[i]), "angle": round(angle % (2 * math.pi), 4),
                      "turns": round(angle / (2 * math.pi), 3), "cos": round(math.cos(angle), 4),
                      "sin": round(math.sin(angle), 4)})
    return {"rope": True, "position": position, "pairs": pairs, "num_pairs": inv.numel()}


def _layers(tracer, lens: list[dict], tokens: list[dict]) -> list[dict]:
    """Per layer: the residual's norm at its input, after the attention's add and at its output
    (last token), the last token's strongest keys per head, and the logit lens' top token after it."""
    res = tracer.residual[:, -1]  # [layers + 1, hidden]
    norms, mids = res.norm(dim=-1), tracer.mid[:, -1].norm(dim=-1)
    out = []
    for layer, att in enumerate(tracer.attention):
        a = att.float()  # [heads, T]: the last query row
        k = min(3, a.shape[-1])
        vals, idx = a.topk(k, dim=-1)
        heads = [[{"position": int(p), "token": tokens[int(p)]["token"], "weight": round(float(v), 3)}
                  for v, p in zip(vals[h], idx[h])] for h in range(a.shape[0])]
        top = lens[layer + 1]["top"][0]
        out.append({"layer": layer, "norm_in": round(float(norms[layer]), 3), "norm_mid": round(float(mids[layer]), 3),
                    "norm_out": round(float(norms[layer + 1]), 3),
                    "heads": heads, "lens": top, "ms": round(tracer.layer_ms[layer], 3)})
    return out


def commitment(probs: torch.Tensor, token: int) -> dict:
    """When the logit lens committed to `token` (NDIF Workbench's commitment strip): `probs`
    ``[layers + 1, vocab]``, the lens' distributions of the last position (the embeddings, then
    after each layer). ``ranks[l]``: the token's rank after layer l (0: the lens' top-1), equal
    probabilities ranked by id as `inspect.trace.ranked` ranks them;
    ``top1``/``top3``: the first layer from which it stays the top-1 / among the top 3 to the last
    layer (None: it never settles there, as a sampled token below the top may not); ``layers``."""
    mine = probs[:, token : token + 1]
    above = (probs > mine).sum(-1) + (probs[:, :token] == mine).sum(-1)
    ranks = [int(r) for r in above[1:]]  # the layers' rows (not the embeddings')

    def settles(k: int):
        at = None
        for layer in range(len(ranks) - 1, -1, -1):
            if ranks[layer] >= k:
                break
            at = layer
        return at

    return {"ranks": ranks, "top1": settles(1), "top3": settles(3), "layers": len(ranks)}


def step_view(eng, tracer, logits: torch.Tensor, stages: dict, ids: list[int], prompt_len: int) -> dict:
    """The stages of one step. `ids`: prompt + generated (what the passes ran on); `logits`
    ``[vocab]``: the plain request's next-token row; `stages`: `engine_view.sampling_stages` on
    it (its ``chosen`` is the step's token)."""
    tok, model = eng.tokenizer, eng.model
    tokens = _tokens(tok, ids, prompt_len)
    last = len(ids) - 1
    emb = tracer.residual[0, -1]
    lens = logit_lens(tracer, model, tok, tracer.num_tokens - 1, top=1)
    probs = logits.float().softmax(-1)
    vals, top = (t[0] for t in ranked(logits.float()[None], TOP_LOGITS))
    chosen = stages["chosen"]["id"]
    committed = commitment(lens_probs(model, tracer.residual[:, -1]), chosen)
    generated = ids[prompt_len:]
    before, after = tok.decode(generated), tok.decode(generated + [chosen])
    bs = eng.cache_config.block_size
    filled = len(ids)  # the cache holds every token the passes ran on; the chosen one joins next step
    return {
        "tokens": tokens,
        "embedding": {"id": ids[-1], "token": tokens[-1]["token"], "norm": round(float(emb.norm()), 4),
                      "values": [round(float(x), 4) for x in emb[:EMBED_VALUES]], "hidden": emb.numel()},
        "positions": _positions(model, last),
        "layers": _layers(tracer, lens, tokens),
        "final": {"norm_in": round(float(tracer.residual[-1, -1].norm()), 3), "vocab": logits.numel(),
                  "top": [{"id": int(i), "token": display(tok.token_text(int(i))), "logit": round(float(v), 4),
                           "prob": round(float(probs[i]), 5)} for v, i in zip(vals, top)]},
        "sampler": stages,
        "choice": {**stages["chosen"], "prob": round(float(probs[chosen]), 5), "is_eos": chosen in tok.eog_token_ids},
        "commitment": committed,
        "detokenizer": {"before": before, "after": after,
                        "delta": after[len(before):] if after.startswith(before) else after},
        "kv": {"block_size": bs, "tokens": filled, "blocks": [min(bs, filled - b * bs) for b in range(-(-filled // bs))],
               "bytes_per_token": eng.kv_tensors.bytes_per_token},
    }
