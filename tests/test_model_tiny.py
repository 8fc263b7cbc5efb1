"""Our float32 model against `transformers`' implementation of the same architecture."""

from __future__ import annotations

import pytest
import torch

from nextoken.layers.attention import AttentionMetadata, attention_reference, attention_sdpa
from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner
from tests.tiny_models import VOCAB_SIZE, tiny_hf_model, write_gguf

PROMPT = [5, 17, 200, 33, 41, 270, 90, 12, 7, 150, 3, 99]


def hf_logits_stepwise(model, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """transformers' logits: the prompt's last position, then one decode step per continuation
    token with its own KV cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, past = [out.logits[0, -1]], out.past_key_values
        for t in continuation:
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0, -1])
            past = out.past_key_values
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("reference_attention", [False, True])
def test_prefill_and_decode_match_transformers(tiny_gguf, arch, reference_attention):
    path, hf = tiny_gguf[arch]
    runner = ModelRunner(GGUFFile(path), torch.float32, reference=reference_attention)
    continuation = [44, 61, 2, 130, 8]
    expected = hf_logits_stepwise(hf, PROMPT, continuation)

    kv = runner.new_kv_cache(64)
    with torch.no_grad():
        full = hf(torch.tensor([PROMPT])).logits[0]
    ours_all = runner.forward(PROMPT, kv, all_logits=True)  # prefill: every position
    assert (ours_all - full).abs().max() < 1e-4
    got = [ours_all[-1]]
    for t in continuation:  # decode: one token against the cache
        got.append(runner.forward([t], kv))
    assert kv.num_tokens == len(PROMPT) + len(continuation)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert (a - b).abs().max() < 1e-4, f"step {step}"


def test_chunked_prefill_equals_whole_prefill(tiny_gguf):
    """A prompt prefilled in two chunks (the second after cached tokens) gives the same logits."""
    path, _ = tiny_gguf["llama"]
    runner = ModelRunner(GGUFFile(path), torch.float32)
    whole = runner.forward(PROMPT, runner.new_kv_cache(32), all_logits=True)
    kv = runner.new_kv_cache(32)
    a = runner.forward(PROMPT[:5], kv, all_logits=True)
    b = runner.forward(PROMPT[5:], kv, all_logits=True)
    assert torch.allclose(torch.cat([a, b]), whole, atol=1e-5)


@pytest.mark.parametrize("start,n", [(0, 9), (7, 1), (5, 4)])
def test_fused_attention_equals_reference(start, n):
    """The fast path (SDPA) against the plain masked-matmul attention, GQA with 4:2 heads."""
    g = torch.Generator().manual_seed(start * 10 + n)
    q = torch.randn(n, 4, 16, generator=g)
    k = torch.randn(start + n, 2, 16, generator=g)
    v = torch.randn(start + n, 2, 16, generator=g)
    meta = AttentionMetadata(start, n)
    ref, probs = attention_reference(q, k, v, meta, 0.25)
    assert torch.allclose(attention_sdpa(q, k, v, meta, 0.25), ref, atol=1e-5)
    # the causal mask: query i never sees keys after its own position
    for i in range(n):
        assert probs[:, i, start + i + 1 :].abs().sum() == 0
    assert torch.allclose(probs.sum(-1), torch.ones(4, n))


def test_quantized_tensors_load_like_gguf_dequantize(tmp_path):
    """A GGUF whose linears are stored Q8_0 / Q4_0: our model equals transformers run on the same
    weights after `gguf.quants` round-trips them."""
    import gguf

    hf = tiny_hf_model("qwen2", seed=1)
    quant = {"ffn_up.weight": "Q8_0", "ffn_gate.weight": "Q4_0", "attn_output.weight": "Q4_1",
             "ffn_down.weight": "Q5_0"}
    path = tmp_path / "q.gguf"
    write_gguf(hf, path, "qwen2", quant=quant)
    qmap = {"up_proj": "Q8_0", "gate_proj": "Q4_0", "o_proj": "Q4_1", "down_proj": "Q5_0"}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            for mod, q in qmap.items():
                if f"{mod}.weight" in name:
                    qt = gguf.GGMLQuantizationType[q]
                    rt = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qt), qt)
                    p.copy_(torch.from_numpy(rt))
    runner = ModelRunner(GGUFFile(path), torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    got = runner.forward(PROMPT, runner.new_kv_cache(16), all_logits=True)
    assert (got - expected).abs().max() < 1e-4


def test_bfloat16_path_close_to_float32(tiny_gguf):
    path, _ = tiny_gguf["llama"]
    f32 = ModelRunner(GGUFFile(path), torch.float32).forward(PROMPT, ModelRunner(GGUFFile(path)).new_kv_cache(16))
    runner = ModelRunner(GGUFFile(path), torch.bfloat16)
    b16 = runner.forward(PROMPT, runner.new_kv_cache(16))
    p32, p16 = f32.softmax(-1), b16.softmax(-1)
    assert b16.shape == (VOCAB_SIZE,)
    assert (p32 - p16).abs().max() < 0.02
