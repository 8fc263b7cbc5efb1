"""Weight-only int4 linears against the de-quantized float32 reference."""

from __future__ import annotations

import pytest
import torch

from nextoken.layers.linear import Linear
from nextoken.layers.quantization.methods import TorchInt4Method
from nextoken.layers.quantization.torch_int4 import int4_groups, int4_linear, int4_unpack, pack_int4
from nextoken.layers.quantization.ggml import dequantize
from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner
from tests.helpers.blocks import random_blocks
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q8_0": 32}


@pytest.mark.parametrize("type_name", sorted(BLOCK))
def test_groups_reproduce_the_dequantized_weight(type_name):
    """(q - 8) * scale + zero is the format's formula rearranged: equal up to float32 rounding."""
    rows, cols = 32, 512
    raw = torch.from_numpy(random_blocks(type_name, rows * cols // BLOCK[type_name], seed=11))
    w = dequantize(raw, type_name, (rows, cols))
    parts = int4_groups(raw, type_name, rows, cols)
    assert len(parts) == (2 if type_name == "Q8_0" else 1)  # Q8_0: high and low nibbles
    rebuilt = torch.zeros(rows, cols)
    for q, scale, zero in parts:
        assert q.min() >= 0 and q.max() <= 15
        rebuilt += (q - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    assert ((rebuilt - w).abs().max() / w.abs().max()) < 1e-6


def packed(type_name: str, rows: int, cols: int, seed: int, dtype=torch.bfloat16):
    """Random blocks of `type_name`: the float32 de-quantized reference weight and our int4 parts."""
    raw = torch.from_numpy(random_blocks(type_name, rows * cols // BLOCK[type_name], seed=seed))
    parts = [pack_int4(*p, dtype) for p in int4_groups(raw, type_name, rows, cols)]
    return dequantize(raw, type_name, (rows, cols)), parts


@pytest.mark.parametrize("type_name", sorted(BLOCK))
def test_int4_kernel_equals_reference_matmul(type_name):
    rows, cols = 128, 512
    w, parts = packed(type_name, rows, cols, seed=12)
    for t in (1, 7):
        x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t))
        ref = x @ w.T
        out = sum(int4_linear(x.to(torch.bfloat16), p, sz).float() for p, sz in parts)
        assert ((out - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("type_name", sorted(BLOCK))
def test_unpacked_weight_equals_reference(type_name):
    """The expansion used for many rows (the PyTorch reference): exact with float32 scales."""
    w, parts = packed(type_name, 128, 256, seed=13, dtype=torch.float32)
    assert (sum(int4_unpack(p, sz) for p, sz in parts) - w).abs().max() <= 1e-6 * w.abs().max()


def test_linear_paths_agree():
    """Few rows (int4 kernel) and many rows (expanded weight + bf16 matmul) give the same rows,
    and both match the float32 reference."""
    rows, cols = 192, 256
    w, parts = packed("Q8_0", rows, cols, seed=14)
    lin = Linear(cols, rows, False, torch.bfloat16)
    lin.set_int4(parts)
    x = torch.randn(TorchInt4Method.MAX_TOKENS + 20, cols, generator=torch.Generator().manual_seed(3))
    many = lin(x.to(torch.bfloat16)).float()
    few = torch.cat([lin(x[i : i + 4].to(torch.bfloat16)).float() for i in range(0, len(x), 4)])
    ref = x @ w.T
    assert ((many - ref).norm() / ref.norm()) < 1e-2
    assert ((few - many).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("eager", [True, False])
def test_quantized_model_close_to_float32_reference(tmp_path, eager):
    """bf16 with quantized linears, against the float32 model: PyTorch's int4 kernel under
    --enforce-eager, our codes kernel otherwise; for few rows and for many (the int4 path then
    expands the weights; our kernel serves both, across its blocks of 48 rows)."""
    hf = tiny_hf_model("llama", seed=4)
    path = tmp_path / "q4.gguf"
    write_gguf(hf, path, "llama", quant={"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "ffn_up.weight": "Q4_0",
                                         "ffn_down.weight": "Q4_1", "ffn_gate.weight": "Q4_1"})
    prompt = [5, 17, 200, 33, 41, 270, 90, 12]
    f32 = OneSequence(ModelRunner(GGUFFile(path), torch.float32)).forward(prompt)
    runner = ModelRunner(GGUFFile(path), torch.bfloat16, keep_quantized=True, enforce_eager=eager)
    q_proj = runner.model.layers[0].self_attn.q_proj
    assert (q_proj.int4 if eager else q_proj.qweight) is not None  # really packed (and un-permuted)
    assert runner.model.layers[0].self_attn.v_proj.weight is not None  # an F32 tensor stays dense
    seq = OneSequence(runner)
    b16 = seq.forward(prompt)  # 8 rows: the quantized kernel
    assert (f32.softmax(-1) - b16.softmax(-1)).abs().max() < 0.02
    assert int(f32.argmax()) == int(b16.argmax())
    ref = OneSequence(ModelRunner(GGUFFile(path), torch.float32))
    long = list(range(3, 3 + max(TorchInt4Method.MAX_TOKENS, 48) + 12))
    assert (ref.forward(long).softmax(-1) - seq.forward(long).softmax(-1)).abs().max() < 0.02
