"""The scheduler with a fake model runner: budgets, chunking, preemption, aborts."""

from __future__ import annotations

from nextoken.config import SchedulerConfig
from nextoken.kv_cache.manager import KVCacheManager
from nextoken.engine.request import Request, RequestStatus
from nextoken.engine.scheduler import Scheduler
from nextoken.sample.rng import DrawGenerator
from nextoken.sampling_params import SamplingParams


def make(max_seqs=8, budget=64, chunked=True, blocks=64, bs=4, caching=True):
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked), KVCacheManager(blocks, bs, caching))


def req(rid, n_prompt, max_tokens=8, first=0):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens), DrawGenerator())


def fake_step(s: Scheduler, token: int = 7):
    """Run a step as the engine would, with a model that always samples `token`."""
    plan = s.schedule()
    for r, n in plan.scheduled.items():
        r.num_computed_tokens += n
        s.kv.cache_full_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(token)
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r)
    return plan


def test_token_budget_and_chunked_prefill():
    s = make(budget=10)
    a, b = req("a", 25), req("b", 3)
    s.add(a), s.add(b)
    plan = s.schedule()
    assert plan.scheduled == {a: 10}  # the first chunk of a takes the whole budget
    a.num_computed_tokens += 10
    assert s.schedule().scheduled == {a: 10}
    a.num_computed_tokens += 10
    plan = s.schedule()
    assert plan.scheduled == {a: 5, b: 3}  # the last chunk and another prompt share a step


def test_decodes_and_prefills_mix():
    s = make(budget=16)
    a = req("a", 4)
    s.add(a)
    fake_step(s)  # a prefilled, sampled its first token
    b = req("b", 30)
    s.add(b)
    plan = s.schedule()
    assert plan.scheduled == {a: 1, b: 15}


def test_without_chunked_prefill_a_prompt_waits_for_room():
    s = make(budget=10, chunked=False)
    a, b = req("a", 4), req("b", 8)
    s.add(a), s.add(b)
    assert s.schedule().scheduled == {a: 4}  # b (8) does not fit the rest of the budget (6)


def test_max_num_seqs():
    s = make(max_seqs=2)
    rs = [req(str(i), 3) for i in range(4)]
    for r in rs:
        s.add(r)
    assert list(s.schedule().scheduled) == rs[:2] and len(s.waiting) == 2


def test_preemption_frees_the_newest_and_recomputes_it():
    s = make(blocks=4, bs=4, caching=False)  # 16 token slots in all
    a, b = req("a", 6, max_tokens=8), req("b", 6, max_tokens=8, first=100)
    s.add(a), s.add(b)
    fake_step(s)  # both prefilled: 2 blocks each, all blocks used
    assert s.kv.pool.num_free_blocks == 0
    fake_step(s)  # both decode positions 6 and 7, still in their second block
    fake_step(s)
    plan = s.schedule()  # position 8 of a needs a third block: b, the newest, is preempted
    assert plan.preempted == [b] and plan.scheduled == {a: 1}
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert len(b.output_ids) == 3  # its outputs are kept and will be recomputed with the prompt
    assert s.kv.block_ids("b") == [] and len(s.kv.block_ids("a")) == 3


def test_preempted_request_resumes_and_finishes():
    s = make(blocks=4, bs=4, caching=False)
    a, b = req("a", 6, max_tokens=8), req("b", 6, max_tokens=8, first=100)
    s.add(a), s.add(b)
    steps = 0
    while s.has_unfinished() and steps < 100:
        fake_step(s)
        steps += 1
    assert a.finished and b.finished and b.num_preemptions >= 1
    assert a.output_ids == [7] * 8 and b.output_ids == [7] * 8
    assert s.kv.pool.num_free_blocks == 4


def test_abort_frees_blocks():
    s = make(blocks=8)
    a = req("a", 10)
    s.add(a)
    fake_step(s)
    assert s.kv.pool.num_free_blocks < 8
    s.finish(a)
    assert not s.has_unfinished() and all(b.ref_cnt == 0 for b in s.kv.pool.blocks)


def test_prefix_cache_hit_skips_prefill():
    s = make(budget=64, bs=4)
    a = req("a", 12)
    s.add(a)
    fake_step(s)
    b = req("b", 14)  # same first 12 tokens
    s.add(b)
    plan = s.schedule()
    assert plan.scheduled[b] == 14 - 12 and b.num_cached_tokens == 12


def test_forked_completions_wait_for_the_prompt_then_share_it():
    s = make(budget=8, bs=4, caching=False)
    parent = req("p#0", 10)
    child = Request("p#1", parent.prompt_ids, parent.params, DrawGenerator(), parent=parent, index=1)
    s.add(parent), s.add(child)
    assert s.schedule().scheduled == {parent: 8}  # the child waits for the parent's prompt
    parent.num_computed_tokens = 8
    assert s.schedule().scheduled == {parent: 2}
    parent.num_computed_tokens = 10
    parent.append_output(7)
    plan = s.schedule()
    assert plan.scheduled == {parent: 1, child: 2}  # the child recomputes only past the shared blocks
    assert s.kv.block_ids("p#1")[:2] == s.kv.block_ids("p#0")[:2]
