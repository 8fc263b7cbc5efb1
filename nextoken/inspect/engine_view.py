"""Engine widgets: the sampler's stages on real logits, the beam-search tree, the KV cache
figures, and the live state of the engine (block pool, batches, speculation, requests)."""

from __future__ import annotations

import time

import torch

from nextoken.inspect.text import display
from nextoken.sample.logits_processors import process_logits
from nextoken.sample.sampler import (Sampler, SamplerRequest, draw, draw_unmasked_is_exact, filter_mask, make_generator,
                                     uniform)
from nextoken.sampling_params import SamplingParams

SHOW_CANDIDATES = 24


def sampling_stages(tokenizer, sampler: Sampler, logits: torch.Tensor, params: SamplingParams,
                    prompt_ids: list[int], generated: list[int], grammar=None) -> dict:
    """The engine's sampler (`nextoken.sample.sampler`) taken apart on one row of real logits
    ``[vocab]``: the softmax of the raw logits; after the penalties (`process_logits`, history =
    `generated`); which tokens the grammar allows (`grammar`: a `structured.backend.SequenceGrammar`
    that has consumed `generated`, or None); after temperature; which tokens top-k, then top-p,
    then min-p keep (the same `filter_mask` the sampler runs, stage by stage, on the masked
    logits); the final distribution (`Sampler.distribution`) and the token a generator seeded with
    ``params.seed`` draws from it, the first token a request with these parameters, grammar and
    seed would produce. The candidates are the most likely before the grammar, then the most
    likely it allows, then the chosen token."""
    raw = logits.float()
    processed = process_logits(raw, params, prompt_ids, generated, sampler.eog_ids)
    row = SamplerRequest(params, prompt_ids, list(generated), make_generator(params.seed), grammar)
    allowed = grammar.allowed() if grammar is not None else torch.ones_like(raw, dtype=torch.bool)
    masked = processed.masked_fill(~allowed, float("-inf"))
    kept, probs = sampler.distribution(raw, row)
    scaled = masked / (1.0 if params.greedy else params.temperature)
    if probs is None:  # greedy: the argmax, all mass on it
        chosen = kept
        mask = torch.zeros_like(raw, dtype=torch.bool)
        mask[chosen] = True
        stages = {"top_k": mask, "top_p": mask, "min_p": mask}
        final = mask.float()
    else:
        stages = {"top_k": filter_mask(scaled, params.top_k, 1.0, 0.0) & allowed,
                  "top_p": filter_mask(scaled, params.top_k, params.top_p, 0.0) & allowed, "min_p": kept & allowed}
        final = probs
        chosen = _seeded_draw(sampler, raw, row, probs, allowed)
    stages = {"grammar": allowed, **stages}
    p_raw, p_proc, p_temp = raw.softmax(-1), processed.softmax(-1), scaled.softmax(-1)
    order = processed.topk(SHOW_CANDIDATES).indices.tolist()  # the most likely before the grammar
    if grammar is not None:
        order += [t for t in masked.topk(min(SHOW_CANDIDATES // 2, int(allowed.sum()))).indices.tolist()
                  if t not in order]
    if chosen not in order:
        order.append(chosen)
    cands = [{"id": t, "token": display(tokenizer.token_text(t)), "logit": round(float(raw[t]), 4),
              "p_raw": round(float(p_raw[t]), 5), "p_penalized": round(float(p_proc[t]), 5),
              "p_temperature": round(float(p_temp[t]), 5),
              "kept": {k: bool(m[t]) for k, m in stages.items()}, "p_final": round(float(final[t]), 5)}
             for t in order]
    return {"candidates": cands, "kept_counts": {k: int(m.sum()) for k, m in stages.items()},
            "vocab_size": raw.shape[0], "chosen": {"id": chosen, "token": display(tokenizer.token_text(chosen))},
            "greedy": params.greedy, "grammar": grammar is not None,
            "entropy_raw": round(float(-(p_raw * p_raw.clamp_min(1e-30).log()).sum()), 4)}


def _seeded_draw(sampler: Sampler, raw: torch.Tensor, row: SamplerRequest, probs: torch.Tensor,
                 allowed: torch.Tensor) -> int:
    """The token the engine's sampler draws for `row` from its generator: from `probs`, except
    under a grammar where the sampler first draws from the unmasked distribution and keeps an
    allowed token (`sampler.draw_unmasked_is_exact`), drawing from the masked one only when
    the first draw is refused; the same distribution either way, and here the same draw."""
    if row.grammar is not None and draw_unmasked_is_exact(row, row.output_ids):
        unmasked = SamplerRequest(row.params, row.prompt_ids, row.output_ids, row.generator)
        first = int(draw(sampler.distribution(raw, unmasked)[1], uniform(row.generator)))
        if allowed[first]:
            return first
    return int(draw(probs, uniform(row.generator)))


def beam_tree(tokenizer, search, greedy_ids: list[int], greedy_logprob: float | None, outputs) -> dict:
    """The tree of a finished `beam.BeamSearch` (its first prompt): one node per candidate that
    was considered (id = the generated prefix), with its step, token, cumulative log-probability
    and fate, plus the greedy path and the final beams (best first)."""
    nodes = []
    for step, cands in enumerate(search.tree[0]):
        for c in cands:
            path = [*c["prefix"], c["token"]]
            nodes.append({"id": ",".join(map(str, path)), "parent": ",".join(map(str, c["prefix"])),
                          "step": step, "token": display(tokenizer.token_text(c["token"])),
                          "cumulative_logprob": round(c["cumulative_logprob"], 4), "fate": c["fate"]})
    beams = [{"ids": list(b.token_ids), "text": b.text, "cumulative_logprob": round(b.cumulative_logprob, 4),
              "score": round(b.score, 4)} for b in outputs[0].sequences]
    return {"nodes": nodes, "beams": beams, "width": search.width,
            "greedy": {"ids": greedy_ids, "text": tokenizer.decode(greedy_ids, skip_special_tokens=True),
                       "path": [",".join(map(str, greedy_ids[: i + 1])) for i in range(len(greedy_ids))],
                       "cumulative_logprob": None if greedy_logprob is None else round(greedy_logprob, 4)}}


def kv_view(engine) -> dict:
    """Bytes per token of this model's KV cache: the formula ``2 (K and V) x layers x KV heads x
    head dim x bytes per value`` (plus a 4-byte scale per row for an int8 cache), its value, the
    cache's measured bytes per token, and memory against context length (the sliding-window layers
    keep only their window, in the model's dtype)."""
    cfg, kv = engine.config, engine.kv_tensors
    elt = kv.k.element_size()
    scale_bytes = 4 if kv.quantized else 0  # one float32 scale per key / value row
    full = len(cfg.full_layers)
    formula = 2 * full * cfg.num_kv_heads * (cfg.head_dim * elt + scale_bytes)
    sliding = cfg.sliding_kv_bytes_per_token(kv.sliding.k.element_size()) if kv.sliding is not None else 0
    lengths = sorted({min(engine.max_model_len, 2 ** i) for i in range(4, 20)} | {engine.max_model_len})
    window = cfg.sliding_window or 0
    return {"bytes_per_token": formula, "measured_bytes_per_token": kv.bytes_per_token,
            "formula": {"kv": 2, "layers": full, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                        "bytes_per_value": elt, "scale_bytes_per_row": scale_bytes,
                        "dtype": str(kv.k.dtype).replace("torch.", "")},
            "sliding": {"layers": len(cfg.sliding_layers), "window": window, "bytes_per_token": sliding},
            "per_query_heads_without_gqa": 2 * full * cfg.num_heads * cfg.head_dim * elt,
            "curve": [{"tokens": n, "bytes": n * formula + min(n, window) * sliding} for n in lengths],
            "block_size": kv.block_size, "num_blocks": engine.block_pool.num_blocks, "cache_bytes": kv.nbytes,
            "max_model_len": engine.max_model_len}


def _block_states(pool) -> str:
    """One character per block: ``.`` free, ``c`` free but holding a cached prefix, ``1``-``9``
    in use by that many sequences (``+`` for more)."""
    out = []
    for b in pool.blocks:
        if b.ref_cnt == 0:
            out.append("c" if b.block_hash is not None else ".")
        else:
            out.append(str(b.ref_cnt) if b.ref_cnt < 10 else "+")
    return "".join(out)


def _seq(engine, r) -> dict:
    out = {"request_id": r.group_id, "sequence": r.request_id, "priority": r.priority, "prompt_tokens": r.num_prompt_tokens,
           "output_tokens": len(r.output_ids), "computed": r.num_computed_tokens,
           "cached_tokens": r.num_cached_tokens, "preemptions": r.num_preemptions, "traced": r.tracer is not None,
           "blocks": engine.block_ids(r.request_id)}
    if engine.sliding_pool is not None:
        out["ring"] = engine.ring(r.request_id)
    return out


def live_state(engine, since_step: int = -1) -> dict:
    """The engine now (called between steps): stats, the block pool (and the sliding-window
    layers' pool: ``sliding``), running and waiting sequences with their block tables (and
    rings), the step-log entries after `since_step`, the recent finished requests."""
    pool, sliding = engine.block_pool, engine.sliding_pool
    steps = [s for s in engine.history.steps if s["step"] > since_step]
    return {"time": time.perf_counter(), "stats": engine.stats(), "blocks": _block_states(pool),
            "block_size": engine.block_size, "cached_blocks": len(pool.cached),
            "sliding": None if sliding is None else {"blocks": _block_states(sliding), "cached_blocks": len(sliding.cached),
                                                     "window": engine.config.sliding_window},
            "running": [_seq(engine, r) for r in engine.running],
            "waiting": [_seq(engine, r) for r in engine.waiting],
            "steps": steps, "last_step": engine.num_steps - 1,
            "speculative": None if engine.speculative is None else {
                "method": engine.speculative.method, "num_speculative_tokens": engine.speculative.num_speculative_tokens},
            "requests": [_request(r, engine.tokenizer) for r in list(engine.history.requests)[-12:]]}


def _request(r: dict, tokenizer) -> dict:
    out = dict(r)
    out["outputs"] = [o if o["text"] is not None else {  # (text its server process made: decoded here)
        **o, "text": tokenizer.decode(o["token_ids"], skip_special_tokens=r.get("skip_special_tokens", True))}
        for o in r["outputs"]]
    t0 = r["arrival_time"]
    out["ttft_ms"] = None if r["first_token_time"] is None else (r["first_token_time"] - t0) * 1000
    out["latency_ms"] = None if r["finished_time"] is None else (r["finished_time"] - t0) * 1000
    out["queue_ms"] = None if r.get("queue_time") is None else max(0.0, r["queue_time"]) * 1000
    return out


def timeline(engine, request_id: str, metrics) -> dict:
    """The steps of request `request_id` from the engine's step log: each prefill chunk (tokens,
    ms) and decode step (ms, batch size), with TTFT and TPOT from its metrics."""
    rows = []
    for s in engine.history.steps:
        chunk = next((n for rid, n in s["prefill"] if rid == request_id), None)
        if chunk is not None:
            rows.append({"step": s["step"], "phase": "prefill", "tokens": chunk, "ms": round(s["ms"], 3),
                         "start_ms": round((s["time"] - metrics.arrival_time) * 1000, 3),
                         "batch": len(s["prefill"]) + len(s["decode"])})
        elif request_id in s["decode"]:
            rows.append({"step": s["step"], "phase": "decode", "tokens": 1, "ms": round(s["ms"], 3),
                         "start_ms": round((s["time"] - metrics.arrival_time) * 1000, 3),
                         "batch": len(s["prefill"]) + len(s["decode"])})
    tpot = None
    if metrics.finished_time and metrics.first_token_time and metrics.num_output_tokens > 1:
        tpot = (metrics.finished_time - metrics.first_token_time) / (metrics.num_output_tokens - 1) * 1000
    return {"steps": rows, "ttft_ms": None if metrics.ttft is None else metrics.ttft * 1000, "tpot_ms": tpot,
            "prompt_tokens": metrics.num_prompt_tokens, "output_tokens": metrics.num_output_tokens}
