"""What the served weights cost in quality on one prompt: per position, the KL divergence of the
served model's next-token distribution from a float32 reference of the same model, and whether
both put the same token first (llama.cpp's ``--kl-divergence``, `evaluate.perplexity`, here on
the learner's own prompt).

The reference is a second engine on the same model file with float32 weights (GGUF codes
de-quantized, a folder's weights without ``--quantization``), plain PyTorch and the reference
attention: `nextoken perplexity --kl-divergence`'s reference. It is built once, on demand, when
its float32 weights fit `REFERENCE_MAX_BYTES`, and kept. For a GGUF file the stored codes are
the model as published, so the figures measure what serving adds to them (bf16 activations, our
kernels, an int8 KV cache); for a folder served with ``--quantization``, the quantization itself.
"""

from __future__ import annotations

import threading
import time

import torch

from nextoken.errors import InvalidRequest
from nextoken.evaluate.perplexity import kl_and_agreement, log_probs, reference_args, score_prompts
from nextoken.inspect import model_view
from nextoken.inspect.text import display
from nextoken.sampling_params import SamplingParams

REFERENCE_MAX_BYTES = 3 * 2**30  # float32 weights of the reference engine built on demand
REFERENCE_BLOCKS = 40  # KV blocks of the reference (16 tokens each: one traced prompt)


def reference_bytes(engine) -> int:
    """Bytes of `engine`'s model in float32: 4 per parameter (a tied table counted once)."""
    view = model_view.architecture(engine)
    parts = view["parts"]
    return 4 * sum(p["parameters"] for name, p in parts.items() if not (name == "lm_head" and view["tied_embeddings"]))


class Reference:
    """The float32 reference engine for one served engine, built on first use and kept. It is
    a synchronous `LLMEngine`, stepped by one caller at a time (`hidden` holds a lock)."""

    def __init__(self):
        self.engine = None
        self.build_s: float | None = None
        self._lock = threading.Lock()

    def hidden(self, served, ids: list[int]) -> tuple[object, torch.Tensor]:
        """The reference engine and its final hidden states of prompt `ids` ``[len(ids) - 1,
        hidden]`` (blocking: call it in a worker thread). Raises `InvalidRequest` when the
        reference's float32 weights would exceed `REFERENCE_MAX_BYTES` or its request fails."""
        with self._lock:
            reference = self._get(served)
            group = score_prompts(reference, [ids], True)[0]
        if group.error is not None:
            raise InvalidRequest(f"the reference failed: {group.error}", "prompt")
        return reference, group.prompt_hidden

    def traced(self, served, ids: list[int]):
        """The reference's `TraceRecorder` of prompt `ids` (its residual stream after every
        layer, its next-token logits; blocking). Raises as `hidden` does."""
        from nextoken.request_options import RequestOptions
        from nextoken.trace.recorder import TraceRecorder

        with self._lock:
            reference = self._get(served)
            rec = TraceRecorder(reference.config, last_row_only=True)
            rid = reference.add_request(ids, SamplingParams(temperature=0, max_tokens=1), options=RequestOptions(tracer=rec))
            out = reference.run_until_finished([rid])[0]
        if out.error is not None:
            raise InvalidRequest(f"the reference failed: {out.error}", "prompt")
        return rec

    def _get(self, served):
        size = reference_bytes(served)
        if size > REFERENCE_MAX_BYTES:
            raise InvalidRequest(f"the float32 reference of this model needs {size / 2**30:.1f} GiB; the inspector "
                                 f"builds one only up to {REFERENCE_MAX_BYTES / 2**30:.0f} GiB", "prompt")
        if self.engine is None:
            from nextoken.engine.engine import LLMEngine

            t = time.perf_counter()
            self.engine = LLMEngine.from_engine_args(reference_args(served.args).replace(
                max_num_seqs=1, num_kv_blocks=REFERENCE_BLOCKS, enable_prefix_caching=False))
            self.build_s = time.perf_counter() - t
        return self.engine


def compare(served, reference, ids: list[int], served_hidden: torch.Tensor, ref_hidden: torch.Tensor) -> dict:
    """Per scored position p (predicting prompt token p + 1): KL(P_ref || P_served) in nats, each
    side's top token and the log-probability each gives the prompt's actual next token; and the
    means. Runs both LM heads (their scratch buffers are per thread: a worker thread may run this
    while the engine steps)."""
    tok = served.tokenizer
    lp, lr = served.compute_logits(served_hidden).log_softmax(-1), log_probs(reference, ref_hidden)
    lr = lr.to(lp.device)
    kl, same = kl_and_agreement(lp, lr)
    nxt = torch.tensor(ids[1:], device=lp.device)
    lp_next, lr_next = lp.gather(1, nxt[:, None])[:, 0], lr.gather(1, nxt[:, None])[:, 0]
    top_s, top_r = lp.argmax(-1).tolist(), lr.argmax(-1).tolist()
    rows = [{"position": p, "token": display(tok.token_text(ids[p])), "next": display(tok.token_text(ids[p + 1])),
             "kl": round(float(kl[p]), 6), "same_top": bool(same[p]),
             "top_served": display(tok.token_text(top_s[p])), "top_reference": display(tok.token_text(top_r[p])),
             "logprob_served": round(float(lp_next[p]), 4), "logprob_reference": round(float(lr_next[p]), 4)}
            for p in range(len(ids) - 1)]
    return {"positions": rows, "kl_mean": round(float(kl.mean()), 6), "kl_max": round(float(kl.max()), 6),
            "top1_agreement": round(float(same.float().mean()), 4)}


def layer_diff(served_rec, ref_rec) -> dict:
    """Per layer, how far the served residual stream is from the reference's over the prompt's
    positions (mean cosine similarity, mean relative norm of the difference), and KL(reference ||
    served) of the next-token distributions after the prompt, in nats."""
    rows = []
    for layer in range(served_rec.residual.shape[0] - 1):
        s, r = served_rec.residual[layer + 1], ref_rec.residual[layer + 1]  # [T, hidden]
        cos = torch.nn.functional.cosine_similarity(s, r, dim=-1).mean()
        rel = ((s - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)).mean()
        rows.append({"layer": layer, "cos": round(float(cos), 6), "rel": round(float(rel), 6)})
    ls, lr = served_rec.first_logits.log_softmax(-1), ref_rec.first_logits.log_softmax(-1)
    return {"layers": rows, "kl_next": round(float((lr.exp() * (lr - ls)).sum()), 6)}


def describe(engine) -> dict:
    """What the served engine computes with: its dtype and the formats of layer 0's weights."""
    view = model_view.architecture(engine)
    return {"dtype": view["dtype"], "weights": sorted({w["format"] for w in view["layer0"]}),
            "kv_cache_dtype": engine.args.kv_cache_dtype}


def served_params() -> SamplingParams:
    """The served engine's request: score the prompt, generate nothing."""
    return SamplingParams(max_tokens=0, prompt_logprobs=0)
