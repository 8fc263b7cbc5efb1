"""Block tables: which blocks hold which request's tokens, and how they are allocated.

Token position ``p`` of a request lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its *slot* in the whole cache is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from nextoken.kv_cache.block_pool import BlockPool, KVCacheBlock, hash_block
from nextoken.kv_cache.disk import chain_key, salted_root


def ring_blocks(window: int, block_size: int, max_decode_rows: int = 1) -> int:
    """Blocks a sliding-window layer's ring needs per sequence: the `window` - 1 keys before a
    pass's first decode row, plus the `max_decode_rows` (1 + drafted tokens) that pass writes,
    spread over at most one more block than they fill. (A prefill chunk reads the keys before
    it first, then writes only its last ``ring_blocks * block_size`` tokens.)"""
    return -(-(window - 1 + max_decode_rows) // block_size) + 1


@dataclass
class Ring:
    """One request's blocks for the sliding-window layers, `ring_blocks` slots at most: logical
    block b is written into ``slots[b % ring_blocks]``, which holds it for ``max(lo, mapped -
    ring_blocks) <= b < mapped`` (`holds`). mapped: logical blocks given a slot so far; lo: the
    first one it holds (a request that began from a cached prefix: the window before it; the
    slots below hold blocks not yet written). off_ring: this step's blocks outside the slots
    (logical block -> block): cached ones its pass still reads whose slot a later logical block
    took, and, where the pool has blocks to spare (beyond what the other rings may need), new
    ones for the full blocks its pass writes that the ring does not keep (so that they are
    cached too); given back at the request's next allocation, when that pass is done (on a GPU,
    queued before the next)."""

    slots: list[KVCacheBlock]
    mapped: int = 0
    lo: int = 0
    off_ring: dict[int, KVCacheBlock] = field(default_factory=dict)

    def holds(self, b: int, ring_blocks: int) -> bool:
        return max(self.lo, self.mapped - ring_blocks) <= b < self.mapped

    def held(self, ring_blocks: int) -> dict[int, int]:
        """Slot -> the logical block it holds, oldest logical block first (slots absent: none)."""
        return {j % ring_blocks: j for j in range(max(self.lo, self.mapped - ring_blocks), self.mapped)}

    def blocks(self, ring_blocks: int) -> list[KVCacheBlock]:
        """Every block it holds, in the order to evict them: slots that hold no logical block
        first, then the others, oldest logical block first."""
        held = self.held(ring_blocks)
        return [b for s, b in enumerate(self.slots) if s not in held] + \
            [self.off_ring[b] for b in sorted(self.off_ring)] + [self.slots[s] for s in held]


def chain_root(req) -> tuple | None:
    """Where the request's chain of prefix-cache keys starts: None for a plain request; its LoRA
    adapter's and its cache salt's (vLLM's ``cache_salt``) otherwise, so that an adapter's keys
    and values, and a salted request's blocks, serve only requests of the same adapter and salt."""
    if not req.lora_id and req.cache_salt is None:
        return None
    return ("lora", req.lora_id, "salt", req.cache_salt)


def _unshared(b: KVCacheBlock) -> bool:
    """Whether only its request holds `b` and it is not cached (a part-filled block may be kept)."""
    return b.ref_cnt == 1 and b.block_hash is None


class PartialBlock(NamedTuple):
    """A cached part-filled block (`KVCacheManager.get_partial_block`): the block, how many of
    the request's tokens it holds, and (a model with sliding-window layers) the sliding pool's
    block of the same tokens."""

    block: KVCacheBlock
    num_tokens: int
    sliding: KVCacheBlock | None = None


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

    With `sliding_blocks` (a model with sliding-window layers), each request also owns a `Ring`
    of up to `ring_blocks` blocks from a second pool for those layers (`kv_cache.tensors`):
    logical block b is written into slot ``b % ring_blocks``, so the ring keeps the last window.
    Those blocks are paged as vLLM's hybrid cache pages a sliding layer's: a full block is cached
    under the same chained hash as the full-attention block of the same tokens, and a slot whose
    block is cached (or shared) gets a new block when a later logical block needs it, the old
    one joining the free queue with its hash (or, when this pass still reads it, after the pass:
    `Ring.off_ring`; a long pass's full blocks that the ring does not keep get blocks there too,
    when the pool has them to spare). A prefix is then a hit as far as the sliding pool also
    holds the blocks of the window before its end (`get_computed_blocks`): the next turn of a
    conversation, a shared system prompt, a preempted request. A slot whose block is unshared and uncached is rewritten
    in place, as is a cached one this pass reads when the pool has no block to spare (it leaves
    the cache). The disk tier keeps their part of a block in a namespace of its own
    (`kv_cache.disk.DiskTier`). Copy-free prefix sharing (`share_prefix`) stays off for such a
    model (its prefix comes from the cache).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_blocks: int = 0, ring_blocks: int = 0, sliding_window: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, self.enable_caching)
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # each table's block ids, kept beside it (read every step)
        self._num_cached: dict[str, int] = {}  # blocks of each request registered in the cache
        if sliding_blocks and not (ring_blocks and sliding_window):
            raise ValueError("a sliding-window pool needs ring_blocks and sliding_window")
        self.ring_blocks, self.window = ring_blocks, sliding_window
        self.sliding_pool = BlockPool(sliding_blocks, self.enable_caching) if sliding_blocks else None
        self.rings: dict[str, Ring] = {}
        self.disk = None  # the prefix cache's disk tier (`kv_cache.disk.DiskTier`), if any
        self.disk_queries = self.disk_hits = 0  # prompt tokens looked up on disk, and found there
        # (source, destination) block ids whose contents the next pass copies first (`take_copies`):
        # of the paged cache, and of the sliding pool
        self.copies: list[tuple[int, int]] = []
        self.sliding_copies: list[tuple[int, int]] = []
        self._tainted: set[str] = set()  # requests `uncache`d: their part-filled block is not cached either

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order: the manager's own list, grown as blocks are added
        (read it within the step; copy it to keep it)."""
        return self._block_ids.get(request_id, [])

    def ring_ids(self, request_id: str) -> list[int] | None:
        """The request's sliding-window ring blocks, slot by slot (None for a model without such
        layers): where its pass reads and writes, but for `off_ring`'s logical blocks."""
        if self.sliding_pool is None:
            return None
        ring = self.rings.get(request_id)
        return [b.block_id for b in ring.slots] if ring is not None else []

    def off_ring(self, request_id: str) -> dict[int, int] | None:
        """Where the request's pass reads or writes logical blocks outside its ring's slots
        (logical block -> block id; `Ring.off_ring`), or None."""
        ring = self.rings.get(request_id)
        return {b: blk.block_id for b, blk in ring.off_ring.items()} if ring is not None and ring.off_ring else None

    def _window_start(self, position: int) -> int:
        """The first logical block a token at `position` attends to in a sliding-window layer."""
        return max(0, position - self.window + 1) // self.block_size

    def _sliding_block(self, req, i: int) -> KVCacheBlock | None:
        """The sliding pool's cached block for the request's full block `i` (its hash computed:
        `_block_hashes`), or None."""
        bs = self.block_size
        return self.sliding_pool.get_cached_block(req.block_hashes[i], tuple(req.all_token_ids[i * bs : (i + 1) * bs]))

    def _sliding_hit(self, req, k: int) -> int:
        """The most of the first `k` blocks that a request may take from the cache: as many as
        the sliding pool also holds the window before (the blocks from `_window_start`), the
        window of all `k` read back from the disk tier where it has them."""
        best = run = 0
        self._block_hashes(req, k)
        disk = self.disk is not None and not req.lora_id
        lo, loading = self._window_start(k * self.block_size), []
        for i in range(k):
            b = self._sliding_block(req, i)
            if b is None and disk and i >= lo:
                b = self._load_sliding(req, i)
            if b is not None and disk:  # in use while later blocks load, so no load takes it
                self.sliding_pool.touch([b])
                loading.append(b)
            run = run + 1 if b is not None else 0
            if run >= i + 1 - self._window_start((i + 1) * self.block_size):
                best = i + 1
        self.sliding_pool.free_blocks(loading)
        return best

    def _block_hashes(self, req, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first `num_blocks` full blocks (memoised on it)."""
        hashes, bs, toks = req.block_hashes, self.block_size, req.all_token_ids
        root = chain_root(req)
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else root, tuple(toks[i * bs : (i + 1) * bs])))
        return hashes[:num_blocks]

    def _disk_keys(self, req, num_blocks: int) -> list[bytes]:
        """The disk tier's chain keys of the request's first `num_blocks` full blocks (memoised)."""
        keys, bs, toks, ns = req.disk_keys, self.block_size, req.all_token_ids, self.disk.store.namespace
        first = salted_root(ns, req.cache_salt) if req.cache_salt is not None else None
        while len(keys) < num_blocks:
            i = len(keys)
            keys.append(chain_key(ns, keys[-1] if keys else first, toks[i * bs : (i + 1) * bs]))
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
        if self.sliding_pool is not None:  # as far as the sliding layers' window is cached too
            hits = hits[: self._sliding_hit(req, len(hits))]
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

    def _load_sliding(self, req, i: int) -> KVCacheBlock | None:
        """The sliding-window layers' part of block `i` of `req` read from the disk tier into a
        free block of their pool (then cached, unused), or None (as `_load_block`)."""
        if self.sliding_pool.num_free_blocks < 2:
            return None
        bs = self.block_size
        toks = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
        payload = self.disk.fetch(self._disk_keys(req, i + 1)[i], toks, sliding=True)
        if payload is None:
            return None
        s = self.sliding_pool.get_new_blocks(1)[0]
        self.disk.fill(s.block_id, payload, sliding=True)
        self.sliding_pool.cache_block(s, req.block_hashes[i], toks)
        self.sliding_pool.free_blocks([s])
        return s

    def disk_stats(self) -> DiskStats:
        """The disk tier's counts (zeros without one): prompt tokens looked up on disk and found
        there, and the store's blocks and bytes (`DiskKVStore.stats`)."""
        stores = self.disk.stores if self.disk is not None else []
        return DiskStats(self.disk_queries, self.disk_hits, **{k: sum(s.stats[k] for s in stores) for k in
                                                                 (stores[0].stats if stores else {})})

    def allocate_slots(self, req, num_new_tokens: int, computed: list[KVCacheBlock] = ()) -> bool:
        """Give `req` the blocks for `num_new_tokens` more tokens after its computed ones (and
        the cached blocks `computed`, when it is being admitted). False, changing nothing, when
        too few blocks are free."""
        table = self.block_tables.setdefault(req.request_id, [])
        start = req.num_computed_tokens + len(computed) * self.block_size
        total = start + num_new_tokens
        if not computed and total <= len(table) * self.block_size and self._ring_has_room(req):
            return True  # (most decodes: the last block has room)
        need = self.blocks_for(total) - len(table) - len(computed)
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)  # free now, but about to be used
        short = need > self.pool.num_free_blocks - reclaimed
        if short or (self.sliding_pool is not None and not self._grow_ring(req, len(computed), start, total)):
            if not table:
                del self.block_tables[req.request_id]
            return False
        self.pool.touch(computed)
        new = [*computed, *self.pool.get_new_blocks(need)] if need > 0 else list(computed)
        table.extend(new)
        self._block_ids.setdefault(req.request_id, []).extend(b.block_id for b in new)
        return True

    def _ring_has_room(self, req) -> bool:
        """Whether the request's ring needs nothing for a pass within its block table: every
        logical block there has its slot, and no block outside them is left to give back."""
        if self.sliding_pool is None:
            return True
        ring = self.rings.get(req.request_id)
        return ring is not None and not ring.off_ring and ring.mapped >= len(self.block_tables[req.request_id])

    def _ring_reserve(self, req) -> int:
        """Blocks the other requests' rings may still need: their empty slots, and one each for
        a slot whose block is shared (it takes a new one when its next logical block comes)."""
        R = self.ring_blocks
        return sum(R - len(r.slots) + 1 for rid, r in self.rings.items() if rid != req.request_id)

    def _grow_ring(self, req, k: int, start: int, total: int) -> bool:
        """Give the request's ring slots for its logical blocks up to `total` tokens, this pass
        writing from `start` (after `k` cached blocks, when it is being admitted: the ring then
        begins with the sliding pool's blocks of the window before them). False when the sliding
        pool lacks blocks, changing nothing but giving the last pass's off-ring blocks back."""
        pool = self.sliding_pool
        ring, take = self.rings.get(req.request_id), []
        if ring is not None and self._next_block(ring, start, self.blocks_for(total)):
            return True
        if ring is not None and ring.off_ring:  # the last pass's, which is done (or queued first)
            pool.free_blocks([ring.off_ring[b] for b in sorted(ring.off_ring)])
            ring.off_ring = {}
        if ring is None:
            ring, take = self._ring_from_cache(req, k)
            if ring is None:
                return False
        nb = self.blocks_for(total)
        taken = {id(b) for b in take}
        slots, release, reads = self._reslot(ring, taken, start, nb)
        spare = pool.num_free_blocks - sum(1 for b in take if b.ref_cnt == 0) + \
            sum(1 for b in release if b.ref_cnt + (id(b) in taken) == 1)
        rewritten = []
        for b, old in list(reads.items()):  # too few blocks: its own cached ones it reads are rewritten in place
            if slots.count(None) <= spare:
                break
            if old.ref_cnt + (id(old) in taken) == 1:
                slots[b % self.ring_blocks] = old
                rewritten.append(reads.pop(b))
        if slots.count(None) > spare:
            return False
        pool.touch(take)  # (before `release`, which may give some back)
        for b in rewritten:
            pool.uncache_block(b)
        pool.free_blocks(release)
        new = iter(pool.get_new_blocks(slots.count(None)))
        ring.slots = [b if b is not None else next(new) for b in slots]
        written = range(-(-start // self.block_size), nb - self.ring_blocks)  # full blocks the ring will not keep
        if self.enable_caching and 0 < len(written) <= pool.num_free_blocks - self._ring_reserve(req):
            reads.update(zip(written, pool.get_new_blocks(len(written))))
        ring.mapped, ring.off_ring = max(ring.mapped, nb), reads
        self.rings[req.request_id] = ring
        return True

    def _next_block(self, ring: Ring, start: int, nb: int) -> bool:
        """The common case of `_grow_ring` (a decode reaching a new block, its ring full and
        nothing off it), done at once: the slot's block, which this pass does not read, is
        rewritten in place or given back for a new one. False: not that case, or no block."""
        R, pool = self.ring_blocks, self.sliding_pool
        if ring.off_ring or nb != ring.mapped + 1 or len(ring.slots) != R:
            return False
        b = ring.mapped
        old = ring.slots[b % R]
        if old.ref_cnt == 1 and old.block_hash is None:
            ring.mapped = nb
            return True
        if b - R >= self._window_start(start) or (old.ref_cnt > 1 and pool.num_free_blocks == 0):
            return False
        pool.free_blocks([old])
        ring.slots[b % R] = pool.get_new_blocks(1)[0]
        ring.mapped = nb
        return True

    def _ring_from_cache(self, req, k: int) -> tuple[Ring | None, list[KVCacheBlock]]:
        """A new ring for a request admitted after `k` cached blocks, its slots holding the
        sliding pool's cached blocks of the window before them (the others empty, None), and
        those blocks; (None, []) when one is no longer cached."""
        R = self.ring_blocks
        lo = self._window_start(k * self.block_size) if k else 0
        self._block_hashes(req, k)
        take = [self._sliding_block(req, i) for i in range(lo, k)]
        if None in take:  # (evicted since the lookup)
            return None, []
        ring = Ring([None] * min(R, k), k, lo)
        for i, b in zip(range(lo, k), take):
            ring.slots[i % R] = b
        return ring, take

    def _reslot(self, ring: Ring, taken: set[int], start: int, nb: int):
        """The ring's slots once its logical blocks reach `nb`, for a pass from `start`: the
        last `ring_blocks` of them take their slots (a longer pass writes its earlier ones
        nowhere, or off the ring), rewriting the block there in place when only this request
        holds it and it is not cached, else leaving the slot empty (None) for a new block. The
        old blocks this pass reads (its window before `start`) come back as `reads` (the logical
        block they hold -> block), the others as `release`. `taken`: the ids of blocks this call
        takes from the cache (one reference more than they show)."""
        R, bs = self.ring_blocks, self.block_size
        slots = list(ring.slots) + [None] * (min(R, nb) - len(ring.slots))
        held = ring.held(R)
        read = range(self._window_start(start), -(-start // bs))
        release, reads = [], {}
        for b in range(max(ring.mapped, nb - R), nb):
            old = slots[b % R]
            if old is None:
                continue
            if old.ref_cnt + (id(old) in taken) == 1 and old.block_hash is None:
                continue  # rewritten in place
            slots[b % R] = None
            if held.get(b % R) in read:
                reads[held[b % R]] = old
            else:
                release.append(old)
        return slots, release, reads

    def share_prefix(self, parent, child, num_tokens: int) -> int:
        """Let `child` use the parent's blocks for its first `num_tokens` tokens: the full
        blocks shared (copy-free: the child writes its own tokens into new blocks), and the
        part-filled block after them copied into a new block of the child's (`copies`), when one
        is free. Returns the number of tokens the child has so (none for a model with
        sliding-window layers)."""
        if self.sliding_pool is not None:
            return 0
        n, k = divmod(num_tokens, self.block_size)
        table = self.block_tables[parent.request_id]
        shared = table[:n]
        self.pool.touch(shared)
        self.block_tables[child.request_id] = list(shared)
        self._block_ids[child.request_id] = [b.block_id for b in shared]
        child.block_hashes[:] = parent.block_hashes[:n]
        if not k or len(table) <= n or not self.pool.num_free_blocks:
            return n * self.block_size
        self._copy_into_new(child, table[n])
        return num_tokens

    # -- part-filled blocks: kept when a request ends, copied for a request that goes on -----
    def _copy_into_new(self, req, src: KVCacheBlock) -> None:
        """Append a new block to the request's table, to be filled from `src` by the next pass
        before it writes anything (`copies`, run in order: a block another copy reads is never
        taken as a destination before that copy runs, since it is cached or held until then)."""
        dst = self.pool.get_new_blocks(1)[0]
        self.block_tables[req.request_id].append(dst)
        self._block_ids[req.request_id].append(dst.block_id)
        self.copies.append((src.block_id, dst.block_id))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The block copies this step's scheduling recorded, (source, destination) block ids in
        the order to run them: the paged cache's and the sliding pool's; and forget them."""
        copies, sliding, self.copies, self.sliding_copies = self.copies, self.sliding_copies, [], []
        return copies, sliding

    def _partial_key(self, req, num_full: int, token_ids: tuple[int, ...]) -> int:
        """The prefix cache's key of a block holding `token_ids` (fewer than a block's) after the
        request's first `num_full` full blocks: chained to theirs as a full block's is. Its token
        tuple is shorter than any full block's, so the two kinds never serve each other."""
        return hash_block(self._block_hashes(req, num_full)[-1] if num_full else chain_root(req), token_ids)

    def _cache_partial(self, req, table: list[KVCacheBlock], ring: Ring | None) -> None:
        """Keep an ending request's part-filled last block in the prefix cache (evictable, as a
        full block), under the tokens it holds, and for a model with sliding-window layers its
        ring's block of them in the sliding pool's: a request that goes on from them (the next
        step of a beam search, a preempted request, the next turn) copies them instead of
        computing those tokens again (`get_partial_block`)."""
        if not self.enable_caching:
            return
        bs = self.block_size
        n_full, k = divmod(req.num_computed_tokens, bs)
        if not k or len(table) <= n_full or not _unshared(table[n_full]):
            return
        ring_block = None
        if self.sliding_pool is not None:
            if ring is None or not ring.holds(n_full, self.ring_blocks):
                return
            ring_block = ring.slots[n_full % self.ring_blocks]
            if not _unshared(ring_block):
                return
        toks = tuple(req.all_token_ids[n_full * bs : n_full * bs + k])
        if len(toks) == k:
            key = self._partial_key(req, n_full, toks)
            self.pool.cache_block(table[n_full], key, toks)
            if ring_block is not None:
                self.sliding_pool.cache_block(ring_block, key, toks)

    def get_partial_block(self, req, num_full: int) -> PartialBlock | None:
        """After the request's first `num_full` blocks (found cached): the cached part-filled
        block that holds the most of its next tokens (at most all but its last token, whose
        logits are needed), or None. Lookups of up to block_size - 1 keys. A model with
        sliding-window layers needs the sliding pool's block of the same tokens too, and a pass
        its ring keeps that block through (its other blocks: at most `ring_blocks` - 1)."""
        if not self.enable_caching:
            return None
        bs, toks = self.block_size, req.all_token_ids
        lo = num_full * bs
        if self.sliding_pool is not None and self.blocks_for(req.num_tokens) > num_full + self.ring_blocks:
            return None
        for k in range(min(bs - 1, req.num_tokens - 1 - lo), 0, -1):
            t = tuple(toks[lo : lo + k])
            key = self._partial_key(req, num_full, t)
            b = self.pool.cached.get(key)
            s = self.sliding_pool.cached.get(key) if self.sliding_pool is not None else None
            sliding_ok = self.sliding_pool is None or (s is not None and s.token_ids == t)
            if b is not None and b.token_ids == t and sliding_ok:
                return PartialBlock(b, k, s)
        return None

    def copy_partial(self, req, hit: PartialBlock, index: int) -> None:
        """The request was just given blocks (`allocate_slots`): its block `index` (the first
        after its cached full ones), and its ring's block for it, are to hold `hit`'s tokens
        too, copied before the next pass."""
        self.copies.append((hit.block.block_id, self.block_tables[req.request_id][index].block_id))
        if hit.sliding is not None:
            ring = self.rings[req.request_id]
            assert ring.holds(index, self.ring_blocks), (index, ring)
            self.sliding_copies.append((hit.sliding.block_id, ring.slots[index % self.ring_blocks].block_id))

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
        ring = self.rings.get(req.request_id)
        for i in range(start, n_full):
            toks = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            self.pool.cache_block(table[i], hashes[i], toks)
            blk = None
            if ring is not None:  # its sliding layers' keys too, where a block holds them
                blk = ring.slots[i % self.ring_blocks] if ring.holds(i, self.ring_blocks) else ring.off_ring.get(i)
                if blk is not None:
                    self.sliding_pool.cache_block(blk, hashes[i], toks)
            if keys is not None:  # copied now, written by the disk tier's thread
                self.disk.offer(keys[i], toks, table[i].block_id, blk.block_id if blk is not None else None)
        self._num_cached[req.request_id] = n_full

    def uncache(self, req) -> None:
        """Take out of the prefix cache the blocks only `req` holds (call before `free`): a pass
        that produced non-finite logits may have written non-finite keys and values, which no
        later prompt with the same prefix should reuse. Blocks other requests share stay."""
        self._tainted.add(req.request_id)
        for i, b in enumerate(self.block_tables.get(req.request_id, [])):
            if b.ref_cnt == 1:
                self.pool.uncache_block(b)
                if self.disk is not None and i < len(req.disk_keys):
                    for store in self.disk.stores:
                        store.discard(req.disk_keys[i])
        ring = self.rings.pop(req.request_id, None)
        if ring is not None:  # its sliding layers' blocks too
            blocks = ring.blocks(self.ring_blocks)
            for b in blocks:
                if b.ref_cnt == 1:
                    self.sliding_pool.uncache_block(b)
            self.sliding_pool.free_blocks(blocks)

    def free(self, req) -> None:
        """Release the request's blocks; the tail is freed first so it is evicted first."""
        table = self.block_tables.pop(req.request_id, [])
        self._block_ids.pop(req.request_id, None)
        ring = self.rings.pop(req.request_id, None)
        if req.request_id in self._tainted:
            self._tainted.discard(req.request_id)
        else:
            self._cache_partial(req, table, ring)
        if ring is not None:  # (its cached blocks stay in the sliding pool's cache)
            self.sliding_pool.free_blocks(ring.blocks(self.ring_blocks))
        self._num_cached.pop(req.request_id, None)
        self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget the prefixes cached in memory, full and part-filled blocks of both pools, so that
        the next prompts are computed in full: only while no request holds blocks (False, and
        nothing changed, otherwise). The disk tier keeps its blocks."""
        if self.block_tables or self.rings:
            return False
        pools = [self.pool] + ([self.sliding_pool] if self.sliding_pool is not None else [])
        return all([p.reset_prefix_cache() for p in pools])

    def close(self) -> None:
        """Wait for the disk tier's queued blocks to be written (nothing to do without one)."""
        if self.disk is not None:
            for store in self.disk.stores:
                store.flush()
