"""Tiny random models for tests: built with `transformers`, written as GGUF with the `gguf` writer.

The GGUF is written the way llama.cpp's converter writes a real one (metadata keys, tensor
names, Q/K permuted for `llama`), so loading it exercises the same code as a real file, and the
`transformers` model it came from is the independent oracle for the logits.
"""

from __future__ import annotations

import numpy as np
import torch

from nextoken.kv_cache.manager import ring_blocks

# A tiny byte-level BPE vocabulary: the 256 byte symbols, a few merges, and ChatML's specials.
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ c", "a t", "Ġc at", "Ġ s", "Ġs at", "Ġ o",
          "Ġo n", "Ġ m", "Ġm at"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny vocabulary: specials first, like SmolLM2."""
    tokens = list(SPECIALS) + byte_symbols()
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, MERGES


VOCAB_SIZE = len(tiny_vocab()[0])


def tiny_hf_model(arch: str, seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """A random float32 `transformers` model of `arch` ("llama", "qwen2", "qwen3" with 2 layers;
    "gemma3" with 6).
    A `vocab_size` above the tiny vocabulary's adds rows that `write_gguf` names as padding
    tokens (a whole number of 16-row tiles lets the embedding be kept as codes)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, head_dim=16)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":  # QK-norm, head_dim 32 (wider than hidden / heads)
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "gemma3":  # 5 local layers (window 8, shorter than the test prompts) + 1 global, as GGUF's pattern
        common.pop("rope_theta")
        cfg = transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=32, sliding_window=8,
                                            query_pre_attn_scalar=32, tie_word_embeddings=True,
                                            layer_types=["sliding_attention"] * 5 + ["full_attention"])
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # random norms and biases, so that every weight matters in the test
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def rope_theta(cfg) -> float:
    """RoPE base of a `transformers` config (v5 keeps it in ``rope_parameters``, per layer type
    for Gemma 3: the global layers' here)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    params = params.get("full_attention", params)
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta"))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K permutation for interleaved RoPE (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, arch: str, quant: dict[str, str] | None = None, context_length: int = 256) -> None:
    """Write `model` as a GGUF file at `path`. `quant` maps a GGUF tensor-name suffix (e.g.
    ``"ffn_up.weight"``) to a GGML type name to store those tensors quantized with `gguf.quants`."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if arch in ("gemma3", "qwen3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    tokens, types, merges = tiny_vocab()
    pad = cfg.vocab_size - len(tokens)
    tokens, types = tokens + [f"<|pad{i}|>" for i in range(pad)], types + [3] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)

    for name, t in _gguf_tensors(model, arch):
        qtype = next((q for suffix, q in (quant or {}).items() if name.endswith(suffix)), None)
        if qtype is None:
            w.add_tensor(name, t)
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_tensors(model, arch: str):
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if arch == "gemma3":
        yield from _gemma3_tensors(cfg, sd)
        return
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    yield "output_norm.weight", sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "output.weight", sd["lm_head.weight"]
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}  # the norms: Qwen3
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        yield f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"]
        yield f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]
        for hf, gg in names.items():
            mod = "self_attn" if hf.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")) else "mlp"
            for kind in ("weight", "bias"):
                key = f"{p}{mod}.{hf}.{kind}"
                if key not in sd:
                    continue
                t = sd[key]
                if arch == "llama" and hf in ("q_proj", "k_proj"):
                    t = _permute(t, cfg.num_attention_heads if hf == "q_proj" else cfg.num_key_value_heads)
                yield f"blk.{i}.{gg}.{kind}", t


def _gemma3_tensors(cfg, sd):
    """Gemma 3 as llama.cpp's converter writes it: its tensor names, norm weights stored as 1 + w."""
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    yield "output_norm.weight", sd["model.norm.weight"] + 1
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            yield f"blk.{i}.{gg}.weight", t + 1 if "norm" in hf else t


class OneSequence:
    """Drive a `ModelRunner` for one sequence over a paged cache whose blocks are taken in order
    (what the engine does, without the engine): for model-level tests."""

    def __init__(self, runner, capacity: int = 256, block_size: int = 16, cache_dtype: str = "auto"):
        self.runner = runner
        if runner.kv is None or runner.kv.num_blocks * runner.kv.block_size < capacity or \
                runner.kv.cache_dtype != cache_dtype:
            ring = ring_blocks(runner.config.sliding_window, block_size) if runner.config.sliding_layers else 0
            runner.init_kv_cache(-(-capacity // block_size), block_size, ring, ring, cache_dtype)
        self.block_ids = list(range(runner.kv.num_blocks))
        sw = runner.kv.sliding  # one sequence: the whole ring, blocks in reverse (so order matters)
        self.ring_ids = list(reversed(range(sw.ring_blocks))) if sw is not None else None
        self.num_tokens = 0

    def forward(self, token_ids: list[int], all_logits: bool = False):
        """Logits of the last new token ``[vocab]`` (or of every new token ``[T, vocab]``)."""
        from nextoken.runner.model_runner import SequenceInput

        seq = SequenceInput(list(token_ids), self.num_tokens, self.block_ids, ring_ids=self.ring_ids)
        out = self.runner.execute([seq], all_logits=all_logits)
        self.num_tokens += len(token_ids)
        return out if all_logits else out[0]
