"""Async scheduling (``async_scheduling``, vLLM's): each step is launched before the last one is
read back, its decodes taking the last step's tokens on the device. The oracle is the same engine
with the steps in order: the same tokens, texts and finish reasons for every kind of request
that runs overlapped (greedy, seeded top-p / top-k / min-p, log-probabilities, n > 1, stop
strings, the end of generation), under preemption, aborts and requests that need the steps in
order; and the engine really overlaps (decodes fed from the device) while it may.

The two runs' batches differ (a request that stops has one more row in the step after), so
float32 logits differ in their last bits: log-probabilities are compared to 1e-4.
"""

from __future__ import annotations

import random

import pytest

from nextoken import LLM, SamplingParams
from nextoken.structured import StructuredOutputsParams
from tests.helpers.engine import assert_no_leak

SMALL = dict(dtype="float32", max_num_seqs=6, block_size=4)


def workload(vocab: int = 250, count: int = 16):
    """Prompts and params of every kind that overlaps: greedy of many lengths, seeded top-p with
    log-probabilities, n=2 with stop strings, and greedy with stop tokens (and the end of generation)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))] for _ in range(count)]
    kinds = [lambda i: SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True),
             lambda i: SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=16, logprobs=2),
             lambda i: SamplingParams(temperature=1.0, top_k=30, min_p=0.02, seed=i, n=2, max_tokens=12, stop=["a", ":"]),
             lambda i: SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[32, 69])]
    return prompts, [kinds[i % 4](i) for i in range(count)]


def completions(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def assert_logprobs_close(got, want):
    for a, b in zip(got, want):
        for ca, cb in zip(a.outputs, b.outputs):
            if cb.logprobs is None:
                assert ca.logprobs is None
                continue
            assert len(ca.logprobs) == len(cb.logprobs)
            for da, db in zip(ca.logprobs, cb.logprobs):
                assert da.keys() == db.keys() and all(abs(da[t] - db[t]) < 1e-4 for t in da)


def count_fed(llm) -> list[int]:
    """Wrap the runner's execute: the count of passes that took tokens from the device."""
    runner, fed = llm.engine.runner, [0]
    execute = runner.execute

    def counting(seqs, *args, **kwargs):
        if kwargs.get("fed") is not None and any(s.fed_from >= 0 for s in seqs):
            fed[0] += 1
        return execute(seqs, *args, **kwargs)

    runner.execute = counting
    return fed


@pytest.mark.parametrize("arch,plan,blocks", [
    ("llama", {}, 200), ("llama", {}, 28), ("llama", {"enforce_eager": True}, 28), ("gemma3", {}, 200)],
    ids=["kernels", "kernels-preempting", "pytorch-preempting", "sliding-window"])
def test_async_scheduling_gives_the_tokens_of_steps_in_order(tiny_gguf, arch, plan, blocks):
    path = str(tiny_gguf[arch][0])
    prompts, params = workload()
    # (Gemma 3's oracle runs without the prefix cache: its n = 2 completions and long prompts use the
    # sliding pool's cached and off-ring blocks, which the overlapped steps then give back)
    want_llm = LLM(path, **SMALL, **plan, num_kv_blocks=blocks, enable_prefix_caching=arch != "gemma3")
    want = want_llm.generate(prompts, params)
    llm = LLM(path, **SMALL, **plan, num_kv_blocks=blocks, async_scheduling=True)
    assert llm.engine.async_scheduling
    fed = count_fed(llm)
    steps = []
    llm.engine.subscribe(steps.append)
    got = llm.generate(prompts, params)
    assert completions(got) == completions(want)
    assert_logprobs_close(got, want)
    assert fed[0] > 10  # (it overlapped: decodes took their tokens on the device)
    assert all(s.overlapped and s.wait_ms >= 0 for s in steps) and all(s.record()["overlapped"] for s in steps)
    if blocks == 28:
        assert llm.engine.scheduler.num_preemptions > 0
    stops = [c.stop_reason for o in got for c in o.outputs if c.finish_reason == "stop"]
    assert any(isinstance(r, str) for r in stops) and (arch != "llama" or any(isinstance(r, int) for r in stops))
    assert_no_leak(llm)


def test_requests_that_need_order_run_in_order_beside_the_others(tiny_gguf):
    """Penalties, logit bias, a grammar and prompt logprobs need the host between steps: while one is in the engine the steps run in order (no token fed on the device); their
    outputs and the others' equal the in-order engine's."""
    path = str(tiny_gguf["llama"][0])
    prompts, params = workload(count=8)
    ordered = [SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
               SamplingParams(temperature=0.7, seed=4, max_tokens=6, logit_bias={5: 3.0}, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=12,
                              structured_outputs=StructuredOutputsParams(regex="[a-z]{2,8}"))]
    all_prompts, all_params = prompts + prompts[:4], params + ordered
    want = LLM(path, **SMALL).generate(all_prompts, all_params)
    llm = LLM(path, **SMALL, async_scheduling=True)
    fed = count_fed(llm)
    got = llm.generate(all_prompts, all_params)
    assert completions(got) == completions(want)
    assert_logprobs_close(got, want)
    for a, b in zip(got[-2].prompt_logprobs, want[-2].prompt_logprobs, strict=True):
        assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=1e-4))
    assert fed[0] == 0  # (the ordered requests arrive with the others and stay till the end)
    alone = llm.generate(prompts, params)  # the same engine overlaps again once they are gone
    assert completions(alone) == completions(want[:8]) and fed[0] > 0
    assert_no_leak(llm)


def test_abort_and_new_requests_between_overlapped_steps(tiny_gguf):
    """Aborting a request whose token is in flight drops its row; requests added between steps
    join the overlapped steps; the rest is as in order."""
    path = str(tiny_gguf["llama"][0])
    prompts, params = workload(count=6)
    runs = []
    for async_scheduling in (False, True):
        engine = LLM(path, **SMALL, async_scheduling=async_scheduling).engine
        ids = [engine.add_request(p, q) for p, q in zip(prompts[:4], params[:4])]
        finals = {}
        for step in range(60):
            if step == 3:
                engine.abort_request(ids[1])
            if step == 5:
                ids += [engine.add_request(p, q) for p, q in zip(prompts[4:], params[4:])]
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            if step > 5 and not engine.has_unfinished_requests():
                break
        runs.append({rid: [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for rid, o in finals.items()})
        assert not engine.has_unfinished_requests()
        assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    assert runs[1] == runs[0] and ids[1] not in runs[0] and len(runs[0]) == 5


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_async_scheduling_under_the_other_policies(tiny_gguf, policy):
    """Priority preemption (a higher priority takes a running request's place, which may have a
    token in flight) and the fair policy on a tight cache: the in-order engine's tokens."""
    path = str(tiny_gguf["llama"][0])
    prompts, params = workload(count=12)
    priority = [i % 3 for i in range(12)] if policy == "priority" else None
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(path, **{**SMALL, "max_num_seqs": 4}, num_kv_blocks=30, scheduling_policy=policy,
                  async_scheduling=async_scheduling)
        runs.append(completions(llm.generate(prompts, params, priority=priority)))
        assert llm.engine.scheduler.num_preemptions > 0
        assert_no_leak(llm)
    assert runs[1] == runs[0]
