"""Our float32 model against `transformers`' implementation of the same architecture."""

from __future__ import annotations

import pytest
import torch

from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner
from tests.helpers.engine import hf_logits_stepwise
from tests.tiny_models import VOCAB_SIZE, OneSequence, tiny_hf_model, write_gguf

PROMPT = [5, 17, 200, 33, 41, 270, 90, 12, 7, 150, 3, 99]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("reference_attention", [False, True])
def test_prefill_and_decode_match_transformers(tiny_gguf, arch, reference_attention):
    path, hf = tiny_gguf[arch]
    runner = ModelRunner(GGUFFile(path), torch.float32, reference=reference_attention)
    continuation = [44, 61, 2, 130, 8]
    expected = hf_logits_stepwise(hf, PROMPT, continuation)

    seq = OneSequence(runner, 64, block_size=4)  # several blocks, so the block table matters
    with torch.no_grad():
        full = hf(torch.tensor([PROMPT])).logits[0]
    ours_all = seq.forward(PROMPT, all_logits=True)  # prefill: every position
    assert (ours_all - full).abs().max() < 1e-4
    got = [ours_all[-1]]
    for t in continuation:  # decode: one token against the cache
        got.append(seq.forward([t]))
    for step, (a, b) in enumerate(zip(got, expected)):
        assert (a - b).abs().max() < 1e-4, f"step {step}"


def test_chunked_prefill_equals_whole_prefill(tiny_gguf):
    """A prompt prefilled in two chunks (the second after cached tokens) gives the same logits."""
    path, _ = tiny_gguf["llama"]
    runner = ModelRunner(GGUFFile(path), torch.float32)
    whole = OneSequence(runner, 32, 4).forward(PROMPT, all_logits=True)
    seq = OneSequence(runner, 32, 4)
    a = seq.forward(PROMPT[:5], all_logits=True)
    b = seq.forward(PROMPT[5:], all_logits=True)
    assert torch.allclose(torch.cat([a, b]), whole, atol=1e-5)


def test_quantized_tensors_load_like_gguf_dequantize(tmp_path):
    """A GGUF whose linears are stored Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, and one in a format only
    gguf de-quantizes (MXFP4): our model equals transformers run on the same weights after
    `gguf.quants` round-trips them."""
    import gguf

    hf = tiny_hf_model("qwen2", seed=1)
    quant = {"ffn_up.weight": "Q8_0", "ffn_gate.weight": "Q4_0", "attn_output.weight": "Q4_1",
             "ffn_down.weight": "Q5_0", "attn_q.weight": "Q5_1", "attn_k.weight": "MXFP4"}
    path = tmp_path / "q.gguf"
    write_gguf(hf, path, "qwen2", quant=quant)
    qmap = {"up_proj": "Q8_0", "gate_proj": "Q4_0", "o_proj": "Q4_1", "down_proj": "Q5_0", "q_proj": "Q5_1",
            "k_proj": "MXFP4"}
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
    got = OneSequence(runner, 16).forward(PROMPT, all_logits=True)
    assert (got - expected).abs().max() < 1e-4


def test_bfloat16_path_close_to_float32(tiny_gguf):
    path, _ = tiny_gguf["llama"]
    f32 = OneSequence(ModelRunner(GGUFFile(path), torch.float32), 16).forward(PROMPT)
    b16 = OneSequence(ModelRunner(GGUFFile(path), torch.bfloat16), 16).forward(PROMPT)
    p32, p16 = f32.softmax(-1), b16.softmax(-1)
    assert b16.shape == (VOCAB_SIZE,)
    assert (p32 - p16).abs().max() < 0.02
