"""The one-call C decode (`nextoken.layers.native_decode`, ``kernels/decode.c``) against the
model's PyTorch layers on the same codes, and against the float32 model it came from."""

from __future__ import annotations

import pytest
import torch

from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner, SequenceInput
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

QUANT = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_0",
         "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q8_0", "ffn_down.weight": "Q4_0"}


def runners(tmp_path, arch: str):
    path = tmp_path / f"{arch}.gguf"
    hf = tiny_hf_model(arch, seed=7)
    with torch.no_grad():  # sharp attention, so that positions (RoPE) and every key matter
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
    write_gguf(hf, path, arch, quant=QUANT)
    native = ModelRunner(GGUFFile(path), torch.bfloat16)
    assert native.native_decoder is not None, "the C decode did not build or a linear has no codes"
    plain = ModelRunner(GGUFFile(path), torch.bfloat16)
    plain.native_decoder = None  # the PyTorch layers, same codes and kernels for the linears
    f32 = ModelRunner(GGUFFile(path), torch.float32)
    return native, plain, f32


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """Logits agree to `tol` of their spread, with the same greedy token."""
    assert float((a - b).abs().max()) <= tol * float(b.std()), float((a - b).abs().max())
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("arch,cache_dtype", [("llama", "auto"), ("qwen2", "auto"), ("qwen2", "int8")])
def test_one_stream_decode_matches_pytorch_layers(tmp_path, arch, cache_dtype):
    """qwen2: q/k/v biases, untied head. int8: the C decode quantizes the new keys and values
    as `quantize_rows` does and attends over the codes; the PyTorch layers use the same cache."""
    native, plain, f32 = runners(tmp_path, arch)
    prompt = [5, 17, 200, 33, 41, 270, 90, 12, 7, 7, 150]
    seqs = [OneSequence(native, cache_dtype=cache_dtype), OneSequence(plain, cache_dtype=cache_dtype), OneSequence(f32)]
    for s in seqs:
        s.forward(prompt)
    for token in [3, 99, 240, 18, 18, 61] + list(range(20, 40)):  # 26 decode steps, past a block boundary
        a, b, c = (s.forward([token]) for s in seqs)
        # Same roundings; only float32 reductions (the norm's mean, exp) may differ in a last bit.
        # (with an int8 cache a key that differs in its last bit can round to the next code)
        close(a, b, 0.02 if cache_dtype == "auto" else 0.04)
        close(a, c, 0.25)  # bf16 and int8 activations (and int8 keys and values) against the float32 model
    if cache_dtype == "int8":  # the C decode wrote codes (its quantizer: the test below)
        assert native.kv.k.dtype == torch.int8 and native.kv.k_scale.abs().sum() > 0


def test_batched_decodes_match_pytorch_layers(tmp_path):
    """Sequences of different lengths with scattered blocks, decoding together."""
    native, plain, _ = runners(tmp_path, "qwen2")
    out = []
    for r in (native, plain):
        r.init_kv_cache(32, 4)
        tables = [[9, 2, 30, 4, 17], [0, 1, 3], [31, 8, 6, 12, 13, 14, 15, 16]]
        lens = [17, 9, 29]
        prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)]
        r.execute([SequenceInput(p, 0, t) for p, t in zip(prompts, tables)])
        steps = []
        for step in range(3):
            seqs = [SequenceInput([40 + step + i], n + step, t) for i, (n, t) in enumerate(zip(lens, tables))]
            steps.append(r.execute(seqs))
        out.append(torch.stack(steps))
    close(out[0], out[1], 0.02)


def test_kernel_kv_quantization_equals_quantize_rows():
    """decode.c's int8 cache write (`kv_quantize_rows`) against `quantize_rows`, code for code:
    random rows, a zero row, rows with exact .5 ties after scaling, a row of one value."""
    import ctypes

    from nextoken.kernels import load
    from nextoken.kv_cache.tensors import quantize_rows

    lib = load("decode")
    assert lib is not None, "the decode kernel did not build (is gcc installed?)"
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 128, generator=g) * torch.logspace(-3, 3, 64)[:, None]).to(torch.bfloat16)
    x[3] = 0
    x[4] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5] * 25 + [0.0] * 3)  # scale 1: ties round to even
    x[5] = -7.0
    codes, scales = torch.empty(64, 128, dtype=torch.int8), torch.empty(64)
    p = ctypes.c_void_p
    lib.kv_quantize_rows(p(x.data_ptr()), 64, 128, p(codes.data_ptr()), p(scales.data_ptr()))
    ref_codes, ref_scales = quantize_rows(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert ref_codes[4, :5].tolist() == [127, 0, 2, -2, 64] and ref_codes[5].eq(-127).all() and ref_scales[3] == 0
