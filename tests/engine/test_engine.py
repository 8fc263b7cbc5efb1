"""End-to-end engine invariants: the same greedy tokens whatever the batch, the cache settings,
chunking or preemption; parallel sampling; aborts; no leaked blocks."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.engine.async_engine import AsyncLLMEngine
from tests.helpers.engine import assert_no_leak
from nextoken.errors import InvalidRequest
from tests.conftest import load_reference

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tiny_prompts(n=33, seed=0):
    """Prompts of 3..70 tokens; some share long prefixes (to exercise the prefix cache)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 270) for _ in range(40)]
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(shared[: rng.randrange(20, 40)] + [rng.randrange(3, 270) for _ in range(rng.randrange(1, 30))])
        else:
            out.append([rng.randrange(3, 270) for _ in range(rng.randrange(3, 70))])
    return out


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(tiny_gguf):
    """Each tiny prompt run on its own (batch of one), the baseline for the invariants."""
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    return [token_ids(llm.generate([p], GREEDY))[0] for p in tiny_prompts()]


@pytest.mark.parametrize("settings", [
    {},                                                   # defaults: prefix caching, chunked prefill
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16},                       # prompts split into many chunks
    {"enable_chunked_prefill": False, "enable_prefix_caching": False},
    {"num_kv_blocks": 24, "block_size": 4},               # 96 token slots for 33 requests: preemption
    {"max_num_seqs": 5},
])
def test_batched_greedy_equals_alone(tiny_gguf, alone, settings):
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", **settings)
    outs = llm.generate(tiny_prompts(), GREEDY)
    assert token_ids(outs) == alone
    assert_no_leak(llm)
    if "num_kv_blocks" in settings:
        assert llm.engine.stats()["num_preemptions"] > 0


def sliding_prompts() -> list[list[int]]:
    """Prompts that share beginnings, and longer versions of twelve of them (next turns)."""
    rng = random.Random(1)
    prompts = tiny_prompts(30, seed=11)
    return prompts + [p + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))] for p in prompts[:12]]


@pytest.fixture(scope="module")
def sliding_alone(tiny_gguf):
    """Gemma 3's greedy tokens of each of `sliding_prompts`, alone and without the prefix cache."""
    llm = LLM(str(tiny_gguf["gemma3"][0]), dtype="float32", block_size=4, enable_prefix_caching=False)
    return [token_ids(llm.generate([p], GREEDY))[0] for p in sliding_prompts()]


@pytest.mark.parametrize("settings", [
    {},                                                   # long prompts' early blocks off the ring, later hits
    {"num_kv_blocks": 40},                                # preemption
    {"kv_cache_memory": "300KiB"},                        # few rings: hits without blocks to spare
    {"max_num_seqs": 4, "max_num_batched_tokens": 20, "num_kv_blocks": 50},  # chunks, preemption, hits
])
def test_a_sliding_window_model_batched_equals_alone(tiny_gguf, sliding_alone, settings):
    """Gemma 3 (window 8, rings of 3 blocks of 4) under the prefix cache's every path at once:
    prompts batched with others that share their beginnings, passes longer than the ring after
    a cached prefix, blocks shared between running requests, preemption; then the same prompts
    again in reverse order, from the cache: every answer equals the prompt's alone, uncached."""
    llm = LLM(str(tiny_gguf["gemma3"][0]), dtype="float32", block_size=4, **settings)
    prompts = sliding_prompts()
    assert token_ids(llm.generate(prompts, GREEDY)) == sliding_alone
    assert token_ids(llm.generate(prompts[::-1], GREEDY))[::-1] == sliding_alone
    assert llm.engine.scheduler.prefix_cache_hits > 0
    assert_no_leak(llm)


def test_prefix_cache_reports_cached_tokens(tiny_gguf):
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", block_size=4)
    p = list(range(3, 43))
    first = llm.generate([p], GREEDY)[0]
    second = llm.generate([p[:38] + [7, 8]], GREEDY)[0]
    assert first.usage["cached_tokens"] == 0
    assert second.usage["cached_tokens"] == 36  # 9 full blocks of 4 shared
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sliding_window_models_next_turn_reuses_its_prefix(tiny_gguf, dtype):
    """Gemma 3 (window 8, rings of 3 blocks of 4): a second turn that extends the first (its
    prompt, its answer, a new message) computes only what follows the first turn's last computed
    token: its full blocks and its part-filled one (copied, with its ring's block) come from the
    cache, from the sliding pool's cached blocks of the window before it, and it answers as
    without the prefix cache: the same
    greedy tokens, log-probabilities within float32's (or bf16's) rounding of a prefill split
    at another point."""
    path = str(tiny_gguf["gemma3"][0])
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    prompt = [(7 * j) % 250 + 3 for j in range(30)]
    cached, plain = (LLM(path, dtype=dtype, block_size=4, enable_prefix_caching=on) for on in (True, False))
    first = cached.generate([prompt], p)[0].outputs[0]
    assert first.token_ids == plain.generate([prompt], p)[0].outputs[0].token_ids
    second = prompt + first.token_ids + [11, 12, 13]
    a, b = cached.generate([second], p)[0], plain.generate([second], p)[0]
    assert a.usage["cached_tokens"] == 39 and b.usage["cached_tokens"] == 0  # 30 + 10 - 1: 9 full blocks and 3 tokens
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    tol = 1e-4 if dtype == "float32" else 0.1
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert all(abs(x[t] - y[t]) < tol for t in x.keys() & y.keys())
    assert_no_leak(cached)


@pytest.mark.parametrize("max_num_seqs,overlap", [(1, False), (8, False), (8, True)])
def test_a_sliding_window_model_reuses_a_shared_beginning_and_a_longer_history(tiny_gguf, max_num_seqs, overlap):
    """Gemma 3 (window 8, rings of 3 blocks of 4). With rings to spare (8 sequences' worth), a
    prompt longer than its ring caches its early blocks too (`KVCacheManager`'s off-ring
    blocks), so requests that only begin with its first 20 tokens reuse them; a next turn whose
    new message comes round to the window it reads reads the cached blocks and writes new
    ones. With one ring (`nextoken run`'s), that beginning is not cached and the next turn
    rewrites its window in place. Every answer equals the uncached engine's (float32), with async
    scheduling too (a pass's off-ring blocks are given back while the next is in flight)."""
    path = str(tiny_gguf["gemma3"][0])
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    system = [(5 * j) % 240 + 3 for j in range(20)]
    cached, plain = (LLM(path, dtype="float32", block_size=4, max_num_seqs=max_num_seqs, enable_prefix_caching=on,
                         async_scheduling=overlap and on) for on in (True, False))
    first_prompt = system + [30 + j for j in range(10)]
    first = cached.generate([first_prompt], p)[0].outputs[0]
    others = [system + [100 + i, 101 + i, 102 + i] for i in range(3)]
    history = first_prompt + first.token_ids + [60 + j for j in range(14)]
    for prompt, hit in [(history, 36), *[(o, 20 if max_num_seqs > 1 else 0) for o in others]]:
        a, b = cached.generate([prompt], p)[0], plain.generate([prompt], p)[0]
        assert a.usage["cached_tokens"] == hit
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x.keys() & y.keys())
    assert_no_leak(cached)


def test_parallel_sampling_shares_the_prompt(tiny_gguf):
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", block_size=4)
    prompt = tiny_prompts()[1]
    single = token_ids(llm.generate([prompt], GREEDY))[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [single] * 3  # forked completions are exact
    sampled = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    a = [c.token_ids for c in llm.generate([prompt], sampled)[0].outputs]
    assert len({tuple(x) for x in a}) == 3
    assert a == [c.token_ids for c in llm.generate([prompt], sampled)[0].outputs]
    assert_no_leak(llm)


def test_seeded_request_draws_the_same_in_any_batch(tiny_gguf):
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    prompts = tiny_prompts(8, seed=3)
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = token_ids(llm.generate([prompts[0]], p))[0]
    others = [SamplingParams(temperature=0.9, max_tokens=14, ignore_eos=True) for _ in prompts[1:]]
    batched = token_ids(llm.generate(prompts, [p, *others]))[0]
    assert batched == alone


def test_abort_frees_blocks_and_spares_the_others(tiny_gguf, alone):
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    engine = llm.engine
    prompts = tiny_prompts()[:3]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(4):
        engine.step()
    engine.abort_request(ids[1])
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert final == {ids[0]: alone[0], ids[2]: alone[2]}
    assert_no_leak(llm)


def test_a_final_only_request_has_one_output_equal_to_the_streamed_ones_last(tiny_gguf):
    """``RequestOptions.final_only`` (what `LLM.generate` asks): no output until the request
    finishes, then one with the same text, tokens and log-probabilities as a streamed request's
    last, beside a streamed request that still reports every step."""
    from nextoken.request_options import RequestOptions

    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    engine = llm.engine
    prompt = tiny_prompts()[4]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2, stop=["zz"])
    quiet = engine.add_request(prompt, params, options=RequestOptions(final_only=True))
    loud = engine.add_request(prompt, params)
    seen = {quiet: [], loud: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen[quiet]) == 1 and seen[quiet][0].finished and len(seen[loud]) == 9
    a, b = seen[quiet][0].outputs[0], seen[loud][-1].outputs[0]
    assert (a.text, a.token_ids, a.logprobs, a.finish_reason) == (b.text, b.token_ids, b.logprobs, b.finish_reason)
    assert a.text == "".join(o.outputs[0].delta for o in seen[loud])
    assert seen[quiet][0].metrics.num_output_tokens == 9
    assert_no_leak(llm)


def test_outputs_are_snapshots_that_copy_nothing_until_read(tiny_gguf):
    """A step's output holds views of the engine's growing lists (`outputs.CompletionSnapshot`),
    copied on first read: read only after the request has finished, each still gives the tokens
    and log-probabilities it had when made (the deltas so far), its delta's log-probabilities are
    its last ones, and it equals a plain `CompletionOutput` of the same values."""
    import dataclasses

    from nextoken.outputs import CompletionOutput, Prefix

    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    engine = llm.engine
    engine.add_request(tiny_prompts()[6], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 9 and all(type(o.outputs[0].__dict__["_token_ids"]) is Prefix for o in outs)
    final = outs[-1].outputs[0]
    ids = []
    for o in outs:
        c = o.outputs[0]
        k = len(c.delta_token_ids)
        lps = c.delta_logprobs  # (read before the whole list: from the view)
        ids += c.delta_token_ids
        assert c.token_ids == ids == final.token_ids[: len(ids)]
        assert c.logprobs == final.logprobs[: len(ids)] and lps == c.logprobs[-k:] and len(lps) == k
        assert c == CompletionOutput(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
    assert_no_leak(llm)


@pytest.mark.parametrize("n", [1, 2])
def test_stream_interval_sends_the_first_token_then_every_nth_and_the_last(tiny_gguf, n):
    """``--stream-interval 4``: a streamed request's first token comes alone (the time to first
    token is unchanged), then an output each 4 new tokens of all its sequences, then its last;
    the deltas join to the text, and the final output equals the same request's at interval 1."""
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=1, n=n)
    prompt = tiny_prompts()[5]
    runs = {}
    for interval in (1, 4):
        llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", stream_interval=interval)
        rid = llm.engine.add_request(prompt, params)
        outs = []
        while llm.engine.has_unfinished_requests():
            outs.extend(o for o in llm.engine.step() if o.request_id == rid)
        runs[interval] = outs
        assert_no_leak(llm)
    def counts(outs):
        return [sum(len(c.token_ids) for c in o.outputs) for o in outs]

    expected = counts(runs[1])[:1]  # interval 1: an output every step; the tokens at each
    for c in counts(runs[1])[1:-1]:
        if c - expected[-1] >= 4:
            expected.append(c)
    expected.append(11 * n)
    assert counts(runs[4]) == expected and len(expected) < len(runs[1]), (counts(runs[4]), counts(runs[1]))
    for k in range(n):
        fast = [c for o in runs[4] for c in o.outputs if c.index == k]
        slow = [c for o in runs[1] for c in o.outputs if c.index == k]
        assert "".join(c.delta for c in fast) == fast[-1].text == slow[-1].text
        assert sum((c.delta_token_ids for c in fast), []) == fast[-1].token_ids == slow[-1].token_ids
        assert fast[-1].logprobs == slow[-1].logprobs and fast[-1].finish_reason == slow[-1].finish_reason == "length"
    assert runs[4][-1].finished and runs[4][-1].metrics.num_output_tokens == 11 * n


def test_a_request_that_can_never_fit_is_refused(tiny_gguf):
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", num_kv_blocks=4, block_size=4)
    with pytest.raises(InvalidRequest, match="needs 5 KV cache blocks.*holds 4"):
        llm.generate([list(range(3, 13))], SamplingParams(max_tokens=10))
    assert not llm.engine.has_unfinished_requests()


def test_async_engine_streams_and_aborts_on_disconnect(tiny_gguf, alone):
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    engine = AsyncLLMEngine(llm.engine)
    prompts = tiny_prompts()[:3]

    async def collect(p):
        text_ids = None
        async for out in engine.generate(p, GREEDY):
            text_ids = out.outputs[0].token_ids
        return text_ids

    async def leave_early(p):
        async for out in engine.generate(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
            if len(out.outputs[0].token_ids) >= 3:
                break  # the client goes away

    async def main():
        results = await asyncio.gather(collect(prompts[0]), leave_early(prompts[1]), collect(prompts[2]))
        for _ in range(50):  # the abort is applied at the next step boundary
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return results

    a, _, c = asyncio.run(main())
    assert [a, c] == [alone[0], alone[2]]
    assert_no_leak(llm)


def test_a_request_id_in_use_is_refused_and_the_running_request_goes_on(tiny_gguf, alone):
    """A second request with the id of one still streamed: `InvalidRequest` naming the field, and
    the first request's stream is untouched (its queue was once replaced, then dropped)."""
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    engine = AsyncLLMEngine(llm.engine)

    async def main():
        rid = await engine.add_request(tiny_prompts()[0], GREEDY, request_id="mine")
        with pytest.raises(InvalidRequest) as e:
            await engine.add_request("other", GREEDY, request_id="mine")
        assert e.value.field == "request_id"
        return [out async for out in engine.stream(rid)][-1].outputs[0].token_ids

    assert asyncio.run(main()) == alone[0]
    assert_no_leak(llm)


def test_a_consumer_that_falls_behind_gets_the_waiting_outputs_as_one(tiny_gguf):
    """`AsyncLLMEngine.stream` joins the outputs that waited for a slow consumer (vLLM's output
    collector): a consumer that reads nothing until the request ends gets one output whose
    deltas are the whole text and ids (log-probabilities: the cumulative list); one that keeps
    up gets an output per step, whose deltas join to the same. (No prefix cache: the second run
    would read the first's blocks, and on two threads a cached prefix moves the last bits.)"""
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", enable_prefix_caching=False)
    engine = AsyncLLMEngine(llm.engine)
    prompt = tiny_prompts()[4]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)

    async def read(late: bool):
        rid = await engine.add_request(prompt, params)
        if late:  # between steps, so the last step's outputs are queued when it sees the request done
            while await engine.between_steps(llm.engine.has_unfinished_requests):
                await asyncio.sleep(0.005)  # (the step loop runs meanwhile)
        return [out async for out in engine.stream(rid)]

    async def both():  # (one event loop: the engine's lock and event belong to it)
        return await read(True), await read(False)

    late, steady = asyncio.run(both())
    assert len(late) == 1 and len(steady) == 10
    final = steady[-1].outputs[0]
    assert late[0].outputs[0].delta == "".join(o.outputs[0].delta for o in steady) == final.text
    assert late[0].outputs[0].delta_token_ids == [t for o in steady for t in o.outputs[0].delta_token_ids] \
        == final.token_ids
    assert late[0].outputs[0].logprobs == final.logprobs and late[0].finished
    assert_no_leak(llm)


def test_smollm2_batched_equals_reference_and_alone(smollm2_path, smollm2_f32):
    """10 requests at once on the real model: the reference prompts still give the reference
    greedy ids (prefix caching on, and under preemption), the rest match their solo runs."""
    gens = load_reference("smollm2-135m-instruct")["generations"]
    extra = [f"Write one sentence about the number {i}." for i in range(4)]
    prompts = [g["prompt_ids"] for g in gens] + extra
    p = SamplingParams(temperature=0, max_tokens=16)
    llm = smollm2_f32
    outs = token_ids(llm.generate(prompts, p))
    for g, got in zip(gens, outs):
        assert got == g["greedy_ids"][:16]
    assert [token_ids(llm.generate([q], p))[0] for q in extra[:2]] == outs[len(gens):len(gens) + 2]
    assert_no_leak(llm)
    tight = LLM(str(smollm2_path), dtype="float32", num_kv_blocks=12, enable_prefix_caching=False)
    assert token_ids(tight.generate(prompts, p)) == outs
    assert tight.engine.stats()["num_preemptions"] > 0
    assert_no_leak(tight)


def test_int8_kv_cache_batched_equals_alone(tiny_gguf):
    """With an int8 KV cache (rows quantized on write, each on its own) a request's tokens do not
    depend on its batch, on prefix-cache hits or on preemption; the same memory holds more
    blocks (keys and values take D + 4 bytes per row instead of 4 D in float32)."""
    path = str(tiny_gguf["llama"][0])
    prompts = tiny_prompts(12, seed=3)
    single = LLM(path, dtype="float32", kv_cache_dtype="int8", max_num_seqs=1)
    alone = [token_ids(single.generate([p], GREEDY))[0] for p in prompts]
    for settings in ({}, {"num_kv_blocks": 24, "block_size": 4}):
        llm = LLM(path, dtype="float32", kv_cache_dtype="int8", **settings)
        assert token_ids(llm.generate(prompts, GREEDY)) == alone
        assert_no_leak(llm)
    budget = 2**20
    blocks = {d: LLM(path, dtype="float32", kv_cache_dtype=d, kv_cache_memory=budget).engine.kv.pool.num_blocks
              for d in ("auto", "int8")}
    head_dim = single.engine.config.head_dim
    assert blocks["int8"] / blocks["auto"] == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.05)
    assert single.engine.runner.kv.k.dtype == single.engine.runner.kv.v.dtype == torch.int8


def test_async_engine_steps_on_one_thread(tiny_gguf):
    """Every step runs on the same thread: OpenMP keeps a team of threads per thread that starts
    parallel work, and teams left idle spin on the cores the working one needs (a server with 2
    compute threads served SmolLM2 slower than with 1 while asyncio's pool took the steps)."""
    import threading

    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    threads = set()
    step = llm.engine.step

    def recorded():
        threads.add(threading.get_ident())
        return step()

    llm.engine.step = recorded
    engine = AsyncLLMEngine(llm.engine)

    async def collect(p):
        async for out in engine.generate(p, GREEDY):
            pass
        await asyncio.sleep(0.01)  # idle gaps, where a pool would hand the next step to another thread
        async for out in engine.generate(p, GREEDY):
            pass
        return out.outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(collect(p) for p in tiny_prompts()[:6]))

    asyncio.run(main())
    assert len(threads) == 1 and threading.get_ident() not in threads
