"""Block tables: which blocks hold which request's tokens, and how they are allocated.

Token position ``p`` of a request lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its *slot* in the whole cache is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nextoken.kv_cache.block_pool import BlockPool, KVCacheBlock, hash_block
from nextoken.kv_cache.disk import chain_key


def ring_blocks(window: int, block_size: int, max_decode_rows: int = 1) -> int:
    """Blocks a sliding-window layer's ring needs per sequence: the `window` - 1 keys before a
    pass's first decode row, plus the `max_decode_rows` (1 + drafted tokens) that pass writes,
    spread over at most one more block than they fill. (A prefill chunk reads the keys before
    it first, then writes only its last ``ring_blocks * block_size`` tokens.)"""
    return -(-(window - 1 + max_decode_rows) // block_size) + 1


@dataclass(frozen=True)
class DiskStats:
    """The prefix cache's disk tier since the start (zeros without it): prompt tokens looked up
    there and found; its blocks read (hits), looked up and absent (misses), written, dropped
    (queue full, writes off, too large), bad files and failed reads or writes (errors); bytes."""

    queries: int = 0
    hit_tokens: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    errors: int = 0
    dropped: int = 0


class KVCacheManager:
    """Allocates blocks to requests, finds cached prefixes, frees blocks when requests end.

    With `sliding_blocks` (a model with sliding-window layers), each request also owns a ring of
    up to `ring_blocks` blocks from a second pool for those layers (`kv_cache.tensors`), whose
    older keys are overwritten. Such a model's prefix is reused with its ring (vLLM's hybrid
    cache keeps a sliding layer's last window of blocks for the same reason): when a request
    ends, its ring is parked under the chained hash of its last full block (`parked`, oldest
    first), its full-attention blocks stay in the prefix cache as for any model, and a later
    request whose cached prefix ends at such a block takes the ring over and goes on from
    there. The ring then holds the keys of the window before that point (`ring_blocks` leaves
    a block and a decode row to spare: less than a block lies past it). Parked rings give their
    blocks back, oldest first, when a request needs ring blocks the pool lacks. Copy-free prefix
    sharing (`share_prefix`) and the disk tier stay off for such a model (its rings are neither
    shared nor on disk).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_blocks: int = 0, ring_blocks: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, self.enable_caching)
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # each table's block ids, kept beside it (read every step)
        self._num_cached: dict[str, int] = {}  # blocks of each request registered in the cache
        self.ring_blocks = ring_blocks
        self.sliding_pool = BlockPool(sliding_blocks, False) if sliding_blocks else None
        self.rings: dict[str, list[KVCacheBlock]] = {}
        self.parked: OrderedDict[int, list[KVCacheBlock]] = OrderedDict()  # rings of ended requests, by block hash
        self.disk = None  # the prefix cache's disk tier (`kv_cache.disk.DiskTier`), if any
        self.disk_queries = self.disk_hits = 0  # prompt tokens looked up on disk, and found there

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order: the manager's own list, grown as blocks are added
        (read it within the step; copy it to keep it)."""
        return self._block_ids.get(request_id, [])

    def ring_ids(self, request_id: str) -> list[int] | None:
        """The request's sliding-window ring blocks (None for a model without such layers)."""
        if self.sliding_pool is None:
            return None
        return [b.block_id for b in self.rings.get(request_id, ())]

    def _block_hashes(self, req, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first `num_blocks` full blocks (memoised on it)."""
        hashes, bs, toks = req.block_hashes, self.block_size, req.all_token_ids
        root = ("lora", req.lora_id) if req.lora_id else None  # an adapter's keys and values are its own
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else root, tuple(toks[i * bs : (i + 1) * bs])))
        return hashes[:num_blocks]

    def _disk_keys(self, req, num_blocks: int) -> list[bytes]:
        """The disk tier's chain keys of the request's first `num_blocks` full blocks (memoised)."""
        keys, bs, toks, ns = req.disk_keys, self.block_size, req.all_token_ids, self.disk.store.namespace
        while len(keys) < num_blocks:
            i = len(keys)
            keys.append(chain_key(ns, keys[-1] if keys else None, toks[i * bs : (i + 1) * bs]))
        return keys[:num_blocks]

    def get_computed_blocks(self, req) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that starts the request's tokens: from RAM, or
        read back from the disk tier into free blocks (which then join the RAM prefix cache). At
        least one token is always left to compute (its logits are needed to sample)."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits = []
        for i, h in enumerate(self._block_hashes(req, max_blocks)):
            toks = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            b = self.pool.get_cached_block(h, toks)
            if b is None and self.disk is not None and not req.lora_id:
                b = self._load_block(req, i, h, toks)
            if b is None:
                break
            if self.disk is not None:  # in use while later blocks load, so no load takes it
                self.pool.touch([b])
            hits.append(b)
        if self.disk is not None:
            self.pool.free_blocks(hits)
        if self.sliding_pool is not None:  # as far as a parked ring goes on from (`allocate_slots` takes it)
            hits = hits[: next((k for k in range(len(hits), 0, -1) if hits[k - 1].block_hash in self.parked), 0)]
        return hits

    def _load_block(self, req, i: int, block_hash: int, toks: tuple[int, ...]) -> KVCacheBlock | None:
        """Block `i` of `req` read from the disk tier into a free block (then cached, unused),
        or None: not on disk, a bad file, or no free block to spare."""
        if self.pool.num_free_blocks < 2:
            return None
        self.disk_queries += self.block_size
        payload = self.disk.fetch(self._disk_keys(req, i + 1)[i], toks)
        if payload is None:
            return None
        self.disk_hits += self.block_size
        b = self.pool.get_new_blocks(1)[0]
        self.disk.fill(b.block_id, payload)
        self.pool.cache_block(b, block_hash, toks)
        self.pool.free_blocks([b])
        return b

    def disk_stats(self) -> DiskStats:
        """The disk tier's counts (zeros without one): prompt tokens looked up on disk and found
        there, and the store's blocks and bytes (`DiskKVStore.stats`)."""
        store = self.disk.store.stats if self.disk is not None else {}
        return DiskStats(self.disk_queries, self.disk_hits, **store)

    def allocate_slots(self, req, num_new_tokens: int, computed: list[KVCacheBlock] = ()) -> bool:
        """Give `req` the blocks for `num_new_tokens` more tokens after its computed ones (and
        the cached blocks `computed`, when it is being admitted). False, changing nothing, when
        too few blocks are free."""
        table = self.block_tables.setdefault(req.request_id, [])
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        if not computed and self.sliding_pool is None and total <= len(table) * self.block_size:
            return True  # (most decodes: the last block has room)
        need = self.blocks_for(total) - len(table) - len(computed)
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)  # free now, but about to be used
        resumed = self.parked.pop(computed[-1].block_hash) if computed and self.sliding_pool else None
        ring = resumed or self.rings.get(req.request_id, [])  # (a ring goes on from the cached prefix)
        ring_need = min(self.ring_blocks, self.blocks_for(total)) - len(ring) if self.sliding_pool else 0
        short = need > self.pool.num_free_blocks - reclaimed
        if not short and ring_need > 0:  # (parked rings give way only to a request that then fits)
            self._unpark(ring_need)
            short = ring_need > self.sliding_pool.num_free_blocks
        if short:
            if not table:
                del self.block_tables[req.request_id]
            if resumed:  # parked again (the newest), for the next try
                self.parked[computed[-1].block_hash] = resumed
            return False
        self.pool.touch(computed)
        new = [*computed, *self.pool.get_new_blocks(need)] if need > 0 else list(computed)
        table.extend(new)
        self._block_ids.setdefault(req.request_id, []).extend(b.block_id for b in new)
        if ring_need > 0 or resumed:
            self.rings[req.request_id] = ring + (self.sliding_pool.get_new_blocks(ring_need) if ring_need > 0 else [])
        return True

    def _unpark(self, n: int) -> None:
        """Give parked rings' blocks back to the ring pool, oldest first, until `n` are free (or
        none is parked)."""
        while self.parked and self.sliding_pool.num_free_blocks < n:
            self.sliding_pool.free_blocks(self.parked.popitem(last=False)[1])

    def _park(self, req, ring: list[KVCacheBlock]) -> None:
        """Keep an ending request's ring under the hash of its last full block, when the prefix
        cache holds every full block of its computed tokens (`cache_full_blocks`): less than a
        block then lies past it, and the ring still holds the window before it (after a pass's
        drafted rows too: `ring_blocks`). Otherwise the ring goes back to the pool."""
        n = req.num_computed_tokens // self.block_size
        if not ring or n == 0 or not self.enable_caching or self._num_cached.get(req.request_id, 0) < n:
            self.sliding_pool.free_blocks(ring)
            return
        key = self._block_hashes(req, n)[-1]
        old = self.parked.pop(key, None)
        if old is not None:
            self.sliding_pool.free_blocks(old)
        self.parked[key] = ring

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
        self._block_ids[child.request_id] = [b.block_id for b in shared]
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
        keys = self._disk_keys(req, n_full) if self.disk is not None and not req.lora_id else None
        for i in range(start, n_full):
            toks = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            self.pool.cache_block(table[i], hashes[i], toks)
            if keys is not None:  # copied now, written by the disk tier's thread
                self.disk.offer(keys[i], toks, table[i].block_id)
        self._num_cached[req.request_id] = n_full

    def uncache(self, req) -> None:
        """Take out of the prefix cache the blocks only `req` holds (call before `free`): a pass
        that produced non-finite logits may have written non-finite keys and values, which no
        later prompt with the same prefix should reuse. Blocks other requests share stay."""
        for i, b in enumerate(self.block_tables.get(req.request_id, [])):
            if b.ref_cnt == 1:
                self.pool.uncache_block(b)
                if self.disk is not None and i < len(req.disk_keys):
                    self.disk.store.discard(req.disk_keys[i])
        if self.sliding_pool is not None:  # its ring is not parked either
            self.sliding_pool.free_blocks(self.rings.pop(req.request_id, []))

    def free(self, req) -> None:
        """Release the request's blocks; the tail is freed first so it is evicted first."""
        table = self.block_tables.pop(req.request_id, [])
        self._block_ids.pop(req.request_id, None)
        if self.sliding_pool is not None:
            self._park(req, self.rings.pop(req.request_id, []))
        self._num_cached.pop(req.request_id, None)
        self.pool.free_blocks(reversed(table))

    def close(self) -> None:
        """Wait for the disk tier's queued blocks to be written (nothing to do without one)."""
        if self.disk is not None:
            self.disk.store.flush()
