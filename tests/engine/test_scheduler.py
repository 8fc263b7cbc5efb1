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
    assert plan.scheduled == {parent: 1, child: 1}  # the child computes only the prompt's last token:
    assert s.kv.block_ids("p#1")[:2] == s.kv.block_ids("p#0")[:2]  # its full blocks shared,
    assert plan.block_copies == [(s.kv.block_ids("p#0")[2], s.kv.block_ids("p#1")[2])]  # the third copied


def test_a_waiting_completion_holding_shared_blocks_cannot_stall_the_queue():
    """A forked completion waits, holding its parent's prompt blocks, behind a request that needs
    them: once nothing runs, the waiting holders give their blocks back (and recompute), so the
    queue moves on instead of stalling for good (it did: the engine stepped forever)."""
    s = make(budget=64, bs=4, blocks=10, caching=False)
    parent = req("a#0", 16, max_tokens=8)
    child = Request("a#1", parent.prompt_ids, parent.params, DrawGenerator(), parent=parent, index=1)
    big = req("b", 30, max_tokens=2, first=100)
    s.add(parent), s.add(child), s.add(big)
    finished = set()
    for _ in range(60):
        plan = fake_step(s)
        finished |= {r.request_id for r in (parent, child, big) if r.finished}
        if not s.has_unfinished():
            break
        assert plan.scheduled or plan.preempted, "no request runs and none is admitted: the queue stalls"
    assert finished == {"a#0", "a#1", "b"}
    assert s.kv.pool.num_free_blocks == 10


def make_policy(policy, max_seqs=2, budget=64, blocks=64, bs=4, aging_s=0.0):
    return Scheduler(SchedulerConfig(max_seqs, budget, True, None, policy, aging_s), KVCacheManager(blocks, bs, False))


def preq(rid, priority=0, client="", n_prompt=4, max_tokens=8, first=0):
    r = req(rid, n_prompt, max_tokens, first)
    r.priority, r.client = priority, client
    return r


def test_priority_admits_lower_values_first_then_arrival():
    """Under ``priority`` the waiting requests are admitted by priority (lower first) then by
    arrival; under ``fcfs`` by arrival alone."""
    for policy, want in (("priority", ["c", "a"]), ("fcfs", ["a", "b"])):
        s = make_policy(policy, max_seqs=2)
        reqs = [preq("a", 5), preq("b", 7), preq("c", 1), preq("d", 5)]
        for r in reqs:
            s.add(r)
        plan = s.schedule()
        assert [r.request_id for r in plan.scheduled] == want, policy


def test_a_higher_priority_preempts_the_lowest_running_one():
    """With every sequence slot taken, a waiting request of a strictly higher priority preempts
    the running request of the lowest priority (the newest among equals), which goes back to wait
    at the front of its own priority; one of equal priority waits."""
    s = make_policy("priority", max_seqs=2)
    low_old, low_new, mid = preq("low-old", 10), preq("low-new", 10, first=50), preq("mid", 5, first=90)
    s.add(low_old), s.add(low_new)
    fake_step(s)
    s.add(mid)
    plan = s.schedule()
    assert plan.preempted == [low_new] and mid in plan.scheduled and low_old in plan.scheduled
    assert low_new.status is RequestStatus.WAITING and low_new.num_computed_tokens == 0
    assert [r.request_id for r in s.running] == ["mid", "low-old"]  # priority order: the last goes first
    fake_step(s)
    five = preq("five", 5, first=120)  # preempts low-old, the last running
    s.add(five)
    plan = fake_step(s)
    assert plan.preempted == [low_old] and [r.request_id for r in s.running] == ["mid", "five"]
    same = preq("same", 5, first=150)
    s.add(same)
    plan = s.schedule()
    assert not plan.preempted and same not in plan.scheduled  # equal priority: no preemption
    assert [r.request_id for r in s.waiting.ordered()] == ["same", "low-old", "low-new"]


def test_preemption_for_blocks_takes_the_lowest_priority():
    """When blocks run out for a running request, the lowest-priority running request gives its
    blocks back, not the newest."""
    s = make_policy("priority", max_seqs=4, blocks=4, bs=4)  # 16 token slots
    hi, lo = preq("hi", 0, n_prompt=6), preq("lo", 9, n_prompt=6, first=100)
    s.add(lo)
    fake_step(s)
    s.add(hi)
    for _ in range(3):
        plan = fake_step(s)
    assert lo in plan.preempted or lo.num_preemptions == 1
    assert hi.num_preemptions == 0


def test_aging_lets_a_long_waiting_request_go_first():
    """The starvation guard: a waiting request's priority improves by one level per `aging_s`
    seconds it has waited, so a priority-10 request queued 10 s before a priority-0 one ties
    with it and goes first by arrival."""
    s = make_policy("priority", max_seqs=1, aging_s=1.0)
    old, new = preq("old", 10), preq("new", 0)
    s.add(old), s.add(new)
    t0 = old.queued_time
    assert [r.request_id for r in s.waiting.ordered(t0)] == ["new", "old"]
    new.queued_time = t0 + 10.0  # as if it had come 10 s later
    assert s.waiting.effective_priority(old, t0 + 10.5) == 0 == s.waiting.effective_priority(new, t0 + 10.5)
    assert [r.request_id for r in s.waiting.ordered(t0 + 10.5)] == ["old", "new"]


def test_fair_admits_the_client_served_least_first():
    """Under ``fair`` (the Virtual Token Counter) a client's counter grows with its prompt
    tokens (weight 1) and generated tokens (weight 2). A client joining while others wait starts
    at the least counter waiting (no banked credit); while it waits the running client's counter
    grows, so its request goes before the other client's earlier one."""
    s = make_policy("fair", max_seqs=1)
    a1, a2 = preq("a1", client="A", n_prompt=8, max_tokens=3), preq("a2", client="A", first=10)
    s.add(a1), s.add(a2)
    fake_step(s)  # a1's prompt: A = 8
    b1 = preq("b1", client="B", first=20)
    s.add(b1)
    assert s.waiting.counters["B"] == 8  # lifted to A's
    fake_step(s), fake_step(s)  # a1 decodes twice (weight 2 each) and finishes
    assert a1.finished and s.waiting.counters["A"] == 12
    plan = s.schedule()
    assert list(plan.scheduled) == [b1]  # B (8) before A's earlier a2 (A: 12)
