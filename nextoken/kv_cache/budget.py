"""How many KV cache blocks (and sliding-window rings) an engine allocates: a pure function of
the sizes involved, so it can be tested without a model.

The budget is `CacheConfig.memory_bytes` when given; otherwise a quarter of the memory available
now (``/proc/meminfo``), at most 1 GiB, and never more than `max_num_seqs` full contexts need. A
model with sliding-window layers first sets aside each sequence's ring (its window plus the
step's drafts): rings for `max_num_seqs` sequences when they fit in half the budget, else for
fewer. The rest is cut into blocks; an explicit `num_blocks` wins. When every layer slides
(Mistral-style), block tables cost nothing and the count only bounds the tokens per sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("nextoken.kv_cache")

DEFAULT_KV_SHARE = 0.25  # of available memory, when no budget is given
DEFAULT_KV_CAP = 1 << 30  # bytes


def default_kv_memory(meminfo: str = "/proc/meminfo") -> int:
    """A quarter of the memory available now (bytes, from `meminfo`), at most 1 GiB; 8 GiB
    assumed available when the file cannot be read."""
    avail = 8 << 30
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return min(int(avail * DEFAULT_KV_SHARE), DEFAULT_KV_CAP)


@dataclass(frozen=True)
class KVBudget:
    """The allocation: `num_blocks` paged blocks, and `num_rings` rings of `ring_blocks` blocks
    each (0 without sliding-window layers)."""

    num_blocks: int
    num_rings: int = 0
    ring_blocks: int = 0

    @property
    def sliding_blocks(self) -> int:
        return self.num_rings * self.ring_blocks


def plan_kv_budget(*, block_size: int, bytes_per_block: int, max_num_seqs: int, max_model_len: int,
                   ring_blocks: int = 0, bytes_per_ring: int = 0, memory_bytes: int | None = None,
                   num_blocks: int | None = None, available: int | None = None) -> KVBudget:
    """The `KVBudget` for these sizes (bytes; `block_size` and `max_model_len` in tokens).

    bytes_per_block: one paged block over every full-attention layer (the draft model's too);
    ring_blocks / bytes_per_ring: one sequence's ring and its size (0 without sliding layers);
    memory_bytes: the user's budget (`--kv-cache-memory`), else `available` (default:
    `default_kv_memory()`) capped at `max_num_seqs` full contexts; num_blocks: the user's count
    (`--num-kv-blocks`), which wins over the budget. Raises `ValueError` for a size below 1."""
    if block_size < 1 or max_num_seqs < 1 or max_model_len < 1:
        raise ValueError(f"block_size {block_size}, max_num_seqs {max_num_seqs} and max_model_len {max_model_len} "
                         "must be positive")
    blocks_per_seq = -(-max_model_len // block_size)
    full = max_num_seqs * (blocks_per_seq * bytes_per_block + bytes_per_ring)
    budget = memory_bytes or min(default_kv_memory() if available is None else available, full)
    num_rings = max(1, min(max_num_seqs, budget // 2 // bytes_per_ring)) if ring_blocks else 0
    if bytes_per_block:
        blocks = num_blocks or max(1, (budget - num_rings * bytes_per_ring) // bytes_per_block)
    else:  # every layer slides: any number of block-table entries will do
        blocks = num_blocks or max_num_seqs * blocks_per_seq
    return KVBudget(blocks, num_rings, ring_blocks)


def allocate_kv_cache(runner, draft_runner, cache, max_num_seqs: int, max_model_len: int, lookahead: int = 0,
                      model_key: str | None = None, gpu_memory_utilization: float = 0.9,
                      max_num_batched_tokens: int = 2048):
    """Size the KV cache for `runner`'s model (and the draft model's, whose keys and values live
    in the same block ids) with `plan_kv_budget`, make the runners' cache tensors, log what was
    made, and return the `KVCacheManager` over the blocks, with the disk tier `cache` asks for
    (`kv_cache.disk`; `model_key`: the SHA-256 of the model it keys). cache: the `CacheConfig`;
    lookahead: drafted tokens per step (each sliding-window ring holds them too). On a GPU
    without a size given, the cache takes what `gpu_memory_utilization` of the GPU's memory
    leaves after the weights and a measured pass of `max_num_batched_tokens` tokens
    (`ModelRunner.gpu_kv_memory`), as vLLM sizes it."""
    from nextoken.kv_cache.disk import open_disk_tier
    from nextoken.kv_cache.manager import KVCacheManager
    from nextoken.kv_cache.manager import ring_blocks
    from nextoken.kv_cache.tensors import bytes_per_block

    cfg, dtype, bs = runner.config, runner.dtype, cache.block_size
    per_block = bytes_per_block(cfg, bs, dtype, cache.cache_dtype)
    if draft_runner is not None:
        per_block += bytes_per_block(draft_runner.config, bs, dtype, cache.cache_dtype)
    ring, per_ring = 0, 0
    if cfg.sliding_layers:  # each sequence's ring: its window plus this step's drafts
        ring = ring_blocks(cfg.sliding_window, bs, 1 + lookahead)
        per_ring = ring * cfg.sliding_kv_bytes_per_token(torch.finfo(dtype).bits // 8) * bs
    memory = cache.memory_bytes
    if runner.device.is_cuda and memory is None and not cache.num_blocks:
        memory = runner.gpu_kv_memory(gpu_memory_utilization, min(max_num_batched_tokens, max_model_len),
                                      max_num_seqs, ring)
    budget = plan_kv_budget(block_size=bs, bytes_per_block=per_block, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len, ring_blocks=ring, bytes_per_ring=per_ring,
                            memory_bytes=memory, num_blocks=cache.num_blocks)
    manager = KVCacheManager(budget.num_blocks, bs, cache.enable_prefix_caching, budget.sliding_blocks, ring,
                             cfg.sliding_window if ring else 0)
    runner.init_kv_cache(budget.num_blocks, bs, budget.sliding_blocks, ring, cache.cache_dtype)
    if draft_runner is not None:
        draft_runner.init_kv_cache(budget.num_blocks, bs, cache_dtype=cache.cache_dtype)
    rings = f", rings of {ring} blocks for {budget.num_rings} sequences" if ring else ""
    log.info("KV cache: %d blocks of %d tokens (%s, %.1f MiB%s) on %s, max_model_len %d, max_num_seqs %d, prefix "
             "caching %s", budget.num_blocks, bs, cache.cache_dtype, runner.kv.nbytes / 2**20, rings,
             runner.device.torch, max_model_len, max_num_seqs, "on" if manager.enable_caching else "off")
    if manager.enable_caching and model_key is not None:
        manager.disk = open_disk_tier(cache, runner, model_key)
    return manager
