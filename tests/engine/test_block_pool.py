"""Block pool and KV cache manager: exact block ids, reference counts, eviction order."""

from __future__ import annotations

from nextoken.kv_cache import block_pool
from nextoken.kv_cache.block_pool import BlockPool
from nextoken.kv_cache.manager import KVCacheManager, ring_blocks
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
    assert kv.share_prefix(parent, child, 9) == 9  # two full blocks shared, the third's token copied
    assert kv.block_ids("c") == [0, 1, 3] and kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[2].ref_cnt == 1
    assert kv.take_copies() == ([(2, 3)], []) and kv.take_copies() == ([], [])
    child.num_computed_tokens = 9
    assert kv.allocate_slots(child, 1) and kv.block_ids("c") == [0, 1, 3]  # its last token fits
    assert kv.allocate_slots(child, 4) and kv.block_ids("c") == [0, 1, 3, 4]
    kv.pool.get_new_blocks(kv.pool.num_free_blocks)  # no block free: the full blocks alone
    other = req("o", list(range(10)))
    assert kv.share_prefix(parent, other, 9) == 8 and kv.block_ids("o") == [0, 1] and kv.take_copies() == ([], [])


def run(kv: KVCacheManager, r: Request, n: int, computed=()) -> None:
    """Allocate `n` new tokens of `r` (after `computed`) and mark them computed and cached, as a step does."""
    assert kv.allocate_slots(r, n, computed)
    r.num_computed_tokens += len(computed) * kv.block_size + n
    kv.cache_full_blocks(r)


def sliding_kv(sliding_blocks: int, num_blocks: int = 60) -> KVCacheManager:
    """A manager for a model with sliding-window layers: blocks of 4 tokens, a window of 8
    (two blocks), rings of 3 slots (`ring_blocks(8, 4)`)."""
    assert ring_blocks(8, 4) == 3
    return KVCacheManager(num_blocks=num_blocks, block_size=4, sliding_blocks=sliding_blocks, ring_blocks=3,
                          sliding_window=8)


def held(kv: KVCacheManager, rid: str) -> dict[int, int]:
    """Logical block -> block id, for the logical blocks the request's ring holds."""
    ring = kv.rings[rid]
    return {b: ring.slots[b % 3].block_id for b in range(30) if ring.holds(b, 3)}


def after_cached(kv: KVCacheManager, n: int, more: list[int]):
    """A request of tokens 0..n-1 runs and ends; then a request of those tokens and `more`, and
    the cached blocks it finds."""
    a = req("a", list(range(n)))
    run(kv, a, n)
    kv.free(a)
    b = req("b", list(range(n)) + more)
    return b, kv.get_computed_blocks(b)


def test_a_sliding_window_prefix_is_a_hit_as_far_as_its_window_is_cached():
    """A request's full sliding blocks are cached under the same hashes as its full-attention
    blocks; a later request whose prefix reaches them takes the window's blocks and goes on
    from there; one whose prefix ends where the sliding pool lacks the window finds less."""
    kv = sliding_kv(9)
    a = req("a", list(range(30)))  # 7 full blocks and 2 tokens: its ring holds logical 5, 6, 7
    run(kv, a, 30)
    assert held(kv, "a").keys() == {5, 6, 7}
    a_blocks, full = held(kv, "a"), kv.block_ids("a")[:7]
    kv.free(a)
    assert kv.sliding_pool.num_free_blocks == 9  # free, and cached
    b = req("b", list(range(30)) + [77, 78])  # the next turn: a's tokens and more
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == full  # the window before block 7: blocks 5 and 6
    run(kv, b, 32 - 28, hits)
    assert held(kv, "b")[5] == a_blocks[5] and held(kv, "b")[6] == a_blocks[6]
    c = req("c", list(range(20)) + [5] * 12)  # a's first 5 blocks: the pass wrote them off the ring
    assert len(kv.get_computed_blocks(c)) == 5
    d = req("d", [9] + list(range(1, 30)))  # another first block
    assert kv.get_computed_blocks(d) == []
    kv = sliding_kv(3)  # no block to spare: the long pass kept its last 3 blocks only
    run(kv, req("a", list(range(30))), 30)
    assert kv.get_computed_blocks(c) == [] and len(kv.get_computed_blocks(b)) == 7


def test_a_shared_system_prompt_is_reused_by_a_request_that_only_begins_with_it():
    """A pass longer than the ring writes its early full blocks into blocks of their own
    (`off_ring`), cached; the blocks of a prompt's beginning stay cached while the request that
    wrote them goes on (its slots take new blocks past the window), so another request that
    only shares that beginning finds it, and reads those blocks without writing them."""
    kv = sliding_kv(12)
    system = list(range(100, 108))  # two blocks
    a = req("a", system + [1, 2, 3, 4, 5])  # 4 blocks: more than the ring's 3
    assert kv.allocate_slots(a, 13)
    assert list(kv.off_ring("a")) == [0]  # logical block 0, which the ring will not keep
    a.num_computed_tokens = 13
    kv.cache_full_blocks(a)
    first = [kv._sliding_block(a, 0).block_id, kv._sliding_block(a, 1).block_id]
    for t in range(12):  # a decodes on, past its window: its slots take new blocks
        a.append_output(50 + t)
        run(kv, a, 1)
    assert held(kv, "a").keys() == {4, 5, 6} and not set(held(kv, "a").values()) & set(first)
    b = req("b", system + [9, 9, 9])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2  # the system prompt's two blocks, and their sliding blocks
    run(kv, b, 3, hits)
    assert [held(kv, "b")[0], held(kv, "b")[1]] == first
    assert all(kv.sliding_pool.blocks[i].ref_cnt == 1 for i in first)  # b's alone (a gave them back, cached)


def test_a_pass_that_wraps_onto_a_cached_window_reads_it_and_writes_new_blocks():
    """A prefill chunk after a cached prefix whose slots come round to the window it reads:
    those logical blocks are read from the cached blocks (`off_ring`) and written into new
    ones, so the cache keeps them; they are given back at the request's next allocation."""
    kv = sliding_kv(12)
    b, hits = after_cached(kv, 20, list(range(40, 52)))  # 12 more tokens: logical 5, 6, 7
    assert len(hits) == 5  # and the window of logical 5: blocks 3, 4
    window = {3: kv._sliding_block(b, 3).block_id, 4: kv._sliding_block(b, 4).block_id}
    assert kv.allocate_slots(b, 12, hits)  # logical 5-7 take slots 2, 0, 1: those of 3 and 4, which it reads
    assert kv.off_ring("b") == window
    assert not set(kv.ring_ids("b")) & set(window.values())
    b.num_computed_tokens = 32
    kv.cache_full_blocks(b)
    kv.allocate_slots(b, 1)  # the next step: the window's blocks go back, still cached
    assert kv.off_ring("b") is None
    assert all(kv.sliding_pool.blocks[i].ref_cnt == 0 and kv.sliding_pool.blocks[i].block_hash is not None
               for i in window.values())
    c = req("c", list(range(20)) + [3])  # a's prefix is still whole
    assert len(kv.get_computed_blocks(c)) == 5


def test_without_a_spare_block_a_pass_rewrites_its_own_cached_window_in_place():
    """One ring's worth of blocks (`nextoken run`'s one sequence): the chunk that wraps onto
    the cached window it reads writes that block in place, and it leaves the cache."""
    kv = sliding_kv(3)
    b, hits = after_cached(kv, 12, list(range(40, 48)))
    assert len(hits) == 3  # the window of logical 3: blocks 1, 2
    one, two = kv._sliding_block(b, 1), kv._sliding_block(b, 2)
    assert kv.allocate_slots(b, 8, hits)  # logical 3, 4 take the slots of 0 (not read) and 1 (read)
    assert kv.off_ring("b") is None and kv.sliding_pool.num_free_blocks == 0
    assert kv.rings["b"].slots[1] is one and one.block_hash is None  # rewritten in place, uncached
    assert kv.rings["b"].slots[2] is two and two.block_hash is not None


def test_parked_blocks_give_way_least_recently_freed_first():
    kv = sliding_kv(6)
    a, b = req("a", list(range(12))), req("b", list(range(100, 112)))
    run(kv, a, 12)
    run(kv, b, 12)
    kv.free(a)
    kv.free(b)
    assert kv.sliding_pool.num_free_blocks == 6
    c = req("c", list(range(200, 212)))
    run(kv, c, 12)  # takes a's blocks (freed first)
    assert kv.get_computed_blocks(req("a2", list(range(12)) + [1])) == []
    assert len(kv.get_computed_blocks(req("b2", list(range(100, 112)) + [1]))) == 3  # b's still there


def test_a_failed_requests_sliding_blocks_leave_the_cache():
    kv = sliding_kv(9)
    a = req("a", list(range(12)))
    run(kv, a, 12)
    kv.uncache(a)  # non-finite logits: neither its blocks nor its sliding blocks are kept
    kv.free(a)
    assert kv.sliding_pool.num_free_blocks == 9 and not kv.sliding_pool.cached
    assert kv.get_computed_blocks(req("a2", list(range(12)) + [1])) == []


def test_a_long_pass_leaves_the_blocks_other_rings_may_need():
    """Off-ring blocks for a long pass's early blocks only come from what the other running
    requests' rings cannot need (their empty slots, and one each)."""
    kv = sliding_kv(8)
    x = req("x", [1, 2, 3])
    run(kv, x, 3)  # one slot of its three
    a = req("a", list(range(30)))  # blocks 0-4 would go off the ring: 5 more than its 3 slots
    assert kv.allocate_slots(a, 30)
    assert kv.off_ring("a") is None and kv.sliding_pool.num_free_blocks == 4
    x.append_output(4)
    for t in range(8):  # x grows to its three slots
        run(kv, x, 1)
        x.append_output(5 + t)
    assert len(kv.rings["x"].slots) == 3
    kv = sliding_kv(12)
    run(kv, x := req("x", [1, 2, 3]), 3)
    assert kv.allocate_slots(a, 30) and list(kv.off_ring("a")) == [0, 1, 2, 3, 4]  # 12 - 1 - 3 - 5 = 3 left for x


def test_a_pass_longer_than_the_ring_after_a_cached_prefix_reads_the_blocks_it_took():
    """The slots a long pass reassigns hold the logical blocks the ring took from the cache (3
    and 4 here), not the ones ``ring_blocks`` before the new ones: those are what it reads."""
    kv = sliding_kv(12)
    b, hits = after_cached(kv, 20, list(range(40, 60)))
    assert len(hits) == 5
    window = {3: kv._sliding_block(b, 3).block_id, 4: kv._sliding_block(b, 4).block_id}
    assert kv.allocate_slots(b, 20, hits)  # logical 5-9: 7, 8, 9 take slots 1, 2, 0; 5 and 6 go off the ring
    off = kv.off_ring("b")
    assert {k: off[k] for k in (3, 4)} == window and sorted(off) == [3, 4, 5, 6]


def test_an_ending_requests_part_filled_block_is_copied_by_one_that_goes_on():
    """A request's last, part-filled block stays cached when it ends, under its tokens after the
    full blocks' chained hash; a request that goes on from those tokens (a beam's next step)
    finds it after its full blocks and copies it; a request that differs in it, one under an
    adapter, one that would reuse fewer tokens than it holds (keys are exact) and the
    full-block lookup do not; a request
    taken out of the cache (`uncache`: non-finite outputs) leaves no part-filled block."""
    from nextoken.engine.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(num_blocks=12, block_size=4)
    a = req("a", list(range(10)))  # blocks [0-3] [4-7] [8 9 _ _]
    run(kv, a, 10)
    last = kv.block_tables["a"][2]
    kv.free(a)
    assert last.token_ids == (8, 9) and last.ref_cnt == 0  # cached, free, evictable
    b = req("b", list(range(11)))
    full = kv.get_computed_blocks(b)
    assert len(full) == 2 and kv.get_partial_block(b, 2) == (last, 2, None)
    assert kv.get_partial_block(req("c", list(range(9)) + [99, 5]), 2) is None  # differs at 9
    assert kv.get_partial_block(req("d", list(range(10))), 2) is None  # it may reuse 1 token: the block holds 2
    assert kv.get_partial_block(req("e", list(range(10)) + [7, 7, 7]), 2) == (last, 2, None)
    lora = Request("l", list(range(11)), SamplingParams(), DrawGenerator(), lora_id=1)
    assert kv.get_partial_block(lora, len(kv.get_computed_blocks(lora))) is None
    assert kv.get_computed_blocks(req("f", list(range(10)) + [0, 0, 0])) == full  # never a full block

    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64), kv)
    s.add(b)
    plan = s.schedule()
    assert plan.scheduled == {b: 1} and b.num_computed_tokens == 10  # one token computed, not three
    assert plan.block_copies == [(last.block_id, kv.block_ids("b")[2])]
    assert kv.block_ids("b")[:2] == [x.block_id for x in full]
    assert s.prefix_cache_hits == 10

    b.num_computed_tokens += 1
    kv.uncache(b)
    s.finish(b)
    assert kv.get_partial_block(req("g", list(range(11)) + [1]), 2) == (last, 2, None)  # a's, not b's 3 tokens


def test_block_copies_run_in_order_on_every_part_of_the_cache():
    """`PagedKVCache.copy_blocks` copies keys, values and (int8 cache) their scales of every
    layer and head, as pair by pair in order: a later pair reads what an earlier one wrote, a
    later write wins (it copies runs of pairs at once: `copy_waves`); random pair lists with
    chains and repeated blocks against the plain loop."""
    import random
    import torch

    from nextoken.config import ModelConfig
    from nextoken.kv_cache.tensors import PagedKVCache

    cfg = ModelConfig("llama", "t", 10, 64, 128, 3, 4, 2, 16, 64, 1e-6, 1e4, 16, False)
    for cache_dtype in ("auto", "int8"):
        kv = PagedKVCache(cfg, 5, 4, torch.float32, cache_dtype=cache_dtype)
        g = torch.Generator().manual_seed(0)
        parts = [t for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]
        for t in parts:
            t.copy_(torch.randint(-100, 100, t.shape, generator=g).to(t.dtype))
        before = [t.clone() for t in parts]
        kv.copy_blocks([(1, 3), (3, 0), (4, 1)])
        for t, old in zip(parts, before):
            want = old.clone()
            want[:, :, 3], want[:, :, 0], want[:, :, 1] = old[:, :, 1], old[:, :, 1], old[:, :, 4]
            assert torch.equal(t, want), cache_dtype
        assert len(parts) == (4 if cache_dtype == "int8" else 2)
        rng = random.Random(cache_dtype)
        for _ in range(20):
            pairs = [(rng.randrange(5), rng.randrange(5)) for _ in range(rng.randrange(1, 7))]
            want = [t.clone() for t in parts]
            for src, dst in pairs:
                for t in want:
                    t[:, :, dst] = t[:, :, src].clone()
            kv.copy_blocks(pairs)
            assert all(torch.equal(t, w) for t, w in zip(parts, want)), pairs
