"""Block pool and KV cache manager: exact block ids, reference counts, eviction order."""

from __future__ import annotations

from nextoken.kv_cache import block_pool
from nextoken.kv_cache.block_pool import BlockPool
from nextoken.kv_cache.manager import KVCacheManager
from nextoken.engine.request import Request
from nextoken.sample.rng import DrawGenerator
from nextoken.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), DrawGenerator())


def test_new_blocks_come_from_the_front_and_return_to_the_back():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert [x.block_id for x in a] == [0, 1] and [x.block_id for x in b] == [2, 3, 4]
    assert all(x.ref_cnt == 1 for x in a + b) and pool.num_free_blocks == 1
    pool.free_blocks([b[2], b[0]])
    assert pool.free_queue.block_ids() == [5, 4, 2]
    pool.touch([b[0]])  # taken back out of the middle of the free queue
    assert pool.free_queue.block_ids() == [5, 4] and b[0].ref_cnt == 1
    pool.touch([a[0]])
    assert a[0].ref_cnt == 2
    pool.free_blocks([a[0]])
    assert a[0].ref_cnt == 1 and 0 not in pool.free_queue.block_ids()


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i, (i,))
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])  # freed in this order
    assert pool.get_cached_block(101, (1,)) is blocks[1]
    taken = pool.get_new_blocks(1)[0]  # evicts the least recently freed: block 1
    assert taken is blocks[1] and pool.get_cached_block(101, (1,)) is None
    assert pool.get_cached_block(100, (0,)) is blocks[0] and pool.get_cached_block(102, (2,)) is blocks[2]
    assert pool.get_new_blocks(1)[0] is blocks[0]


def test_a_hash_collision_never_serves_the_wrong_tokens():
    pool = BlockPool(2)
    b = pool.get_new_blocks(1)[0]
    pool.cache_block(b, 7, (1, 2, 3))
    assert pool.get_cached_block(7, (1, 2, 4)) is None
    assert pool.get_cached_block(7, (1, 2, 3)) is b


def test_prefix_hits_follow_the_chain(monkeypatch):
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    assert kv.get_computed_blocks(a) == []
    assert kv.allocate_slots(a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)  # two full blocks are cached, the partial one is not
    b = req("b", list(range(8)) + [99, 98, 97])
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b") == [0, 1, 3] and [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    c = req("c", [0, 1, 2, 3, 9, 9, 9, 9, 9])  # same first block, different second
    assert [h.block_id for h in kv.get_computed_blocks(c)] == [0]
    # at least one token is always computed: a prompt of exactly the cached blocks hits one fewer
    d = req("d", list(range(8)))
    assert [h.block_id for h in kv.get_computed_blocks(d)] == [0]
    # with a colliding hash function, the token comparison still prevents a wrong hit
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, toks: 1)
    e = req("e", [5, 5, 5, 5, 5])
    assert kv.get_computed_blocks(e) == []


def test_free_returns_every_block_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(12)))
    kv.allocate_slots(a, 12)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_allocation_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = req("a", list(range(8))), req("b", list(range(50, 58)))
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)
    assert kv.block_ids("b") == [] and kv.pool.num_free_blocks == 1


def test_share_prefix_for_parallel_sampling():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = req("p", list(range(10)))
    kv.allocate_slots(parent, 10)
    child = req("c", list(range(10)))
    assert kv.share_prefix(parent, child, 9) == 8  # two full blocks shared
    assert kv.block_ids("c") == [0, 1] and kv.pool.blocks[0].ref_cnt == 2
    child.num_computed_tokens = 8
    assert kv.allocate_slots(child, 2)
    assert kv.block_ids("c") == [0, 1, 3]


def run(kv: KVCacheManager, r: Request, n: int, computed=()) -> None:
    """Allocate `n` new tokens of `r` (after `computed`) and mark them computed and cached, as a step does."""
    assert kv.allocate_slots(r, n, computed)
    r.num_computed_tokens += len(computed) * kv.block_size + n
    kv.cache_full_blocks(r)


def test_a_sliding_window_models_ring_is_parked_and_taken_over_with_its_prefix():
    """An ended request's ring waits under the hash of its last full block; a request whose
    cached prefix reaches that block takes the ring and goes on from there (its full-attention
    blocks from the prefix cache); one whose prefix stops short of it, or differs, finds no
    prefix (its sliding layers would lack the window's keys)."""
    kv = KVCacheManager(num_blocks=40, block_size=4, sliding_blocks=9, ring_blocks=3)
    a = req("a", list(range(30)))  # 7 full blocks and 2 tokens
    assert kv.get_computed_blocks(a) == []
    run(kv, a, 30)
    ring, full = kv.ring_ids("a"), kv.block_ids("a")[:7]
    assert len(ring) == 3 and kv.sliding_pool.num_free_blocks == 6
    kv.free(a)
    assert list(kv.parked.values())[0] and kv.sliding_pool.num_free_blocks == 6  # parked, not freed
    b = req("b", list(range(30)) + [77, 78])  # the next turn: a's tokens and more
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == full
    run(kv, b, 32 - 28, hits)
    assert kv.ring_ids("b") == ring and not kv.parked  # the same ring, taken over
    c = req("c", list(range(20)) + [5] * 12)  # a's first 5 blocks only: no ring parked there
    assert kv.get_computed_blocks(c) == []
    d = req("d", [9] + list(range(1, 30)))  # another first block
    assert kv.get_computed_blocks(d) == []


def test_parked_rings_give_way_to_running_requests_oldest_first():
    kv = KVCacheManager(num_blocks=60, block_size=4, sliding_blocks=6, ring_blocks=3)
    a, b = req("a", list(range(12))), req("b", list(range(100, 112)))
    run(kv, a, 12)
    run(kv, b, 12)
    kv.free(a)
    kv.free(b)
    assert len(kv.parked) == 2 and kv.sliding_pool.num_free_blocks == 0
    c = req("c", list(range(200, 212)))
    run(kv, c, 12)  # takes a's ring blocks (parked first)
    assert len(kv.parked) == 1 and kv.get_computed_blocks(req("a2", list(range(12)) + [1])) == []
    assert len(kv.get_computed_blocks(req("b2", list(range(100, 112)) + [1]))) == 3  # b's still there


def test_a_ring_is_not_parked_for_a_failed_request_or_a_partial_block():
    kv = KVCacheManager(num_blocks=40, block_size=4, sliding_blocks=9, ring_blocks=3)
    a = req("a", list(range(12)))
    run(kv, a, 12)
    kv.uncache(a)  # non-finite logits: neither its blocks nor its ring are kept
    kv.free(a)
    assert not kv.parked and kv.sliding_pool.num_free_blocks == 9
    b = req("b", [1, 2, 3])  # no full block: nothing to park under
    run(kv, b, 3)
    kv.free(b)
    assert not kv.parked and kv.sliding_pool.num_free_blocks == 9
