"""Block tables: which blocks hold which request's tokens, and how they are allocated.

Token position ``p`` of a request lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its *slot* in the whole cache is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from nextoken.kv_cache.block_pool import BlockPool, KVCacheBlock, hash_block


class KVCacheManager:
    """Allocates blocks to requests, finds cached prefixes, frees blocks when requests end.

    With `sliding_blocks` (a model with sliding-window layers), each request also owns a ring of
    up to `ring_blocks` blocks from a second pool for those layers (`kv_cache.tensors`). Their
    older keys are overwritten, so a prefix of such a model cannot be reused: prefix caching and
    prefix sharing are off for it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_blocks: int = 0, ring_blocks: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching and not sliding_blocks
        self.pool = BlockPool(num_blocks, self.enable_caching)
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self._num_cached: dict[str, int] = {}  # blocks of each request registered in the cache
        self.ring_blocks = ring_blocks
        self.sliding_pool = BlockPool(sliding_blocks, False) if sliding_blocks else None
        self.rings: dict[str, list[KVCacheBlock]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]

    def ring_ids(self, request_id: str) -> list[int] | None:
        """The request's sliding-window ring blocks (None for a model without such layers)."""
        if self.sliding_pool is None:
            return None
        return [b.block_id for b in self.rings.get(request_id, ())]

    def _block_hashes(self, req, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first `num_blocks` full blocks (memoised on it)."""
        hashes, bs, toks = req.block_hashes, self.block_size, req.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(toks[i * bs : (i + 1) * bs])))
        return hashes[:num_blocks]

    def get_computed_blocks(self, req) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that starts the request's tokens. At least one
        token is always left to compute (its logits are needed to sample)."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits = []
        for i, h in enumerate(self._block_hashes(req, max_blocks)):
            b = self.pool.get_cached_block(h, tuple(req.all_token_ids[i * bs : (i + 1) * bs]))
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, req, num_new_tokens: int, computed: list[KVCacheBlock] = ()) -> bool:
        """Give `req` the blocks for `num_new_tokens` more tokens after its computed ones (and
        the cached blocks `computed`, when it is being admitted). False, changing nothing, when
        too few blocks are free."""
        table = self.block_tables.setdefault(req.request_id, [])
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = self.blocks_for(total) - len(table) - len(computed)
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)  # free now, but about to be used
        ring = self.rings.get(req.request_id, [])
        ring_need = min(self.ring_blocks, self.blocks_for(total)) - len(ring) if self.sliding_pool else 0
        if need > self.pool.num_free_blocks - reclaimed or \
                (ring_need > 0 and ring_need > self.sliding_pool.num_free_blocks):
            if not table:
                del self.block_tables[req.request_id]
            return False
        self.pool.touch(computed)
        table.extend(computed)
        if need > 0:
            table.extend(self.pool.get_new_blocks(need))
        if ring_need > 0:
            self.rings[req.request_id] = ring + self.sliding_pool.get_new_blocks(ring_need)
        return True

    def share_prefix(self, parent, child, num_tokens: int) -> int:
        """Let `child` use the parent's blocks for its first `num_tokens` tokens, full blocks
        only (copy-free sharing: the child writes its own tokens into new blocks). Returns the
        number of tokens shared (none for a model with sliding-window layers)."""
        if self.sliding_pool is not None:
            return 0
        n = num_tokens // self.block_size
        shared = self.block_tables[parent.request_id][:n]
        self.pool.touch(shared)
        self.block_tables[child.request_id] = list(shared)
        child.block_hashes[:] = parent.block_hashes[:n]
        return n * self.block_size

    def cache_full_blocks(self, req) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        n_full = req.num_computed_tokens // self.block_size
        start = self._num_cached.get(req.request_id, 0)
        if n_full <= start:
            return
        table = self.block_tables[req.request_id]
        hashes = self._block_hashes(req, n_full)
        bs = self.block_size
        for i in range(start, n_full):
            self.pool.cache_block(table[i], hashes[i], tuple(req.all_token_ids[i * bs : (i + 1) * bs]))
        self._num_cached[req.request_id] = n_full

    def uncache(self, req) -> None:
        """Take out of the prefix cache the blocks only `req` holds (call before `free`): a pass
        that produced non-finite logits may have written non-finite keys and values, which no
        later prompt with the same prefix should reuse. Blocks other requests share stay."""
        for b in self.block_tables.get(req.request_id, []):
            if b.ref_cnt == 1:
                self.pool.uncache_block(b)

    def free(self, req) -> None:
        """Release the request's blocks; the tail is freed first so it is evicted first."""
        table = self.block_tables.pop(req.request_id, [])
        self._num_cached.pop(req.request_id, None)
        self.pool.free_blocks(reversed(table))
        if self.sliding_pool is not None:
            self.sliding_pool.free_blocks(self.rings.pop(req.request_id, []))
