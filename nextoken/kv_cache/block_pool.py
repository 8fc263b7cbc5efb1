"""The block pool: every KV block of the cache, their reference counts, and the prefix cache.

Design after vLLM's ``BlockPool`` (Kwon et al. 2023, "PagedAttention"): one pool of fixed-size
blocks shared by all requests and layers. A block's ``ref_cnt`` counts the requests using it.
Free blocks (``ref_cnt == 0``) wait in a doubly linked queue in the order they were freed; a
free block may still hold a cached prefix (it keeps its hash) and is evicted only when it is
taken for new data, least recently freed first. A cache hit on a free block takes it out of the
middle of the queue, which is why the queue is a linked list (O(1) removal).

Prefix cache: a *full* block is identified by a chained hash, ``hash((parent_hash, tokens))``,
so equal hashes mean equal prefixes up to and including this block; on a hit the tokens are
compared too, so a hash collision can never serve the wrong cache.
"""

from __future__ import annotations

from typing import Iterable


class KVCacheBlock:
    """One block of `block_size` token slots. `block_hash`/`token_ids` are set while it is cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front (least recently freed), append at
    the back, remove from anywhere, all O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, b: KVCacheBlock) -> None:
        last = self._tail.prev
        last.next, b.prev, b.next, self._tail.prev = b, last, self._tail, b
        self.num_free += 1

    def remove(self, b: KVCacheBlock) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        b = self._head.next
        if b is self._tail:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def block_ids(self) -> list[int]:
        """Free block ids, front (next to be taken) first. For tests and debugging."""
        out, b = [], self._head.next
        while b is not self._tail:
            out.append(b.block_id)
            b = b.next
        return out


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block: depends on every token of the prefix up to it."""
    return hash((parent_hash, token_ids))


class BlockPool:
    """`num_blocks` blocks with reference counts, a free queue and the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> block
        self.hits = 0  # prefix-cache lookups that found a block
        self.queries = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """The cached block for this hash whose tokens are `token_ids`, or None."""
        self.queries += 1
        b = self.cached.get(block_hash)
        if b is None or b.token_ids != token_ids:
            return None
        self.hits += 1
        return b

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` free blocks (evicting their cached prefixes), each with ``ref_cnt = 1``."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: KVCacheBlock) -> None:
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
            b.block_hash = b.token_ids = None

    def uncache_block(self, b: KVCacheBlock) -> None:
        """Take `b` out of the prefix cache (its contents must not be reused)."""
        self._evict(b)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One more request uses each of `blocks` (taking free ones out of the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One request fewer uses each of `blocks`; those no one uses join the free queue in the
        given order (so pass the blocks to evict first, first)."""
        for b in blocks:
            assert b.ref_cnt > 0, b
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): only while no request holds a
        block, else nothing changes and the answer is False."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = b.token_ids = None
        self.cached.clear()
        return True

    def cache_block(self, b: KVCacheBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Register full block `b` in the prefix cache (a no-op when caching is off or another
        block already caches the same prefix)."""
        if not self.enable_caching or b.block_hash is not None or block_hash in self.cached:
            return
        b.block_hash, b.token_ids = block_hash, token_ids
        self.cached[block_hash] = b
