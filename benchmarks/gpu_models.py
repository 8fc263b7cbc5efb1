"""The catalog's architectures at their real sizes, as Hugging Face folders with random weights:
what `benchmarks/gpu_check.py` runs on a GPU machine that reaches no network (issue 61).

`MODELS` gives each catalog model's sizes as its GGUF file has them (`loader.gguf.read_model_config`
of the catalog file; `tests/engine/test_gpu_models.py` holds SmolLM2's equal to the real file's);
`build_folder` writes one: config.json from `transformers`' own config class (so the folder is what
`save_pretrained` writes), a tokenizer, and random weights. The weights are drawn so that
activations keep their scale through the layers and the next-token distribution is peaked (the
embedding rows and the head at unit variance, each projection at variance 1 / fan-in, norms near
1): greedy decoding then has clear winners, as a trained model does, instead of near-ties that
any rounding would flip. The tokenizer is a byte-level BPE over the model's whole vocabulary
(`synthetic_tokenizer`: the 256 byte symbols, then byte pairs, then triples, each with its merge,
and ChatML's three special tokens last), so every id a random model picks decodes to text, as
with the real tokenizers, which the machine cannot download.
"""

from __future__ import annotations

import json
import math
import os

MODELS = {
    "smollm2-135m": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False)),
    "gemma-3-270m": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        sliding_window=512, query_pre_attn_scalar=256, tie_word_embeddings=True,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}
# tiny shapes of two of the architectures, for `gpu_check.py --dry-run` on a machine without a GPU
TINY = {
    "tiny-llama": ("LlamaConfig", dict(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False)),
    "tiny-gemma3": ("Gemma3TextConfig", dict(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=16,
        query_pre_attn_scalar=32, tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])),
}
ARCH_CLASS = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
              "Gemma3TextConfig": "Gemma3ForCausalLM"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def hf_config(name: str):
    """`transformers`' config object of catalog model `name` (bf16, ChatML's end as EOS)."""
    import transformers

    cls, kwargs = {**MODELS, **TINY}[name]
    vocab = kwargs["vocab_size"]
    config = getattr(transformers, cls)(**kwargs, bos_token_id=vocab - 2, eos_token_id=vocab - 1,
                                        pad_token_id=vocab - 3)
    config.architectures = [ARCH_CLASS[cls]]
    config.dtype = "bfloat16"
    return config


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` ids: 256 bytes, byte
    pairs, then pair-plus-byte triples (each with the merge that makes it), and `SPECIALS` as the
    last three ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    sym = byte_symbols()
    vocab = {s: i for i, s in enumerate(sym)}
    merges = []
    normal = vocab_size - len(SPECIALS)
    pairs = (a + b for a in sym for b in sym)
    for ab in pairs:
        if len(vocab) >= normal:
            break
        vocab[ab] = len(vocab)
        merges.append((ab[0], ab[1]))
    for ab in [s for s in vocab if len(s) == 2]:
        for c in sym:
            if len(vocab) >= normal:
                break
            vocab[ab + c] = len(vocab)
            merges.append((ab, c))
        if len(vocab) >= normal:
            break
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def randomize(model, seed: int) -> None:
    """Weights at the scales the module docstring gives, drawn from `seed` on the model's device."""
    import torch

    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # (Gemma keeps weight - 1: near 0 there is near 1 in effect)
                base = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32))
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
                        / math.sqrt(p.shape[-1]))


def build_folder(name: str, path: str, device: str = "cuda", seed: int = 0) -> str:
    """Write catalog model `name` with random weights (bf16 safetensors) to folder `path`; returns
    it. Reuses a folder already written (its ``.complete`` marker)."""
    import torch
    import transformers

    if os.path.isfile(os.path.join(path, ".complete")):
        return path
    config = hf_config(name)
    with torch.device(device):
        model = getattr(transformers, ARCH_CLASS[{**MODELS, **TINY}[name][0]])(config).to(torch.bfloat16)
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    del model
    synthetic_tokenizer(config.vocab_size).save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
                   "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
                   "chat_template": CHATML}, f)
    open(os.path.join(path, ".complete"), "w").close()
    return path
