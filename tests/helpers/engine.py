"""Engine invariants shared by the engine, beam-search and speculation tests."""

from __future__ import annotations

import torch


def assert_no_leak(llm):
    """Every block is free, or held only by the prefix cache (ref count 0), the sliding-window
    layers' blocks too."""
    assert not llm.engine.has_unfinished_requests()
    kv = llm.engine.kv
    pool = kv.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free_blocks == pool.num_blocks
    if kv.sliding_pool is not None:
        sliding = kv.sliding_pool
        assert not kv.rings and all(b.ref_cnt == 0 for b in sliding.blocks)
        assert sliding.num_free_blocks == sliding.num_blocks


def hf_logits_stepwise(model, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """transformers' logits: the prompt's last position, then one decode step per continuation
    token with its own KV cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, past = [out.logits[0, -1]], out.past_key_values
        for t in continuation:
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0, -1])
            past = out.past_key_values
    return logits
