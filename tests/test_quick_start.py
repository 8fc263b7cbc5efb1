"""The quick start (`nextoken.runner.quick_start`): the first token of ``nextoken run`` drawn by
our C kernels before PyTorch is imported, against the model's PyTorch layers on the same codes,
the float32 model, and the engine that continues after it; its sampler against ours."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from nextoken.engine_args import EngineArgs
from nextoken.loader.gguf import GGUFFile, read_model_config
from nextoken.runner import quick_start
from nextoken.runner.model_runner import ModelRunner
from nextoken.sampling_params import SamplingParams
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

QUANT = {"token_embd.weight": "Q8_0", "output.weight": "Q4_1", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1",
         "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_0", "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q8_0",
         "ffn_down.weight": "Q4_0"}
VOCAB = 288  # the tiny vocabulary padded to whole 16-row tiles: the embedding is kept as codes
PROMPT = [5, 17, 200, 33, 41, 270, 90, 12, 7, 7, 150, 64, 3, 99, 240, 18, 18, 61, 22, 23]


@pytest.fixture(scope="module")
def quick_models(tmp_path_factory):
    """``{arch: path}``: tiny quantized llama (tied head) and qwen2 (biases, own head) GGUF files
    whose prepared-weights cache a first load has written."""
    d = tmp_path_factory.mktemp("quick")
    out = {}
    for arch in ("llama", "qwen2"):
        hf = tiny_hf_model(arch, seed=7, vocab_size=VOCAB)
        with torch.no_grad():  # sharp attention, so that positions (RoPE) and every key matter
            for layer in hf.model.layers:
                layer.self_attn.q_proj.weight.mul_(12)
                layer.self_attn.k_proj.weight.mul_(12)
        path = d / f"quick-{arch}.gguf"
        write_gguf(hf, path, arch, quant=QUANT)
        ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True)  # writes the cache
        assert quick_start.prepared_path(str(path)).is_file()
        out[arch] = str(path)
    return out


def close(a: np.ndarray, b: torch.Tensor, tol: float) -> None:
    """Logits agree to `tol` of their spread, with the same greedy token."""
    b = b.float().numpy()
    assert float(np.abs(a - b).max()) <= tol * float(b.std()), float(np.abs(a - b).max())
    assert int(a.argmax()) == int(b.argmax())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [1, 20, 300])  # 300: two chunks of the prompt pass
def test_prompt_logits_match_the_pytorch_layers(quick_models, arch, n, monkeypatch):
    """The prompt through ``decode_layers`` (rows as causal positions) against the prefill of the
    PyTorch layers on the same codes: bit for bit for one token, else to bf16 rounding (the
    engine's own prefill and decode paths differ by 2.4-4.7% of the logits' spread on these
    models; the bound is 8%); and against the float32 model to quantization."""
    monkeypatch.setattr(quick_start, "CHUNK", 256)
    path = quick_models[arch]
    ids = (PROMPT * 20)[:n]
    f = GGUFFile(path)
    quick = quick_start.prompt_logits(f, read_model_config(f), ids)
    assert quick is not None and quick.shape == (VOCAB,) and quick.dtype == np.float32
    plain = ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True)
    f32 = ModelRunner(GGUFFile(path), torch.float32)
    prefill = OneSequence(plain, capacity=512).forward(ids)
    if n == 1:  # no attention to mix: the same roundings everywhere
        assert np.array_equal(quick, prefill.float().numpy())
    close(quick, prefill, 0.08)
    close(quick, OneSequence(f32, capacity=512).forward(ids), 0.15)


def test_first_token_is_the_engines_greedy_token_and_text(quick_models):
    from nextoken import LLM

    path = quick_models["qwen2"]
    params = SamplingParams(temperature=0, max_tokens=4)
    first = quick_start.first_token("ab cd", EngineArgs(model=path), params, chat=True)
    assert first is not None and not first.finished
    llm = LLM(path, max_num_seqs=1)
    out = llm.generate(llm.render_chat([{"role": "user", "content": "ab cd"}]), params)[0]
    assert first.prompt_ids == out.prompt_token_ids  # the chat template and tokenizer, as the engine's
    assert first.token == out.outputs[0].token_ids[0]
    assert out.outputs[0].text.startswith(first.text)
    ended = quick_start.first_token("ab cd", EngineArgs(model=path), dataclasses.replace(params, max_tokens=1),
                                    chat=True)
    assert ended.finished and ended.token == first.token


@pytest.mark.parametrize("engine,params", [
    (dict(dtype="float32"), {}), (dict(enforce_eager=True), {}), (dict(kv_cache_dtype="int8"), {}),
    (dict(prepared_cache=False), {}), ({}, dict(repetition_penalty=1.2)), ({}, dict(stop=["x"])),
    ({}, dict(logprobs=2)), ({}, dict(min_tokens=2)), ({}, dict(logit_bias={3: 1.0})), ({}, dict(n=2)),
    ({}, dict(max_tokens=10_000)),  # longer than the context: the engine says so
])
def test_settings_it_does_not_take_leave_it_to_the_engine(quick_models, engine, params):
    path = quick_models["llama"]
    p = SamplingParams(**{"temperature": 0, "max_tokens": 3, **params})
    assert quick_start.first_token("ab", EngineArgs(model=path, **engine), p, chat=False) is None

    assert quick_start.first_token("ab", EngineArgs(model=path), SamplingParams(temperature=0, max_tokens=3),
                                   chat=False) is not None


def test_a_long_prompt_is_left_to_the_engine(quick_models, monkeypatch):
    """Past `MAX_PROMPT_TOKENS` the engine's prefill kernels are the faster way."""
    path, p = quick_models["llama"], SamplingParams(temperature=0, max_tokens=3)
    prompt = "ab cd ef gh ij kl"
    n = len(quick_start.first_token(prompt, EngineArgs(model=path), p, chat=False).prompt_ids)
    monkeypatch.setattr(quick_start, "MAX_PROMPT_TOKENS", n - 1)
    assert quick_start.first_token(prompt, EngineArgs(model=path), p, chat=False) is None
    monkeypatch.setattr(quick_start, "MAX_PROMPT_TOKENS", n)
    assert quick_start.first_token(prompt, EngineArgs(model=path), p, chat=False) is not None


def test_no_cache_or_another_architecture_leaves_it_to_the_engine(tmp_path, tiny_gguf):
    fresh = tmp_path / "fresh.gguf"
    write_gguf(tiny_hf_model("llama", seed=11, vocab_size=VOCAB), fresh, "llama", quant=QUANT)  # never loaded
    p = SamplingParams(temperature=0, max_tokens=3)
    assert quick_start.first_token("ab", EngineArgs(model=str(fresh)), p, chat=False) is None
    gemma = str(tiny_gguf["gemma3"][0])
    ModelRunner(GGUFFile(gemma), torch.bfloat16, prepared_cache=True)
    assert quick_start.first_token("ab", EngineArgs(model=gemma), p, chat=False) is None


def test_it_runs_without_pytorch(quick_models):
    code = ("import sys\n"
            "from nextoken.engine_args import EngineArgs\n"
            "from nextoken.sampling_params import SamplingParams\n"
            "from nextoken.runner.quick_start import first_token\n"
            f"t = first_token('ab cd', EngineArgs(model={quick_models['llama']!r}), "
            "SamplingParams(temperature=0.8, max_tokens=1, seed=5), chat=True)\n"
            "assert t is not None and t.finished\n"
            "assert 'torch' not in sys.modules, 'PyTorch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_run_prints_the_quick_token_and_the_engine_goes_on(quick_models):
    from nextoken import LLM

    path = quick_models["qwen2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "nextoken", "run", "ab cd", "--model", path, "--raw", "--max-tokens", "6",
            "--temperature", "0", "--log-level", "info"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "quick start: first token" in r.stderr
    first = quick_start.first_token("ab cd", EngineArgs(model=path), SamplingParams(temperature=0, max_tokens=6),
                                    chat=False)
    llm = LLM(path, max_num_seqs=1)  # what the command does after the first token
    llm.engine.import_prefix(first.prompt_ids, first.kv.k, first.kv.v)
    rest = llm.generate(first.prompt_ids + [first.token], SamplingParams(temperature=0, max_tokens=5))[0]
    assert r.stdout == first.text + rest.outputs[0].text + "\n"
    off = subprocess.run([*args, "--no-quick-start"], capture_output=True, text=True, timeout=300, env=env)
    assert off.returncode == 0 and "quick start" not in off.stderr


def test_imported_prefix_is_the_engines_own_keys_and_values(quick_models):
    """The prompt's keys and values land in the engine's layout (block j: positions 16 j on),
    agree with what the PyTorch layers write for the same prompt, and a request that starts
    with the prompt takes its full blocks from the prefix cache instead of computing them."""
    from nextoken import LLM
    from nextoken.kv_cache.block_pool import hash_block

    path = quick_models["qwen2"]
    ids = (PROMPT * 3)[:40]  # two full blocks and a part
    f = GGUFFile(path)
    cfg = read_model_config(f)
    kv = quick_start.PromptKV(cfg, len(ids), 16)
    assert quick_start.prompt_logits(f, cfg, ids, kv) is not None
    plain = ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True)
    OneSequence(plain).forward(ids)
    for ours, theirs in ((kv.k, plain.kv.k), (kv.v, plain.kv.v)):
        got = torch.from_numpy(ours).view(torch.bfloat16).float()
        want = theirs[:, :, : ours.shape[2]].float().clone()
        want[:, :, -1, len(ids) % 16 :] = 0  # positions past the prompt: never written
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
    llm = LLM(path, max_num_seqs=1)
    assert llm.engine.import_prefix(ids, kv.k, kv.v) == 32
    first = hash_block(None, tuple(ids[:16]))
    for j, h in enumerate((first, hash_block(first, tuple(ids[16:32])))):
        b = llm.engine.kv.pool.cached[h]  # block j of the prompt, wherever the pool put it
        for ours, theirs in ((kv.k, llm.runner.kv.k), (kv.v, llm.runner.kv.v)):
            assert torch.equal(theirs[:, :, b.block_id], torch.from_numpy(ours[:, :, j]).view(torch.bfloat16))
    out = llm.generate(ids + [7], SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.metrics.num_cached_tokens == 32
    assert llm.engine.import_prefix(ids, kv.k, kv.v) == 0  # cached already: nothing taken
    other = LLM(path, max_num_seqs=1, enable_prefix_caching=False)
    assert other.engine.import_prefix(ids, kv.k, kv.v) == 0


@pytest.mark.parametrize("rope_dim,base", [(64, 100000.0), (128, 1000000.0), (16, 10000.0), (32, 500000.0)])
def test_rope_frequencies_are_the_models(rope_dim, base):
    from nextoken.layers.rotary import inv_frequencies

    ours = quick_start.inv_frequencies(rope_dim, base)
    assert ours.dtype == np.float32
    np.testing.assert_array_max_ulp(ours, inv_frequencies(rope_dim, base).numpy(), maxulp=1)


def test_filter_mask_is_the_samplers():
    from nextoken.sample.sampler import filter_mask

    rng = np.random.default_rng(0)
    for top_k, top_p, min_p in [(-1, 1.0, 0.0), (5, 1.0, 0.0), (-1, 0.7, 0.0), (-1, 1.0, 0.1), (8, 0.9, 0.05)]:
        for _ in range(20):
            logits = (rng.standard_normal(64) * 3).astype(np.float32)
            ours = quick_start.filter_mask(logits, top_k, top_p, min_p)
            theirs = filter_mask(torch.from_numpy(logits), top_k, top_p, min_p).numpy()
            assert np.array_equal(ours, theirs)


def test_draws_follow_the_samplers_distribution():
    """Over 4000 seeds the first tokens' frequencies are the distribution `Sampler` draws from
    (temperature, top-k, top-p), within 4 standard errors; each seed always draws the same."""
    from nextoken.sample.sampler import Sampler, SamplerRequest

    logits = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -1.0, 2.2, 0.9], dtype=np.float32)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95).validate(8)
    _, probs = Sampler().distribution(torch.from_numpy(logits), SamplerRequest(params, [], [], None))
    n = 4000
    counts = np.bincount([quick_start.sample(logits, dataclasses.replace(params, seed=s)) for s in range(n)],
                         minlength=8)
    p = probs.numpy().astype(np.float64)
    assert np.all(np.abs(counts / n - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-9), (counts / n, p)
    assert quick_start.sample(logits, dataclasses.replace(params, seed=9)) == \
        quick_start.sample(logits, dataclasses.replace(params, seed=9))
