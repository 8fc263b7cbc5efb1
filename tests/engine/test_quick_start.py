"""The quick start (`nextoken.runner.quick_start`): the answer (or its first tokens) of
``nextoken run`` drawn by our C kernels before PyTorch is imported, against the model's PyTorch
layers on the same codes, the float32 model, `LLM.generate`, and the engine that continues after
it; its sampler against ours."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from nextoken.engine_args import EngineArgs
from nextoken.loader.gguf import GGUFFile, read_model_config
from nextoken.runner import quick_start
from nextoken.runner.model_runner import ModelRunner
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

QUANT = {"token_embd.weight": "Q8_0", "output.weight": "Q4_1", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1",
         "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_0", "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q8_0",
         "ffn_down.weight": "Q4_0"}
VOCAB = 288  # the tiny vocabulary padded to whole 16-row tiles: the embedding is kept as codes
PROMPT = [5, 17, 200, 33, 41, 270, 90, 12, 7, 7, 150, 64, 3, 99, 240, 18, 18, 61, 22, 23]


@pytest.fixture(scope="module")
def quick_models(tmp_path_factory):
    """``{arch: path}``: tiny quantized llama (tied head), qwen2 (biases, own head), qwen3
    (QK-norm, head_dim wider than hidden / heads) and gemma3 (its norms, GeGLU, scaled
    embeddings, 5 sliding-window layers of window 8 with their own RoPE base; Q8_0: its extra
    norms amplify coarser codes' roundings) GGUF files whose prepared-weights cache a first load
    has written."""
    d = tmp_path_factory.mktemp("quick")
    out = {}
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        hf = tiny_hf_model(arch, seed=7, vocab_size=VOCAB)
        with torch.no_grad():  # sharp attention, so that positions (RoPE) and every key matter
            for layer in hf.model.layers if arch != "gemma3" else ():  # (Gemma's QK-norm undoes a scale)
                layer.self_attn.q_proj.weight.mul_(12)
                layer.self_attn.k_proj.weight.mul_(12)
        path = d / f"quick-{arch}.gguf"
        write_gguf(hf, path, arch, quant=QUANT if arch != "gemma3" else dict.fromkeys(QUANT, "Q8_0"))
        ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True)  # writes the cache
        assert quick_start.prepared_path(str(path)).is_file()
        out[arch] = str(path)
    return out


def close(a: np.ndarray, b: torch.Tensor, tol: float, argmax: bool = True) -> None:
    """Logits agree to `tol` of their spread, with the same greedy token (if `argmax`)."""
    b = b.float().numpy()
    assert float(np.abs(a - b).max()) <= tol * float(b.std()), float(np.abs(a - b).max())
    assert not argmax or int(a.argmax()) == int(b.argmax())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("n", [1, 20, 300])  # 300: two chunks of the prompt pass
def test_prompt_logits_match_the_pytorch_layers(quick_models, arch, n):
    """The prompt through ``decode_layers`` (rows as causal positions) against the prefill of the
    PyTorch layers on the same codes: bit for bit for one token, else to bf16 rounding (their
    attention differs: 2.4-4.7% of the logits' spread on these models; the bound is 8%); against
    the float32 model to quantization; and, up to `max_prompt_tokens` (for Gemma's rings here 32),
    bit for bit against the engine's runner, whose prefill of such a step is the same call
    (`NativeDecoder.takes`). Gemma's extra norms amplify bf16 roundings (`test_native_decode`):
    its bounds are 0.3 of the spread against the PyTorch layers and 0.75 against float32, and
    the engine is its tight check."""
    path = quick_models[arch]
    ids = (PROMPT * 20)[:n]
    f = GGUFFile(path)
    cfg = read_model_config(f)
    quick = quick_start.prompt_logits(f, cfg, ids)
    assert quick is not None and quick.shape == (VOCAB,) and quick.dtype == np.float32
    plain = ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True)
    plain.native_decoder = None  # the PyTorch layers
    f32 = ModelRunner(GGUFFile(path), torch.float32)
    prefill = OneSequence(plain, capacity=512).forward(ids)
    if n == 1:  # no attention to mix: the same roundings everywhere
        assert np.array_equal(quick, prefill.float().numpy())
    gemma = arch == "gemma3"
    close(quick, prefill, 0.3 if gemma else 0.08, argmax=not gemma)
    close(quick, OneSequence(f32, capacity=512).forward(ids), 0.75 if gemma else 0.15, argmax=not gemma)
    engine = OneSequence(ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True), capacity=512).forward(ids)
    if n <= quick_start.max_prompt_tokens(cfg, 16):  # (beyond, the engine prefills on its PyTorch layers: above)
        assert np.array_equal(quick, engine.float().numpy())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_first_tokens_are_the_engines_greedy_tokens_and_text(quick_models, arch):
    from nextoken import LLM

    path = quick_models[arch]
    params = SamplingParams(temperature=0, max_tokens=4)
    shown = []
    first = quick_start.first_tokens("ab cd", EngineArgs(model=path), params, chat=True, emit=shown.append)
    assert first is not None and first.finished and len(first.tokens) == 4
    llm = LLM(path, max_num_seqs=1)
    out = llm.generate(llm.render_chat([{"role": "user", "content": "ab cd"}]), params)[0]
    assert first.prompt_ids == out.prompt_token_ids  # the chat template and tokenizer, as the engine's
    assert first.tokens == out.outputs[0].token_ids and first.text == "".join(shown) == out.outputs[0].text
    from nextoken.tokenizer.detokenizer import IncrementalDetokenizer

    for most in (1, 2):
        part = quick_start.first_tokens("ab cd", EngineArgs(model=path), params, chat=True, most=most)
        detok, text = IncrementalDetokenizer(llm.tokenizer), ""
        for token in first.tokens[:most]:
            detok.add_token(token)
            text += detok.emit(False)
        if not text:  # part of a character (Qwen 3's first token here): nothing to show, the engine does it all
            assert part is None
        else:
            assert not part.finished and part.tokens == first.tokens[:most] and part.text == text
            assert out.outputs[0].text.startswith(text)


@pytest.mark.parametrize("seed", [None, 3, 8])
def test_gemma_answers_past_its_window_are_the_engines(quick_models, seed):
    """Gemma 3's answer of 40 tokens, greedy and sampled: past its window of 8 and its engine
    ring of 32 tokens (the engine's ring wraps; the quick start's cache never does, each row's
    window read from ``position - 7``), token for token and in text `LLM.generate`'s."""
    from nextoken import LLM

    path = quick_models["gemma3"]
    params = SamplingParams(temperature=0 if seed is None else 1.0, seed=seed, max_tokens=40, ignore_eos=True)
    first = quick_start.first_tokens("ab cd", EngineArgs(model=path), params, chat=True)
    assert first is not None and first.finished and len(first.tokens) == 40
    llm = LLM(path, max_num_seqs=1)
    out = llm.generate(llm.render_chat([{"role": "user", "content": "ab cd"}]), params)[0]
    assert first.tokens == out.outputs[0].token_ids and first.text == out.outputs[0].text
    assert len(set(first.tokens)) > 5  # (not one token over and over)


def test_a_step_that_fails_hands_the_answer_so_far_to_the_engine(quick_models, monkeypatch):
    """Past the first token a failing step stops the quick start with what it has shown (the
    engine goes on from those tokens: `LLM.generate`'s text), and an error of the printing
    itself (a closed pipe) is the command's, never a reason to start over and print again."""
    from nextoken import LLM

    path, params = quick_models["qwen2"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = quick_start.first_tokens("ab cd", EngineArgs(model=path), params, chat=False)
    calls = []
    logits = quick_start.Forward.logits

    def third_fails(self, ids, start):
        calls.append(start)
        if len(calls) == 3:
            raise OSError("the step failed")
        return logits(self, ids, start)

    monkeypatch.setattr(quick_start.Forward, "logits", third_fails)
    shown = []
    first = quick_start.first_tokens("ab cd", EngineArgs(model=path), params, chat=False, emit=shown.append)
    assert not first.finished and first.tokens == want.tokens[:2] and first.text == "".join(shown)
    monkeypatch.setattr(quick_start.Forward, "logits", logits)
    llm = LLM.from_engine_args(EngineArgs(model=path, max_num_seqs=1), first=first)
    assert "".join(o.outputs[0].delta for o in llm.stream("ab cd", params, first=first)) == want.text

    def closed(text):
        raise BrokenPipeError("stdout is closed")

    with pytest.raises(BrokenPipeError):
        quick_start.first_tokens("ab cd", EngineArgs(model=path), params, chat=False, emit=closed)


@pytest.mark.parametrize("engine,params", [
    (dict(dtype="float32"), {}), (dict(enforce_eager=True), {}), (dict(kv_cache_dtype="int8"), {}),
    (dict(prepared_cache=False), {}), ({}, dict(repetition_penalty=1.2)), ({}, dict(presence_penalty=0.5)),
    ({}, dict(logprobs=2)), ({}, dict(min_tokens=2)), ({}, dict(logit_bias={3: 1.0})), ({}, dict(n=2)),
    ({}, dict(max_tokens=10_000)),  # longer than the context: the engine says so
])
def test_settings_it_does_not_take_leave_it_to_the_engine(quick_models, engine, params):
    path = quick_models["llama"]
    p = SamplingParams(**{"temperature": 0, "max_tokens": 3, **params})
    assert quick_start.first_tokens("ab", EngineArgs(model=path, **engine), p, chat=False) is None

    assert quick_start.first_tokens("ab", EngineArgs(model=path), SamplingParams(temperature=0, max_tokens=3),
                                    chat=False) is not None


def test_a_long_prompt_is_left_to_the_engine(quick_models, monkeypatch):
    """Past `MAX_PROMPT_TOKENS` the engine's prefill kernels are the faster way."""
    path, p = quick_models["llama"], SamplingParams(temperature=0, max_tokens=3)
    prompt = "ab cd ef gh ij kl"
    n = len(quick_start.first_tokens(prompt, EngineArgs(model=path), p, chat=False).prompt_ids)
    monkeypatch.setattr(quick_start, "MAX_PROMPT_TOKENS", n - 1)
    assert quick_start.first_tokens(prompt, EngineArgs(model=path), p, chat=False) is None
    monkeypatch.setattr(quick_start, "MAX_PROMPT_TOKENS", n)
    assert quick_start.first_tokens(prompt, EngineArgs(model=path), p, chat=False) is not None


def test_no_cache_or_another_architecture_leaves_it_to_the_engine(tmp_path, quick_models, monkeypatch):
    fresh = tmp_path / "fresh.gguf"
    write_gguf(tiny_hf_model("llama", seed=11, vocab_size=VOCAB), fresh, "llama", quant=QUANT)  # never loaded
    p = SamplingParams(temperature=0, max_tokens=3)
    assert quick_start.first_tokens("ab", EngineArgs(model=str(fresh)), p, chat=False) is None
    assert quick_start.first_tokens("ab", EngineArgs(model=quick_models["qwen2"]), p, chat=False) is not None
    monkeypatch.setattr("nextoken.kernels.decode_step.QUICK_ARCHITECTURES", ("llama",))
    assert quick_start.first_tokens("ab", EngineArgs(model=quick_models["qwen2"]), p, chat=False) is None


@pytest.mark.subprocess
def test_it_runs_without_pytorch(quick_models):
    code = ("import sys\n"
            "from nextoken.engine_args import EngineArgs\n"
            "from nextoken.sampling_params import SamplingParams\n"
            "from nextoken.runner.quick_start import first_tokens\n"
            f"t = first_tokens('ab cd', EngineArgs(model={quick_models['llama']!r}), "
            "SamplingParams(temperature=0.8, max_tokens=5, seed=5, ignore_eos=True), chat=True)\n"
            "assert t is not None and t.finished and len(t.tokens) == 5\n"
            "assert 'torch' not in sys.modules, 'PyTorch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.subprocess
def test_run_prints_the_quick_answer_or_hands_it_to_the_engine(quick_models):
    """``nextoken run`` prints the whole answer from the quick start (PyTorch never imported);
    where the quick start draws only the first token (a bound on the KV cache: the engine's to
    enforce), the engine's continuation after it, through the typed hand-off
    (`LLM.from_engine_args(args, first=...)`, `LLM.stream(..., first=...)`). Both print
    `LLM.generate`'s text."""
    from nextoken import LLM

    path = quick_models["qwen2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "nextoken", "run", "ab cd", "--model", path, "--raw", "--max-tokens", "6",
            "--temperature", "0", "--log-level", "info"]
    code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_module('nextoken', run_name='__main__')\n"
    whole = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *args[2:]], capture_output=True, text=True,
                           timeout=300, env=env)
    assert whole.returncode == 0, whole.stderr
    assert "quick start: 6 tokens" in whole.stderr
    assert "| nextoken.runner.quick_start" in whole.stderr and not re.search(r"\|\s+torch$", whole.stderr, re.M)
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(path, max_num_seqs=1)
    text = llm.generate([quick_start.first_tokens("ab cd", EngineArgs(model=path), params, chat=False).prompt_ids],
                        params)[0].outputs[0].text
    assert whole.stdout == text + "\n"
    bounded = subprocess.run([*args, "--kv-cache-memory", "4MiB"], capture_output=True, text=True, timeout=300, env=env)
    assert bounded.returncode == 0, bounded.stderr
    assert "quick start: 1 token in" in bounded.stderr and "the engine goes on" in bounded.stderr
    assert "huge pages off: huge_pages=False" in bounded.stderr  # one answer: the weights stay mapped (`cli`)
    assert bounded.stdout == text + "\n"
    first = quick_start.first_tokens("ab cd", EngineArgs(model=path), params, chat=False, most=2)
    llm = LLM.from_engine_args(EngineArgs(model=path, max_num_seqs=1), first=first)  # what the command does
    assert "".join(o.outputs[0].delta for o in llm.stream("ab cd", params, first=first)) == text
    off = subprocess.run([*args, "--no-quick-start"], capture_output=True, text=True, timeout=300, env=env)
    assert off.returncode == 0 and "quick start" not in off.stderr and off.stdout == text + "\n"


def test_the_quick_start_continues_as_generate_for_every_seed(smollm2_path, smollm2_llm):
    """What ``nextoken run --seed S`` does (the first token by the quick start, then the engine
    from it: `LLM.stream(..., first=...)`) gives `LLM.generate`'s text for 20 seeds (generated
    in one batch: a row's tokens do not depend on its batch, `test_engine`): the prompt's
    logits are the engine's bit for bit, one stream of draws per seed (`sample.rng`), one draw
    kernel (`sample.draw`). (`first_tokens` itself for three seeds; it reads the GGUF file each
    time, so the other seeds draw from its logits as it does.)"""
    from nextoken.kernels import load
    from nextoken.sample.draw import draw_one
    from nextoken.sample.rng import DrawGenerator

    llm = smollm2_llm  # its load wrote the prepared cache
    prompt = "Once upon a time in a quiet village,"
    f = GGUFFile(smollm2_path)
    ids = llm.tokenizer.encode(prompt)
    rid = llm.engine.add_request(ids, SamplingParams(max_tokens=1), options=RequestOptions(return_logits=True))
    engine_row = llm.engine.run_until_finished([rid])[0].logits[0].float().numpy()
    quick_row = quick_start.prompt_logits(f, read_model_config(f), ids)
    assert np.array_equal(quick_row, engine_row)
    seeds = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5, seed=seed) for seed in range(20)]
    generated = [o.outputs[0].text for o in llm.generate([prompt] * len(seeds), seeds)]  # one batch
    for seed, params in enumerate(seeds):
        token = draw_one(load("sampling"), quick_row, params.validate(len(quick_row)), DrawGenerator(seed).uniform())
        first = quick_start.FirstTokens(ids, [token], llm.tokenizer.decode([token]), False, draws=1)
        if seed < 3:
            first = quick_start.first_tokens(prompt, EngineArgs(model=str(smollm2_path)), params, chat=False, most=1)
            assert first is not None and (first.prompt_ids, first.tokens) == (ids, [token])
        text = "".join(o.outputs[0].delta for o in llm.stream(prompt, params, first=first))
        assert text == generated[seed], seed


def test_the_quick_answers_are_generates(smollm2_path, smollm2_llm):
    """The quick start's whole answers (prompt, then one decode step a token, each over the keys
    and values of the steps before) are `LLM.generate`'s token for token on SmolLM2: greedy and
    three seeds, 24 tokens each; ended by a stop string (with and without it in the text) and by
    a stop token as the engine ends them; and handed to the engine after 7 tokens the
    continuation is the same too."""
    prompt = "Once upon a time in a quiet village,"
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] + \
        [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=24, seed=seed, ignore_eos=True) for seed in range(3)]
    generated = smollm2_llm.generate([prompt] * len(params), params)
    args = EngineArgs(model=str(smollm2_path))
    for p, want in zip(params, generated):
        quick = quick_start.first_tokens(prompt, args, p, chat=False)
        assert quick is not None and quick.finished and quick.draws == (0 if p.greedy else 24)
        assert (quick.tokens, quick.text) == (want.outputs[0].token_ids, want.outputs[0].text), p.seed
    greedy = generated[0].outputs[0]
    word = greedy.text.split()[len(greedy.text.split()) // 2]  # a stop string from the middle of the answer
    ends = [dataclasses.replace(params[0], stop=[word]), dataclasses.replace(params[0], stop=[word, "zz"],
                                                                             include_stop_str_in_output=True),
            dataclasses.replace(params[0], stop_token_ids=[greedy.token_ids[9]])]
    for p, want in zip(ends, smollm2_llm.generate([prompt] * len(ends), ends)):
        shown = []
        quick = quick_start.first_tokens(prompt, args, p, chat=False, emit=shown.append)
        assert want.outputs[0].finish_reason == "stop" and len(want.outputs[0].token_ids) < 24
        assert quick.finished and (quick.tokens, quick.text) == (want.outputs[0].token_ids, want.outputs[0].text)
        assert "".join(shown) == quick.text
    first = quick_start.first_tokens(prompt, args, params[3], chat=False, most=7)
    assert not first.finished and first.tokens == generated[3].outputs[0].token_ids[:7]
    text = "".join(o.outputs[0].delta for o in smollm2_llm.stream(prompt, params[3], first=first))
    assert text == generated[3].outputs[0].text


@pytest.mark.subprocess
def test_run_with_a_seed_prints_what_generate_gives(smollm2_path, smollm2_llm):
    """The command itself, on the case that once differed (seed 5: the quick start drew from the
    decode kernel's logits while the engine prefilled with its PyTorch layers)."""
    flags = ["--raw", "--temperature", "0.8", "--top-p", "0.9", "--max-tokens", "12", "--seed", "5"]
    prompt = "Once upon a time in a quiet village,"
    r = subprocess.run([sys.executable, "-m", "nextoken", "run", prompt, "--model", str(smollm2_path), *flags,
                        "--log-level", "info"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr
    assert "quick start: 12 tokens" in r.stderr
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=5)
    assert r.stdout == smollm2_llm.generate(prompt, params)[0].outputs[0].text + "\n"


def test_prompt_keys_and_values_are_the_engines(quick_models):
    """The decode step run over the prompt writes its keys and values in the engine's layout
    (block j: positions 16 j on), and they agree with what the PyTorch layers write for it."""
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


def test_prepared_file_holds_what_the_model_holds(quick_models):
    """The quick start reads the model's own tensors from the prepared file: RoPE's frequencies,
    norms and biases bit for bit as the engine's model holds them (no second computation)."""
    from nextoken.loader.prepared import PREPARED_INV_FREQ, PreparedFile, file_key

    path = quick_models["qwen2"]
    runner = ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True)
    f = PreparedFile(str(quick_start.prepared_path(path)), file_key(path))
    model = runner.model
    assert np.array_equal(f.array(PREPARED_INV_FREQ), model.inv_freq.numpy())
    layer = model.layers[1]
    for name, t in (("blk.1.attn_norm.weight", layer.input_layernorm), ("output_norm.weight", model.norm),
                    ("blk.1.attn_q.bias", layer.self_attn.q_proj.bias)):
        assert f.dtype(name) == "BF16" and np.array_equal(f.array(name), t.view(torch.int16).numpy().view(np.uint16))


def test_draw_is_the_samplers():
    """The quick token for a seed is the token `Sampler` draws with that seed's stream (the same
    kernel, the same first uniform number), and over 4000 seeds the draws follow the sampler's
    distribution (temperature, top-k, top-p) within 4 standard errors."""
    from nextoken.kernels import load
    from nextoken.sample.draw import draw_one
    from nextoken.sample.rng import DrawGenerator
    from nextoken.sample.sampler import Sampler, SamplerRequest, make_generator

    lib = load("sampling")
    logits = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -1.0, 2.2, 0.9], dtype=np.float32)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95).validate(8)
    sampler = Sampler(kernel=lib)
    for s in range(50):
        engine = sampler(torch.from_numpy(logits)[None], [SamplerRequest(params, [], [], make_generator(s))])[0]
        assert draw_one(lib, logits, params, DrawGenerator(s).uniform()) == engine.token
    _, probs = Sampler().distribution(torch.from_numpy(logits), SamplerRequest(params, [], [], None))
    n = 4000
    counts = np.bincount([draw_one(lib, logits, params, DrawGenerator(s).uniform()) for s in range(n)], minlength=8)
    p = probs.numpy().astype(np.float64)
    assert np.all(np.abs(counts / n - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-9), (counts / n, p)


def test_a_new_option_keeps_the_quick_start_off_until_marked():
    """Eligibility comes from the fields' ``quick_start`` marks (`keeps_first_token`): an option
    added to `SamplingParams` or `EngineArgs` without a mark turns the quick start off as soon as
    it leaves its default; marked ones take the values their mark allows."""
    from nextoken.cli_args import opt

    @dataclasses.dataclass
    class NewParams(SamplingParams):
        new_knob: int = 0

    @dataclasses.dataclass
    class NewArgs(EngineArgs):
        new_flag: bool = opt(False, "a new engine option")
        new_marked: int = opt(1, "a new option that does not change the first token", quick_start=True)

    assert quick_start.keeps_first_token(NewParams(temperature=0.3, seed=5, max_tokens=9))
    assert not quick_start.keeps_first_token(NewParams(new_knob=1))
    assert quick_start.keeps_first_token(NewArgs(max_num_seqs=1, num_threads=2, new_marked=7, dtype="bf16"))
    assert not quick_start.keeps_first_token(NewArgs(new_flag=True))
    assert not quick_start.keeps_first_token(NewArgs(dtype="float32"))  # outside its mark's values
    assert not quick_start.keeps_first_token(EngineArgs(device="cuda"))
    assert quick_start.keeps_first_token(EngineArgs(huge_pages=False))  # `run`'s default: where the weights live
