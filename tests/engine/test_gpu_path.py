"""The GPU's path against the engine's own CPU reference path (float32, PyTorch only), token for
token.

Without a GPU (CI) it runs on the CPU: Triton attention under Triton's interpreter, PyTorch for
the rest, and the CUDA graphs' static, padded decode buffers run eagerly. On a GPU with Triton
compiled (``TRITON_INTERPRET=0``, as benchmarks/gpu_check.py runs it) the same tests run the
engine with ``device="cuda"``: its weights, cache and sampler there, the decode steps replayed
as captured CUDA graphs.

Every step runs with PyTorch's default device set to ``meta``: a tensor the device path makes
without naming its device would land there and fail the test, so nothing on that path can
quietly put a tensor on the CPU that a GPU would need on the GPU (or the reverse).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.errors import InvalidRequest
from nextoken.runner import plan as plan_module
from nextoken.engine import engine as engine_module
from nextoken.engine.engine import with_batch_defaults
from nextoken.engine_args import EngineArgs
from nextoken.runner.cuda_graphs import capture_sizes
from nextoken.runner.device import CPU, Device, batch_defaults
from tests.helpers.engine import assert_no_leak

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

PROMPTS = [[5, 17, 200, 33, 41, 270, 90, 12, 7, 150, 3, 99], [7, 8, 9], list(range(20, 60)), [100, 101],
           [5, 17, 200, 33, 41, 270, 90, 12, 60, 61]]  # the last shares two 4-token blocks with the first
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, top_p=0.9),
          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, repetition_penalty=1.3, logprobs=3),
          SamplingParams(temperature=1.0, seed=5, max_tokens=14, ignore_eos=True, top_k=20, min_p=0.05),
          SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, presence_penalty=0.5,
                         logit_bias={3: 2.0})]
SMALL = dict(dtype="float32", max_num_seqs=4, block_size=4, num_kv_blocks=64)  # (a GPU would give the cache 90%)
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"
# the GPU path: on a GPU its own device; here the CPU with the Triton attention the GPU runs
GPU_PATH = dict(device="cuda") if ON_GPU else dict(enforce_eager=True, attention_backend="triton")
REFERENCE = dict(device="cpu", enforce_eager=True)  # the CPU's PyTorch path


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Plans that ask for CUDA graphs and the Triton draw: on the CPU the engine then runs every
    decode batch through the graphs' static buffers (padded to 1, 2 or 4 rows) without capturing,
    and its sampler's draws on `kernels.gpu.sampling` under the interpreter. (A GPU's plan asks
    for them itself.)"""
    if ON_GPU:
        return
    choose = plan_module.ExecutionPlan.choose.__func__

    def with_graphs(cls, *args, **kwargs):
        plan = choose(cls, *args, **kwargs)
        plan.cuda_graphs = plan.triton_sampling = plan.attention == "triton"
        return plan

    monkeypatch.setattr(plan_module.ExecutionPlan, "choose", classmethod(with_graphs))


def generate_on_meta(llm, prompts, params):
    with torch.device("meta"):
        return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch,n,most", [("llama", 5, 14), ("gemma3", 3, 6)])
def test_the_gpu_path_equals_the_reference_path(tiny_gguf, graphs_on_cpu, arch, n, most):
    """Greedy, seeded top-p/top-k/min-p, penalties, logit bias and log-probabilities over a batch
    with max_num_seqs 4 (on Llama a fifth prompt waits and shares a prefix from the prefix
    cache; decode batches of 1 to 4 padded to 1, 2, 4), and on Gemma 3's sliding-window rings
    (prompts longer than its window; then a second turn that goes on from the first prompt's
    cached blocks): the same tokens and log-probabilities as the CPU's PyTorch reference path."""
    path = str(tiny_gguf[arch][0])
    prompts = PROMPTS[:n]  # (Gemma 3's six layers under the interpreter: fewer tokens)
    params = [dataclasses.replace(p, max_tokens=min(p.max_tokens, most)) for p in PARAMS[:n]]
    reference = LLM(path, **REFERENCE, **SMALL)
    want = [o.outputs[0] for o in reference.generate(prompts, params)]
    llm = LLM(path, **GPU_PATH, **SMALL)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.sizes == [1, 2, 4]
    got = generate_on_meta(llm, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got[2].logprobs, want[2].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    if arch == "gemma3":  # the next turn: the first prompt, its answer and more, from its cached blocks
        turn = [PROMPTS[0] + got[0].token_ids + list(range(5, 19))]  # reads cached blocks its slots write anew,
        plain = LLM(path, **REFERENCE, **SMALL, enable_prefix_caching=False)  # and writes one block off its ring
        again = plain.generate(turn, params[:1])[0].outputs[0]
        before = llm.engine.scheduler.prefix_cache_hits
        assert generate_on_meta(llm, turn, params[:1])[0].token_ids == again.token_ids
        assert llm.engine.scheduler.prefix_cache_hits - before == 16
    assert llm.engine.scheduler.prefix_cache_hits > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("join,join_splits", [(True, 16), (False, 16), (True, 0)])
def test_the_chosen_attention_tiles_reach_every_call(tiny_gguf, graphs_on_cpu, monkeypatch, join, join_splits):
    """The attention tiles the plan chose at load (here stand-ins, the last of each kind's
    `tilings`: a GPU's are timed) are the ones every attention call takes, eager prefill chunks and
    the graphs' decode steps alike, the prefill's query tiles made with its block_q, and the
    decodes' splits are joined in their own launch (the cache's tickets) unless the plan turned
    that off (`Tilings.join`: its values differed on the GPU) or timed it slower at the decodes'
    splits (`Tilings.join_splits`); the tokens stay the reference path's."""
    import nextoken.kernels.gpu.attention as A

    path = str(tiny_gguf["llama"][0])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **REFERENCE, **SMALL).generate(PROMPTS[1:3], params)]
    chosen = {}

    def stand_in(plan, cfg, block_size, default):
        group = cfg.num_heads // cfg.num_kv_heads
        chosen["tiles"] = A.Tilings(A.tilings(True, group, cfg.head_dim)[-1], A.tilings(False, group, cfg.head_dim)[-1],
                                    join, join_splits)
        return chosen["tiles"]

    monkeypatch.setattr(plan_module.ExecutionPlan, "choose_tilings", stand_in)
    calls, block_qs, kernel, tiled = [], set(), A.paged_attention, A.query_tiles

    def spied(*args, decode, launch=None, **kwargs):
        calls.append((decode, launch, kwargs.get("tickets") is not None))
        return kernel(*args, decode=decode, launch=launch, **kwargs)

    def query_tiles(query_start_loc, block_q, first=0):
        block_qs.add(block_q)
        return tiled(query_start_loc, block_q, first)

    monkeypatch.setattr(A, "paged_attention", spied)
    monkeypatch.setattr(A, "query_tiles", query_tiles)
    llm = LLM(path, **GPU_PATH, **SMALL)
    assert [o.token_ids for o in generate_on_meta(llm, PROMPTS[1:3], params)] == want
    tiles = chosen["tiles"]
    runner = llm.engine.runner
    assert runner.tilings == tiles and runner.graphs.tilings == tiles
    assert tiles != A.default_tilings(runner.config.num_queries_per_kv, runner.config.head_dim)
    assert {c[1] for c in calls if c[0]} == {tiles.decode} and {c[1] for c in calls if not c[0]} == {tiles.prefill}
    assert block_qs == {tiles.prefill.block_q}
    assert {c[2] for c in calls if c[0]} == {join and join_splits > 0}


def test_preemption_and_speculation_on_the_gpu_path(tiny_gguf, graphs_on_cpu):
    """A cache too small for the batch (preemption by recompute), n-gram speculation (its
    verification rows as decodes of one sequence, in the same pass) and a draft model on the same
    device (its own runner and cache): greedy text unchanged."""
    path = str(tiny_gguf["llama"][0])
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], list(range(30, 50)), [9, 9, 9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **REFERENCE, **SMALL).generate(prompts, params)]
    tight = LLM(path, **GPU_PATH, **{**SMALL, "num_kv_blocks": 12})
    assert [o.token_ids for o in generate_on_meta(tight, prompts, params)] == want
    assert tight.engine.scheduler_stats().num_preemptions > 0
    spec = LLM(path, **GPU_PATH, **SMALL, speculative_method="ngram", num_speculative_tokens=3)
    assert [o.token_ids for o in generate_on_meta(spec, prompts, params)] == want
    assert spec.engine.spec_stats().num_drafted_tokens > 0
    draft = LLM(path, **GPU_PATH, **SMALL, speculative_model=path, num_speculative_tokens=2)  # its own runner
    assert draft.engine.speculator.draft.runner.plan.attention == "triton"
    assert [o.token_ids for o in generate_on_meta(draft, prompts[:1], params)] == want[:1]
    assert draft.engine.spec_stats().num_accepted_tokens > 0


def test_async_scheduling_on_the_gpu_path(tiny_gguf, graphs_on_cpu):
    """Async scheduling on the GPU's path: decode batches through the graphs' static buffers take
    the last step's tokens on the device (written into the static ids before the replay), mixed
    steps eagerly, the draw's copies read back a step later. The reference path's tokens and
    log-probabilities (requests without processors: those would run the steps in order)."""
    path = str(tiny_gguf["llama"][0])
    params = [dataclasses.replace(p, max_tokens=min(p.max_tokens, 8)) for p in (PARAMS[0], PARAMS[1], PARAMS[3])]
    params.append(SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))
    want = [o.outputs[0] for o in LLM(path, **REFERENCE, **SMALL).generate(PROMPTS[:4], params)]
    llm = LLM(path, **GPU_PATH, **SMALL, async_scheduling=True)
    runner, fed = llm.engine.runner, []
    run = runner.graphs.run
    runner.graphs.run = lambda batch, feed=None: fed.append(feed is not None) or run(batch, feed)
    got = generate_on_meta(llm, PROMPTS[:4], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got[3].logprobs, want[3].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert sum(fed) > 3  # (graph replays fed on the device)
    assert_no_leak(llm)


def test_lora_adapters_on_the_gpu_path(tiny_gguf, graphs_on_cpu, tmp_path):
    """A PEFT adapter's requests beside the base model's in one batch (adapter rows run eagerly,
    base-only decode steps through the graphs): the CPU reference path's tokens."""
    import copy

    from peft import LoraConfig, get_peft_model

    from nextoken import LoRARequest

    path, hf = tiny_gguf["llama"]
    torch.manual_seed(7)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                     lora_dropout=0.0)
    get_peft_model(copy.deepcopy(hf), cfg).save_pretrained(tmp_path)
    lora = LoRARequest("x", 1, str(tmp_path))
    prompts, loras = PROMPTS[:3], [lora, None, lora]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(path), **REFERENCE, **SMALL, enable_lora=True).generate(prompts, params, lora_request=loras)
    llm = LLM(str(path), **GPU_PATH, **SMALL, enable_lora=True)
    with torch.device("meta"):
        got = llm.generate(prompts, params, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    base = llm.generate(prompts[:1], params)[0].outputs[0].token_ids
    assert base != got[0].outputs[0].token_ids  # the adapter changes the answer


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_disk_tier_on_the_gpu_path(tiny_gguf, graphs_on_cpu, tmp_path, kv_dtype):
    """The prefix cache's disk tier from the device's cache: a first engine copies its full blocks
    out (`PagedKVCache.read_block`: device to host), a restarted one copies them back in
    (`write_block`: host to device) instead of recomputing them, and both answer as the engine
    without the tier, in bf16 and int8 KV."""
    path = str(tiny_gguf["llama"][0])
    prompt = [PROMPTS[2] + PROMPTS[0]]  # 52 tokens: 13 full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(GPU_PATH, **SMALL, kv_cache_dtype=kv_dtype)
    want = generate_on_meta(LLM(path, **kw), prompt, params)[0].token_ids
    runs = []
    for _ in range(2):
        llm = LLM(path, **kw, kv_cache_dir=str(tmp_path))
        runs.append(generate_on_meta(llm, prompt, params)[0].token_ids)
        llm.close()  # (waits for the tier's writes)
        stats = llm.engine.scheduler_stats().disk
    assert runs == [want, want]
    assert stats.hits >= 12 and stats.errors == 0  # (the second engine read the prompt's blocks back)


def test_structured_output_on_the_gpu_path(tiny_gguf, graphs_on_cpu):
    """Grammars' masks over the device's logits, beside unconstrained rows in the same batch (the
    Triton draw, graphs' decode steps): every constrained text matches its regex or choice, and
    every request's tokens are the CPU reference path's, sampled (seeded) and greedy."""
    import re

    path = str(tiny_gguf["llama"][0])
    regex = r"[a-c]{2}-\d{3}"
    params = [SamplingParams(temperature=0.9, seed=7, max_tokens=12, structured_outputs={"regex": regex}),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": ["yes", "no", "maybe"]}),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=11, max_tokens=12, structured_outputs={"regex": regex})]
    prompts = PROMPTS[:4]
    want = [o.outputs[0] for o in LLM(path, **REFERENCE, **SMALL).generate(prompts, params)]
    got = generate_on_meta(LLM(path, **GPU_PATH, **SMALL), prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(regex, got[0].text) and re.fullmatch(regex, got[3].text), (got[0].text, got[3].text)
    assert got[1].text in ("yes", "no", "maybe")


def test_chunks_prompt_logprobs_parallel_samples_and_beams_on_the_gpu_path(tiny_gguf, graphs_on_cpu):
    """A 40-token prompt in 6-token prefill chunks beside decodes, prompt log-probabilities (every
    prompt row's logits), n=3 seeded samples of one prompt (its blocks shared) and beam search
    (forked beams) on the GPU path: the tokens, prompt log-probabilities and beam scores of the
    CPU reference path."""
    path = str(tiny_gguf["llama"][0])
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    kw = dict(SMALL, max_num_batched_tokens=6)
    ref, gpu = LLM(path, **REFERENCE, **kw), LLM(path, **GPU_PATH, **kw)
    want = ref.generate(prompts, params)
    with torch.device("meta"):
        got = gpu.generate(prompts, params)
        beams = gpu.beam_search([PROMPTS[3], PROMPTS[4]], beam_width=3, max_tokens=5, ignore_eos=True)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert len(got[1].outputs) == 3
    for a, b in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    want_beams = ref.beam_search([PROMPTS[3], PROMPTS[4]], beam_width=3, max_tokens=5, ignore_eos=True)
    for a, b in zip(beams, want_beams):
        assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
        assert all(abs(x.score - y.score) < 1e-4 for x, y in zip(a.sequences, b.sequences))
    assert_no_leak(gpu)


def test_a_traced_request_on_the_gpu_path_reports_as_the_reference_path(tiny_gguf, graphs_on_cpu):
    """``nextoken explain``'s trace (each layer's residual and attention, each step's candidates;
    the traced steps run eagerly, outside the graphs) from the GPU path: the reference path's
    report, numbers within 1e-4, times aside."""
    from nextoken.trace.explain import explain_report, recorder_for

    def report(llm):
        tracer = recorder_for(llm.config)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        with torch.device("meta"):
            for _ in llm.stream(PROMPTS[0], params, tracer=tracer):
                pass
        return explain_report(tracer, llm.tokenizer, llm.config, 5)

    def same(a, b, where="report"):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                if "second" not in k:
                    same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}[{i}]")
        elif isinstance(a, float):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (where, a, b)
        else:
            assert a == b, (where, a, b)

    path = str(tiny_gguf["llama"][0])
    same(report(LLM(path, **GPU_PATH, **SMALL)), report(LLM(path, **REFERENCE, **SMALL)))


def test_int8_cache_on_the_gpu_path_equals_the_cpu_int8_cache(tiny_gguf):
    """``--kv-cache-dtype int8``: the Triton kernel reads the same codes and scales the CPU's
    attention dequantizes, so the float32 log-probabilities agree."""
    path = str(tiny_gguf["qwen2"][0])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = LLM(path, **REFERENCE, kv_cache_dtype="int8", **SMALL).generate(PROMPTS[:3], params)
    got = LLM(path, **GPU_PATH, kv_cache_dtype="int8", **SMALL).generate(PROMPTS[:3], params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x.keys() & y.keys())


def test_bf16_on_the_gpu_path_stays_in_the_float32_top5(tiny_gguf):
    """bf16 on the Triton path: every greedy token is among the float32 reference's five most
    likely at its step (the issue's bf16 criterion, here against our float32 reference)."""
    path = str(tiny_gguf["qwen2"][0])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = LLM(path, **GPU_PATH, **{**SMALL, "dtype": "bfloat16"}).generate(PROMPTS[:2], params)
    ref = LLM(path, **REFERENCE, **SMALL)
    for prompt, out in zip(PROMPTS[:2], got):
        ids = out.outputs[0].token_ids
        top5 = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
        for i, t in enumerate(ids):
            alt = ref.generate([prompt + list(ids[:i])], top5)[0].outputs[0].logprobs[0]
            assert t in alt, (i, t, alt)


def test_decodes_with_rope_silu_and_the_norms_inside_the_gemv_answer_as_without(tiny_gguf, graphs_on_cpu, monkeypatch):
    """A bf16 Qwen 2 on the GPU plan's own kernels (row-wise, fused projections, GEMV) through the
    decode graphs' static buffers: its decodes take RoPE with the cache's write inside the q/k/v
    GEMV, SiLU inside the down projection's, and the residual add and RMSNorm after the o and
    down projections inside theirs (one launch each a layer instead of two), and its greedy
    tokens and log-probabilities are those of the same engine with each in launches of its own."""
    path = str(tiny_gguf["qwen2"][0])
    if not ON_GPU:  # (a GPU's plan turns them on itself, where they time faster)
        choose = plan_module.ExecutionPlan.choose.__func__
        monkeypatch.setattr(plan_module.ExecutionPlan, "choose", classmethod(lambda cls, *a, **k: dataclasses.replace(
            choose(cls, *a, **k), rowwise=True, fused=True, gemv=True)))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    kw = dict(GPU_PATH, **{**SMALL, "dtype": "bfloat16", "max_num_seqs": 1})
    fused = LLM(path, **kw)
    model = fused.engine.runner.model
    if not ON_GPU:
        assert all(m.self_attn.qkv.rope_rows and m.mlp.down_proj.silu_rows and m.mlp.down_proj.norm_rows
                   and m.self_attn.o_proj.norm_rows for m in model.layers)
    import nextoken.kernels.gpu.gemv as gemv_module
    import nextoken.models.llama as llama

    taken, joined = [], []
    monkeypatch.setattr(llama, "qkv_rope", lambda *args, _f=llama.qkv_rope: taken.append(_f(*args)) or taken[-1])
    monkeypatch.setattr(gemv_module, "gemv_add_norm", lambda *a, _f=gemv_module.gemv_add_norm, **k: joined.append(
        a[0].shape[0]) or _f(*a, **k))
    got = generate_on_meta(fused, PROMPTS[:2], params)
    # (3 decode steps a prompt, and the second prompt's 3-token prefill: at most 4 rows, it takes them too;
    # two joins a layer, o's and down's, whose last joins the final norm)
    assert ON_GPU or sum(y is not None for y in taken) == 7 * len(model.layers)
    assert ON_GPU or len(joined) == 7 * 2 * len(model.layers)
    for m in model.layers:
        m.self_attn.qkv.rope_rows = m.mlp.down_proj.silu_rows = m.mlp.down_proj.norm_rows = 0
        m.self_attn.o_proj.norm_rows = 0
    want = generate_on_meta(fused, PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        for x, y in zip(a.logprobs, b.logprobs):
            assert all(abs(x[t] - y[t]) < 2e-2 for t in x.keys() & y.keys())


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from tests.tiny_models import tiny_hf_model, write_gguf

    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"
    write_gguf(tiny_hf_model("qwen3"), path, "qwen3")
    return str(path)


@pytest.mark.parametrize("arch", ["qwen3", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_batch_invariant_mode_gives_a_request_the_same_bits_in_any_batch(tiny_gguf, tiny_qwen3, graphs_on_cpu, arch):
    """``batch_invariant`` in bf16 on the GPU path (Triton matmul, RMSNorm and attention; Qwen 3:
    QK-norm and an untied head; Gemma 3: its norms and sliding-window rings, whose prefill chunks
    read the ring and the pass's own keys): a request alone, and in a batch whose prompts are cut
    into other chunks (16 tokens a step), with decode batches padded through the graphs' buffers
    and a cache too small for both (one is preempted and recomputed), gets the same tokens and
    log-probabilities to the last bit; the plan line says what runs. (Gemma 3's six layers take
    16 s under the interpreter: it runs with ``-m slow`` and in benchmarks/gpu_check.py's GPU
    tests, which take the slow ones; its kernels' aligned switch is tested in
    test_triton_attention.py either way.)"""
    path = tiny_qwen3 if arch == "qwen3" else str(tiny_gguf[arch][0])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
    llm = LLM(path, **GPU_PATH, **{**SMALL, "dtype": "bfloat16", "num_kv_blocks": 8}, max_num_batched_tokens=16,
              batch_invariant=True)
    plan = llm.engine.runner.plan.describe(llm.engine.runner.model)
    assert "batch-invariant triton" in plan and "Triton norms (batch-invariant" in plan, plan
    prompts = [PROMPTS[1], PROMPTS[2][:24]]  # 3 tokens, then 24: chunks of 16, 8 alone, of 13, 11 in the batch
    batch = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler_stats().num_preemptions > 0
    alone = llm.generate([prompts[1]], params)[0].outputs[0]  # (its decodes: alone, in a padded batch of 2)
    assert alone.token_ids == batch[1].token_ids and alone.logprobs == batch[1].logprobs
    assert_no_leak(llm)


def test_batch_invariant_float32_equals_the_reference_path(tiny_gguf):
    """In float32 the batch-invariant path computes the reference's function: the CPU's
    PyTorch path's tokens and log-probabilities (to 1e-4)."""
    path = str(tiny_gguf["llama"][0])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = LLM(path, **REFERENCE, **SMALL).generate(PROMPTS[:3], params)
    got = LLM(path, **GPU_PATH, **SMALL, batch_invariant=True).generate(PROMPTS[:3], params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_batch_invariant_refusals(tiny_gguf):
    """What the batch-invariant mode does not cover is refused at load, naming the option."""
    llama = str(tiny_gguf["llama"][0])
    with pytest.raises(InvalidRequest, match="--batch-invariant: it is the GPU path's") as e:
        LLM(llama, device="cpu", batch_invariant=True)  # (the CPU's own path, also on a machine with a GPU)
    assert e.value.field == "batch_invariant"
    with pytest.raises(InvalidRequest, match="reference attention"):
        LLM(llama, **GPU_PATH, batch_invariant=True, reference_attention=True)
    with pytest.raises(InvalidRequest, match="LoRA"):
        LLM(llama, **GPU_PATH, batch_invariant=True, enable_lora=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU answers")
def test_device_and_backend_errors(tiny_gguf, monkeypatch):
    """A GPU PyTorch does not see, and Triton attention outside its interpreter on the CPU, are
    errors that say what to do; ``auto`` on this machine is the CPU, and the plan says why."""
    path = str(tiny_gguf["llama"][0])
    with pytest.raises(InvalidRequest, match="device cuda: .*--device cpu"):
        LLM(path, device="cuda")
    with pytest.raises(InvalidRequest, match="device"):
        LLM(path, device="gpu")
    with pytest.raises(InvalidRequest, match="gpu_memory_utilization"):
        LLM(path, gpu_memory_utilization=1.5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidRequest, match="TRITON_INTERPRET=1"):
        LLM(path, attention_backend="triton")
    llm = LLM(path, **SMALL)
    assert llm.engine.runner.plan.describe(llm.engine.runner.model).startswith("execution plan: device cpu (")


def test_capture_sizes():
    """vLLM's default sizes: 1, 2, 4, then multiples of 8 up to the first that holds the batch."""
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]


def test_batch_defaults_follow_the_device(tiny_gguf):
    """``max_num_seqs`` and ``max_num_batched_tokens`` left unset take the device's defaults:
    the CPU's 64 and 2048; on a GPU vLLM's API server's (its ``EngineArgs.get_batch_defaults``):
    1024 and 8192 from 70 GiB (an H100 80GB reports 79.1 GiB), 256 and 2048 below it and on an
    A100 of any size. A value the caller gave is kept."""
    def gpu(name, gib):
        return Device(torch.device("cuda", 0), name, "asked for", 132, int(gib * 2**30))

    assert batch_defaults(gpu("NVIDIA H200", 139.8))[:2] == (1024, 8192)
    assert batch_defaults(gpu("NVIDIA H100 80GB HBM3", 79.1))[:2] == (1024, 8192)
    assert batch_defaults(gpu("NVIDIA A100-SXM4-80GB", 79.2))[:2] == (256, 2048)
    assert batch_defaults(gpu("NVIDIA L4", 22.0))[:2] == (256, 2048)
    assert batch_defaults(CPU)[:2] == (64, 2048)
    args = with_batch_defaults(EngineArgs(max_num_seqs=8), gpu("NVIDIA H200", 139.8))
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (8, 8192)
    args = with_batch_defaults(EngineArgs(max_num_batched_tokens=512), gpu("NVIDIA L4", 22.0))
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (256, 512)
    engine = LLM(str(tiny_gguf["llama"][0]), dtype="float32", max_model_len=64, device="cpu").engine
    assert (engine.scheduler_config.max_num_seqs, engine.scheduler_config.max_num_batched_tokens) == (64, 2048)
    assert (engine.args.max_num_seqs, engine.args.max_num_batched_tokens) == (64, 2048)


def test_decodes_beyond_the_captured_sizes_run_eagerly(tiny_gguf, graphs_on_cpu, monkeypatch):
    """Graphs are captured for at most `MAX_GRAPH_BATCH` decodes (vLLM's 512; here 2): a step of
    more decodes runs the model eagerly, with the reference path's tokens."""
    monkeypatch.setattr(engine_module, "MAX_GRAPH_BATCH", 2)
    path = str(tiny_gguf["llama"][0])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 3, 5, 6)]  # (4 to 1 decodes)
    want = [o.outputs[0].token_ids for o in LLM(path, **REFERENCE, **SMALL).generate(PROMPTS[:4], params)]
    llm = LLM(path, **GPU_PATH, **SMALL)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 2]
    replayed, run = [], graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch, fed=None: replayed.append(batch.num_seqs) or run(batch, fed))
    assert [o.token_ids for o in generate_on_meta(llm, PROMPTS[:4], params)] == want
    assert sorted(set(replayed)) == [1, 2]  # (the steps of 3 and 4 decodes ran eagerly)
