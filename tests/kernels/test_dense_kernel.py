"""Dense bf16 weights on our kernel (``kernels/dense_bf16.c``): the product against float64 and
against PyTorch's bf16 linear, its vectorized loops against the portable ones, the one-call
decode step on a bf16 Hugging Face folder against the PyTorch layers, the folder's weights mapped
from the file (no copy), and the bytes a decode step reads."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from nextoken.kernels import load
from nextoken.layers.linear import Linear
from nextoken.layers.quantization.methods import DenseKernelMethod
from nextoken.layers.quantization.qweight import dense_c_struct, kernel_matmul
from nextoken.loader.hf import HFModelDir
from nextoken.runner.model_runner import ModelRunner
from tests.tiny_models import OneSequence, tiny_hf_model

lib = load("qmatmul")
needs_kernel = pytest.mark.skipif(lib is None, reason="no C compiler: the kernel cannot be built")


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y + bias.double() if bias is not None else y


@needs_kernel
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 9, 33])
@pytest.mark.parametrize("n,k", [(40, 64), (37, 50), (129, 200)])
def test_product_equals_float64_within_float32_sums(portable, m, n, k):
    """Streaming (up to 4 rows), widened triples and pairs with a last single row (5, 7, 9, 33), tails of K (50,
    200: not multiples of 16) and of N (37, 129: not multiples of the 16-row block)."""
    lib_ = load("qmatmul", portable=True) if portable else lib
    torch.manual_seed(m * 1000 + n + k)
    x, w, bias = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n)
    ref = reference(x, w, bias)
    c = dense_c_struct(w, bias)
    y32 = kernel_matmul(x, c, n, out_dtype=torch.float32, lib=lib_)
    bound = (x.double().abs() @ w.double().abs().t()) * k * 2 ** -24 + 1e-6  # float32 sums of k products
    assert ((y32.double() - ref).abs() <= bound).all()
    y16 = kernel_matmul(x, c, n, lib=lib_)  # one rounding of the same sum to bf16
    assert y16.dtype == torch.bfloat16
    assert ((y16.double() - ref).abs() <= ref.abs() * 2 ** -8 + bound).all()
    xf = kernel_matmul(x.float(), c, n, lib=lib_)  # float32 activations take the same path
    assert xf.dtype == torch.float32 and ((xf.double() - ref).abs() <= bound).all()


@needs_kernel
def test_vectorized_loops_equal_portable_ones():
    if not lib.dense_bf16_vectorized():
        pytest.skip("this CPU has neither AVX2 with FMA nor AVX512-BF16: only the portable loops build")
    portable = load("qmatmul", portable=True)
    torch.manual_seed(3)
    for m in (1, 6):
        x, w = torch.randn(m, 320).bfloat16(), torch.randn(96, 320).bfloat16()
        c = dense_c_struct(w)
        a = kernel_matmul(x, c, 96, out_dtype=torch.float32, lib=lib)
        b = kernel_matmul(x, c, 96, out_dtype=torch.float32, lib=portable)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)  # the same sums, in another order


@needs_kernel
@pytest.mark.parametrize("m", [1, 4, 31, 64])
def test_linear_equals_pytorch_bf16_linear(m):
    """The layer's method, kernel (up to MAX_ROWS rows) and float32 matmul beyond, against
    PyTorch's bf16 linear: equal within one bf16 rounding."""
    torch.manual_seed(m)
    layer = Linear(96, 80, bias=True, dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(80, 96))
    layer.bias.data.copy_(torch.randn(80))
    layer.method = DenseKernelMethod(lib)
    x = torch.randn(m, 96).bfloat16()
    got, want = layer(x).float(), F.linear(x, layer.weight, layer.bias).float()
    assert ((got - want).abs() <= want.abs() * 2 ** -7 + 0.02).all()


def bf16_folder(tmp_path, arch: str) -> str:
    """A tiny random transformers model of `arch`, saved in bf16 as most hub folders are (weights
    only: the runner needs no tokenizer)."""
    hf = tiny_hf_model(arch, seed=5)
    with torch.no_grad():  # sharp attention, so that positions and every key matter
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
    path = tmp_path / f"{arch}-bf16"
    hf.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return str(path)


def within_bf16(a: torch.Tensor, b: torch.Tensor, f32: torch.Tensor) -> None:
    """`a` (our path) is as close to PyTorch's bf16 path `b` as bf16 rounding explains: within 3x
    `b`'s own distance from the float32 model, and as close to float32 as `b` is (1.5x); the
    same greedy token wherever `b`'s top two are not within that distance."""
    rounding = float((b - f32).abs().max())
    assert float((a - b).abs().max()) <= 3 * rounding, (float((a - b).abs().max()), rounding)
    assert float((a - f32).abs().max()) <= 1.5 * rounding + 1e-3, (float((a - f32).abs().max()), rounding)
    top2 = b.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 6 * rounding
    assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_folder_decodes_in_one_call_like_pytorch_layers(tmp_path, arch):
    """llama: tied head; qwen2: q/k/v biases, untied head. The plan puts every linear on the
    dense kernel and runs the one-call decode step; its logits equal PyTorch's bf16 layers
    (``enforce_eager``: PyTorch's bf16 linear) within bf16 rounding, step by step, and stay as
    close to the float32 model as those do."""
    path = bf16_folder(tmp_path, arch)
    fast = ModelRunner(HFModelDir(path), torch.bfloat16)
    assert fast.native_decoder is not None, fast.plan.describe(fast.model)
    assert "dense-kernel" in fast.plan.describe(fast.model)
    eager = ModelRunner(HFModelDir(path), torch.bfloat16, enforce_eager=True)
    assert eager.native_decoder is None
    f32 = ModelRunner(HFModelDir(path), torch.float32)
    seqs = [OneSequence(r) for r in (fast, eager, f32)]
    prompt = [5, 17, 200, 33, 41, 270, 90, 12, 7, 7, 150]
    within_bf16(*(s.forward(prompt, all_logits=True) for s in seqs))
    for token in [3, 99, 240, 18, 18, 61] + list(range(20, 40)):  # 26 decode steps, past a block boundary
        within_bf16(*(s.forward([token]) for s in seqs))


@needs_kernel
def test_bf16_folder_weights_are_the_files_pages(tmp_path, huge_pages_on):
    """A bf16 folder served in bf16 keeps its weights as views of the mapped file, not copies
    (with huge_pages the linears then move into the arena of 2 MiB pages, and the untied
    embedding table stays mapped); the float32 model of the same folder copies (a conversion)."""
    path = bf16_folder(tmp_path, "qwen2")
    for huge in (False, True):
        source = HFModelDir(path)
        runner = ModelRunner(source, torch.bfloat16, huge_pages=huge)
        (buf, _, _), = source._maps.values()
        start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        mapped = lambda t: start <= t.data_ptr() < start + len(buf)  # noqa: E731
        m = runner.model
        assert mapped(m.embed_tokens.weight)
        assert mapped(m.layers[0].mlp.gate_proj.weight) is not huge and mapped(m.lm_head.weight) is not huge
    f32 = ModelRunner(HFModelDir(path), torch.float32)
    assert f32.model.layers[0].mlp.gate_proj.weight.dtype == torch.float32


def test_decode_weight_bytes_count_one_embedding_row(tmp_path):
    """Untied (qwen2): every weight but the embedding table, plus one row of it. Tied (llama):
    the table once, as the LM head reads it."""
    untied = ModelRunner(HFModelDir(bf16_folder(tmp_path, "qwen2")), torch.bfloat16)
    params = {p.data_ptr(): p.nbytes for p in untied.model.parameters()}
    table = untied.model.embed_tokens.weight
    assert untied.decode_weight_bytes == sum(params.values()) - table.nbytes + table[0].nbytes
    tied = ModelRunner(HFModelDir(bf16_folder(tmp_path, "llama")), torch.bfloat16)
    assert tied.model.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.decode_weight_bytes == sum({p.data_ptr(): p.nbytes for p in tied.model.parameters()}.values())
