"""The real SmolLM2-135M-Instruct (and Qwen2.5-Coder-0.5B, marked slow) against the reference
generations that `transformers` made from the same GGUF files (tests/data); Qwen2.5-Coder-1.5B
(marked slow) on our kernels against PyTorch alone."""

from __future__ import annotations

import math

import pytest
import torch

from nextoken.catalog import pull
from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner
from tests.conftest import load_reference
from tests.tiny_models import OneSequence


def replay(runner: ModelRunner, gen: dict, cache_dtype: str = "auto"):
    """Teacher-forced replay of a reference generation: prefill the prompt, then feed the
    reference's own tokens; yields (our log-probabilities, reference step) per step."""
    seq = OneSequence(runner, len(gen["prompt_ids"]) + len(gen["steps"]), cache_dtype=cache_dtype)
    logits = seq.forward(gen["prompt_ids"])
    for step in gen["steps"]:
        yield logits.log_softmax(-1), step
        logits = seq.forward([step["token"]])


FLOAT32_TOLERANCE = 5e-5  # the README's claim; measured on SmolLM2: at most 2.8e-5 decoding, 3.2e-5 prefilling


def teacher_forced(runner: ModelRunner, gen: dict, decode_last: int):
    """Like `replay`, but one prefill over the prompt and all but the last `decode_last` reference
    tokens gives the log-probabilities of those steps at once (every position's logits, as
    ``prompt_logprobs`` reads them); the last steps are decodes over that cache. One pass over the
    float32 weights instead of one per step: every position is checked, most through prefill, the
    last `decode_last` through decode."""
    steps = gen["steps"]
    cut = max(len(steps) - decode_last, 1)
    seq = OneSequence(runner, len(gen["prompt_ids"]) + len(steps))
    logits = seq.forward(gen["prompt_ids"] + [s["token"] for s in steps[: cut - 1]], all_logits=True)
    first = len(gen["prompt_ids"]) - 1
    for i in range(cut):
        yield logits[first + i].log_softmax(-1), steps[i]
    for i in range(cut, len(steps)):
        yield seq.forward([steps[i - 1]["token"]]).log_softmax(-1), steps[i]


def check_float32(path, name):
    runner = ModelRunner(GGUFFile(path), torch.float32)
    for gen in load_reference(name)["generations"]:
        greedy = []
        for lp, step in teacher_forced(runner, gen, decode_last=4):
            for tid, ref_lp in step["top5"]:
                assert abs(float(lp[tid]) - ref_lp) < FLOAT32_TOLERANCE, (gen["prompt"], tid)
            greedy.append(int(lp.argmax()))
        assert greedy == gen["greedy_ids"], gen["prompt"]


def test_smollm2_float32_matches_reference(smollm2_path):
    check_float32(smollm2_path, "smollm2-135m-instruct")


def check_bfloat16(path, name, cache_dtype: str = "auto"):
    """The default bf16 path (GGUF codes, int8 activations, the one-call C decode; with
    `cache_dtype` int8, int8 keys and values too): where it picks differently from float32, its
    pick is still one of the reference's five most likely tokens, and its log-probabilities stay
    close (the reference token's within 0.5 nats at every step, and on average)."""
    runner = ModelRunner(GGUFFile(path), torch.bfloat16)
    steps = agree = 0
    errors = []
    for gen in load_reference(name)["generations"]:
        for lp, step in replay(runner, gen, cache_dtype):
            top5 = [t for t, _ in step["top5"]]
            choice = int(lp.argmax())
            assert choice in top5
            errors.append(abs(float(lp[step["token"]]) - step["top5"][0][1]))
            assert errors[-1] < 0.5
            steps += 1
            agree += choice == step["token"]
    # measured on SmolLM2: bf16 cache 186/195 agree, mean error 0.042; int8 cache 183/195, 0.049
    # (189/195, 0.040, worst 0.32 since its keys are rotated, 2026-12-01).
    # Top-1 agreement turns on near-ties: a new summation order in the decode attention kernel
    # (whose output is as close to the float32 reference as before, see test_paged_attention)
    # moved it to 185/195, mean error 0.045; hence a margin of a few flips beside the mean error.
    assert agree / steps > (0.94 if cache_dtype == "auto" else 0.92)
    assert sum(errors) / len(errors) < (0.05 if cache_dtype == "auto" else 0.06)


@pytest.mark.usefixtures("two_threads")  # the C decode's threaded split, as users run it
@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_smollm2_bfloat16_stays_in_reference_top5(smollm2_path, cache_dtype):
    check_bfloat16(smollm2_path, "smollm2-135m-instruct", cache_dtype)


@pytest.mark.slow
def test_qwen2_float32_matches_reference():
    check_float32(pull("qwen2.5-coder-0.5b-instruct", progress=False), "qwen2.5-coder-0.5b-instruct")


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_qwen2_bfloat16_stays_in_reference_top5(cache_dtype):
    """Q5_0 embedding lookups, a Q8_0 head, Q6_K/Q4_K/Q5_0 linears with biases (and Qwen's large
    key biases, the hard case for an int8 cache: a few key channels of 145-213 set the row's
    scale. Unrotated, the format alone put the reference token's log-probability 0.77 nats off at
    its worst step on the float32 reference path, and 0.60 on the bf16 path; with the keys
    rotated (`kv_cache.tensors.hadamard_matrix`) 0.19 and 0.36, mean 0.018 and 0.023, 197 of 199
    steps agreeing on the bf16 path (2026-12-01).)"""
    check_bfloat16(pull("qwen2.5-coder-0.5b-instruct", progress=False), "qwen2.5-coder-0.5b-instruct", cache_dtype)


@pytest.mark.parametrize("mode", ["single", "single-eager", "batched", "batched-dense", "batched-int8kv"])
def test_smollm2_fast_paths_generate_within_reference_top5(smollm2_path, mode):
    """Free-running greedy generations through the whole engine, for each fast path: one stream
    (lone-decode attention, int4 weights only, with our C kernels or PyTorch alone) and
    all prompts batched (the one-call decode over many rows, with or without dense bf16 copies, or
    with an int8 KV cache), our kernels on two threads as users run them. Up to the
    first token where we and the reference differ, the texts are equal; there, each side's token
    is in the other's top 5. (The first 32 tokens of each reference generation: 130 steps in
    all, across three to five 16-token blocks per sequence; on PyTorch alone, whose steps take
    several times ours, the first 16: 85 steps.)"""
    from nextoken.llm import LLM
    from nextoken.sampling_params import SamplingParams

    llm = LLM(str(smollm2_path), num_threads=1 if mode.endswith("eager") else 2,
              max_num_seqs=1 if mode.startswith("single") else 8,
              dense_weights=mode.endswith("dense"), enforce_eager=mode.endswith("eager"),
              kv_cache_dtype="int8" if mode.endswith("int8kv") else "auto")
    gens = load_reference("smollm2-135m-instruct")["generations"]
    steps = 16 if mode.endswith("eager") else 32
    params = [SamplingParams(temperature=0, max_tokens=min(steps, len(g["greedy_ids"])), logprobs=5) for g in gens]
    outs = llm.generate([g["prompt_ids"] for g in gens], params)
    same = total = 0
    for gen, out in zip(gens, outs):
        ours = out.outputs[0]
        for i, ref in enumerate(gen["greedy_ids"][:steps]):
            total += 1
            if i < len(ours.token_ids) and ours.token_ids[i] == ref:
                same += 1
                continue
            assert i < len(ours.token_ids), (gen["prompt"], "stopped early")
            ref_top5 = [t for t, _ in gen["steps"][i]["top5"]]
            our_top5 = sorted(ours.logprobs[i], key=ours.logprobs[i].get, reverse=True)[:5]
            assert ours.token_ids[i] in ref_top5 and ref in our_top5, (mode, gen["prompt"], i)
            break
    assert same / total > 0.5, (mode, same, total)


@pytest.mark.slow
def test_qwen2_1_5b_fast_path_agrees_with_pytorch_alone():
    """Qwen2.5-Coder-1.5B (Q4_K/Q6_K; its first query of a prompt scores about -400 against every
    key, which once turned the C prefill softmax's probabilities to NaN): greedy generations on
    our kernels against PyTorch alone (`enforce_eager`: PyTorch's int4 matmul and attention) on
    raw prompts of 10 to 130 tokens. Every log-probability is finite; up to the first token where
    the two differ the texts are equal, and there each side's token is in the other's top 5."""
    from nextoken.llm import LLM
    from nextoken.sampling_params import SamplingParams

    path = str(pull("qwen2.5-coder-1.5b-instruct", progress=False))
    prompts = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):",
               " ".join(["The quick brown fox jumps over the lazy dog."] * 13), "Paris is the capital of"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    runs = [LLM(path, max_num_seqs=4, max_model_len=512, enforce_eager=eager).generate(prompts, params)
            for eager in (False, True)]
    for fast, eager in zip(*runs):
        a, b = fast.outputs[0], eager.outputs[0]
        assert all(math.isfinite(v) for step in a.logprobs for v in step.values()), fast.prompt
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert x in b.logprobs[i] and y in a.logprobs[i], (fast.prompt, i)
                break
