"""Weight-only int4 linears against the de-quantized float32 reference."""

from __future__ import annotations

import pytest
import torch

from nextoken.layers.quant_linear import int4_groups, int4_linear, pack_int4
from nextoken.loader.dequant import dequantize
from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner
from tests.test_dequant import random_blocks
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}


@pytest.mark.parametrize("type_name", sorted(BLOCK))
def test_groups_reproduce_the_dequantized_weight(type_name):
    """(q - 8) * scale + zero is the format's formula rearranged: equal up to float32 rounding."""
    rows, cols = 32, 512
    raw = torch.from_numpy(random_blocks(type_name, rows * cols // BLOCK[type_name], seed=11))
    w = dequantize(raw, type_name, (rows, cols))
    q, scale, zero = int4_groups(raw, type_name, rows, cols)
    assert q.min() >= 0 and q.max() <= 15
    rebuilt = (q - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    assert ((rebuilt - w).abs().max() / w.abs().max()) < 1e-6


@pytest.mark.parametrize("type_name", sorted(BLOCK))
def test_int4_kernel_equals_reference_matmul(type_name):
    rows, cols = 48, 512
    raw = torch.from_numpy(random_blocks(type_name, rows * cols // BLOCK[type_name], seed=12))
    w = dequantize(raw, type_name, (rows, cols))
    packed, sz = pack_int4(*int4_groups(raw, type_name, rows, cols), torch.bfloat16)
    for t in (1, 7):
        x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t))
        ref = x @ w.T
        out = int4_linear(x.to(torch.bfloat16), packed, sz).float()
        assert ((out - ref).norm() / ref.norm()) < 1e-2


def test_int4_model_close_to_float32_reference(tmp_path):
    hf = tiny_hf_model("llama", seed=4)
    path = tmp_path / "q4.gguf"
    write_gguf(hf, path, "llama", quant={"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "ffn_up.weight": "Q4_0",
                                         "ffn_down.weight": "Q4_1", "ffn_gate.weight": "Q4_1"})
    prompt = [5, 17, 200, 33, 41, 270, 90, 12]
    f32 = OneSequence(ModelRunner(GGUFFile(path), torch.float32)).forward(prompt)
    runner = ModelRunner(GGUFFile(path), torch.bfloat16, int4=True)
    assert runner.model.layers[0].self_attn.q_proj.int4 is not None  # really packed (and un-permuted)
    assert runner.model.layers[0].self_attn.v_proj.int4 is None  # an F32 tensor stays dense
    seq = OneSequence(runner)
    b16 = seq.forward(prompt)  # 8 rows: the int4 path
    assert (f32.softmax(-1) - b16.softmax(-1)).abs().max() < 0.02
    assert int(f32.argmax()) == int(b16.argmax())
    ref = OneSequence(ModelRunner(GGUFFile(path), torch.float32))
    long = list(range(3, 43))  # 40 rows: the dense bf16 path of the same layers
    assert (ref.forward(long).softmax(-1) - seq.forward(long).softmax(-1)).abs().max() < 0.02
