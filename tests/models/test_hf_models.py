"""Hugging Face model folders: for every architecture, a tiny random `transformers` model saved with
`save_pretrained` (safetensors, tokenizer.json); our float32 logits equal transformers' for
prefill and decode. Also sharded weights, dtype from the config, the tokenizer and chat template
from the folder, hub ids from a huggingface_hub cache the test lays out, and the load errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.errors import ModelLoadError
from nextoken.loader.hf import HFModelDir
from nextoken.runner.device import resolve_device
from nextoken.runner.model_runner import ModelRunner
from tests.tiny_models import CHATML, VOCAB_SIZE, OneSequence, tiny_hf_model, tiny_vocab

PROMPT = [5, 17, 200, 33, 41, 270, 90, 12, 7, 150, 3, 99, 64, 18]
CONTINUATION = [44, 61, 2, 130, 8]


def tiny_hf(arch: str):
    """A random float32 transformers model of `arch` with 2 layers (6 for gemma3)."""
    import transformers

    if arch in ("llama", "qwen2", "qwen3", "gemma3"):
        return tiny_hf_model(arch)
    torch.manual_seed(1)
    if arch == "mistral":  # every layer slides over 8 keys, shorter than the prompt
        cfg = transformers.MistralConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, sliding_window=8, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=128)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # random norms and biases, so that every weight matters
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def save_tokenizer(path) -> None:
    """tokenizer.json (the tiny byte-level BPE) and tokenizer_config.json with a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, types, merges = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                   "add_bos_token": False, "chat_template": CHATML}, f)


def save_folder(model, path, **kw) -> str:
    model.save_pretrained(path, safe_serialization=True, **kw)
    save_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for arch in ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt2"):
        model = tiny_hf(arch)
        out[arch] = (save_folder(model, d / arch), model)
    return out


def hf_stepwise(model, prompt, continuation):
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        full, logits, past = out.logits[0], [], out.past_key_values
        for t in continuation:
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0, -1])
            past = out.past_key_values
    return full, logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt2"])
@pytest.mark.parametrize("attention", ["fast", "reference", "triton"])
def test_folder_logits_equal_transformers(folders, arch, attention):
    """Every architecture, on each attention path: the CPU's, the float32 reference, and the
    GPU's Triton kernel (here under Triton's interpreter, PyTorch for the rest, as on a GPU)."""
    path, hf = folders[arch]
    triton = attention == "triton"
    on_gpu = triton and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"  # (gpu_check.py)
    runner = ModelRunner(HFModelDir(path), torch.float32, reference=attention == "reference",
                         enforce_eager=triton and not on_gpu, attention_backend="triton" if triton else "auto",
                         device=resolve_device("cuda" if on_gpu else "cpu"))
    assert runner.plan.attention == {"fast": "native", "reference": "reference", "triton": "triton"}[attention]
    assert runner.config.architecture == arch
    full, steps = hf_stepwise(hf, PROMPT, CONTINUATION)
    seq = OneSequence(runner, 64, block_size=4)
    got = seq.forward(PROMPT, all_logits=True).cpu()
    assert (got - full).abs().max() < 1e-4
    for i, t in enumerate(CONTINUATION):
        assert (seq.forward([t]).cpu() - steps[i]).abs().max() < 1e-4, f"decode step {i}"


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gpt2"])
def test_folder_greedy_through_the_engine(folders, arch):
    """Batched engine generation equals transformers' greedy generate."""
    path, hf = folders[arch]
    llm = LLM(path, dtype="float32", block_size=4, max_num_seqs=3)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:] * 2]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()


def test_sharded_weights_load_like_one_file(folders, tmp_path):
    path, hf = folders["qwen2"]
    sharded = save_folder(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    a = OneSequence(ModelRunner(HFModelDir(path), torch.float32), 32, 4).forward(PROMPT)
    b = OneSequence(ModelRunner(HFModelDir(sharded), torch.float32), 32, 4).forward(PROMPT)
    assert torch.equal(a, b)


def test_dtype_comes_from_the_config(folders, tmp_path):
    path, hf = folders["llama"]
    assert LLM(path).runner.dtype == torch.float32
    bf16 = save_folder(tiny_hf("llama").to(torch.bfloat16), tmp_path / "bf16")
    assert LLM(bf16).runner.dtype == torch.bfloat16
    assert LLM(bf16, dtype="float32").runner.dtype == torch.float32


def test_tokenizer_and_chat_template_from_the_folder(folders):
    from transformers import AutoTokenizer

    path, _ = folders["llama"]
    ours, theirs = LLM(path, dtype="float32").tokenizer, AutoTokenizer.from_pretrained(path)
    for text in ["the cat sat on the mat", "<|im_start|>user\nhi<|im_end|>", "naïve café"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)
    assert ours.eos_token_id == theirs.convert_tokens_to_ids("<|im_end|>") and ours.eos_token_id in ours.eog_token_ids


# -- hub ids ---------------------------------------------------------------------------------

def _hub_cache(root, repo_id: str, folder: str) -> None:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def _run_cli(args, env):
    return subprocess.run([sys.executable, "-m", "nextoken", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.subprocess
def test_hub_id_resolves_from_the_cache_offline(folders, tmp_path):
    """`--model org/name` with HF_HUB_OFFLINE=1 finds the snapshot in the cache (a user's
    `nextoken run`); an id that is not cached is a clear error, not a traceback."""
    _hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", folders["llama"][0])
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    ok = _run_cli(["run", "--model", "tiny-org/tiny-llama", "--raw", "--max-tokens", "5", "--temperature", "0",
                   "--ignore-eos", "the cat"], env)
    assert ok.returncode == 0, ok.stderr
    llm = LLM(folders["llama"][0], dtype="float32")
    expected = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert ok.stdout.strip() == expected.outputs[0].text.strip()
    missing = _run_cli(["run", "--model", "tiny-org/not-there", "--raw", "hi"], env)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "tiny-org/not-there" in missing.stderr and "cache" in missing.stderr


# -- errors ----------------------------------------------------------------------------------

def test_unknown_architecture_names_itself_and_the_supported(folders, tmp_path):
    d = shutil.copytree(folders["llama"][0], tmp_path / "x")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="FalconForCausalLM.*supported: .*LlamaForCausalLM.*GPT2LMHeadModel"):
        LLM(str(d))


def test_missing_or_mismatched_tensor_is_named(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    for case in ("missing", "shape"):
        d = shutil.copytree(folders["qwen2"][0], tmp_path / case)
        f = d / "model.safetensors"
        sd = load_file(f)
        name = "model.layers.1.mlp.up_proj.weight"
        if case == "missing":
            del sd[name]
        else:
            sd[name] = sd[name][:-1].contiguous()
        save_file(sd, f, metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
            LLM(str(d), dtype="float32")


def test_pickle_checkpoint_is_refused_with_the_reason(folders, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(os.path.join(folders["llama"][0], "config.json"), d)
    torch.save(folders["llama"][1].state_dict(), d / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*only safetensors and GGUF"):
        LLM(str(d))


def test_qwen3_gguf_equals_transformers(folders, tmp_path):
    """Qwen3 written as GGUF (``attn_q_norm``/``attn_k_norm``, explicit key_length) loads too."""
    from nextoken.loader.gguf import GGUFFile
    from tests.tiny_models import write_gguf

    _, hf = folders["qwen3"]
    path = tmp_path / "qwen3.gguf"
    write_gguf(hf, path, "qwen3")
    full, steps = hf_stepwise(hf, PROMPT, CONTINUATION)
    seq = OneSequence(ModelRunner(GGUFFile(path), torch.float32), 64, block_size=4)
    assert (seq.forward(PROMPT, all_logits=True) - full).abs().max() < 1e-4
    for i, t in enumerate(CONTINUATION):
        assert (seq.forward([t]) - steps[i]).abs().max() < 1e-4


def test_bos_follows_the_post_processor_when_the_config_is_silent(folders, tmp_path):
    """A tokenizer.json whose post-processor prepends BOS (as Llama 3's does) and a
    tokenizer_config.json that says nothing: prompts start with BOS, as transformers encodes them."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    d = shutil.copytree(folders["llama"][0], tmp_path / "bos")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["add_bos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = LLM(str(d), dtype="float32").tokenizer
    assert ours.encode("the cat") == AutoTokenizer.from_pretrained(str(d)).encode("the cat") and ours.encode("x")[0] == 1


def test_a_folders_generation_config_gives_the_sampling_defaults(folders, tmp_path):
    """vLLM's ``--generation-config auto``: the fields of generation_config.json that differ
    from transformers' defaults (Qwen2.5-Instruct's: temperature 0.7, top_p 0.8, top_k 20,
    repetition_penalty 1.05; top_k 50 is no advice) are what a request that leaves them unset
    samples with, through `LLM` and through the OpenAI and Ollama APIs (the same tokens as the
    explicit values under the same seed); a request's own value wins, ``max_new_tokens`` bounds
    an answer that gives no bound, and ``generation_config="vllm"`` reads none."""
    import ollama

    from nextoken import sampling_defaults
    from tests.helpers.server import LiveServer

    folder = tmp_path / "qwen2"
    shutil.copytree(folders["qwen2"][0], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.7,
                                                               "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}))
    qwen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert sampling_defaults.read_file(str(folder)) == qwen
    assert sampling_defaults.resolve(str(folder), "auto", {"top_k": 50, "max_new_tokens": 6}) == \
        {**qwen, "top_k": 50, "max_tokens": 6}  # (an override is kept as given)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "generation_config.json").write_text('{"top_k": 50, "temperature": 0.3}')
    assert sampling_defaults.resolve(str(folder), str(tmp_path / "other")) == {"temperature": 0.3}

    llm = LLM(str(folder), dtype="float32", seed=5, override_generation_config={"max_new_tokens": 8})
    assert llm.get_default_sampling_params() == SamplingParams(**qwen, max_tokens=8)
    plain = LLM(str(folder), dtype="float32", seed=5, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    prompt = [5, 17, 200, 33]
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert ids(llm.generate([prompt] * 2)) == ids(plain.generate([prompt] * 2, SamplingParams(**qwen, max_tokens=8)))

    messages = [{"role": "user", "content": "the cat"}]
    want = plain.chat(messages, SamplingParams(**qwen, seed=3, max_tokens=8, ignore_eos=True))[0].outputs[0]
    greedy = plain.chat(messages, SamplingParams(**{**qwen, "temperature": 0}, max_tokens=8,
                                                 ignore_eos=True))[0].outputs[0]  # (its penalty still the model's)
    srv = LiveServer(LLM(str(folder), dtype="float32", override_generation_config={"max_new_tokens": 6}), "tiny")
    try:
        client = srv.client()
        ask = dict(model="tiny", messages=messages, seed=3, extra_body={"ignore_eos": True})
        got = client.chat.completions.create(**ask, max_tokens=8)
        assert got.choices[0].message.content == want.text
        assert client.chat.completions.create(**ask, max_tokens=8, temperature=0).choices[0].message.content \
            == greedy.text
        completion = client.completions.create(model="tiny", prompt=prompt, seed=3, max_tokens=8,
                                               extra_body={"ignore_eos": True})
        assert completion.choices[0].text == plain.generate(
            [prompt], SamplingParams(**qwen, seed=3, max_tokens=8, ignore_eos=True))[0].outputs[0].text
        bounded = client.chat.completions.create(**ask)  # no bound: the model's max_new_tokens
        assert bounded.usage.completion_tokens == 6 and bounded.choices[0].finish_reason == "length"
        answer = client.responses.create(model="tiny", input="the cat", max_output_tokens=4)
        assert (answer.temperature, answer.top_p) == (0.7, 0.8)  # what it sampled with
        r = ollama.Client(host=srv.url).chat(model="tiny", messages=messages, options={"seed": 3, "num_predict": 8})
        assert r.message.content == plain.chat(messages, SamplingParams(**qwen, seed=3, max_tokens=8))[0].outputs[0].text
    finally:
        srv.stop()
