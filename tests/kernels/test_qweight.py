"""GGUF codes and our quantized matmul kernel (`nextoken.layers.quantization.qweight`, ``kernels/qmatmul.c``)
against the float32 de-quantization (`nextoken.layers.quantization.ggml`, itself held equal to
`gguf.quants.dequantize`) and against the same integer arithmetic written in PyTorch."""

from __future__ import annotations

import ctypes

import gguf
import pytest
import torch

from nextoken.kernels import cpu_runs, default_isa, load
from nextoken.layers.quantization.methods import CodesMethod
from nextoken.layers.linear import Linear
from nextoken.layers.quantization.qweight import QWEIGHT_TYPES, dense_c_struct, dequantize_bf16, from_gguf, \
    kernel_matmul, qmatmul, qmatmul_reference, quantize_activations, quantize_activations_native
from nextoken.layers.quantization.ggml import dequantize
from tests.helpers.blocks import random_blocks
from tests.helpers.cpu import cpu_has

# 256-column super-blocks: one activation scale per 256 columns
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S",
            "IQ1_M")
# the formats whose 4-bit indices the kernel looks up (kept at 4 bits, not expanded to 8-bit codes)
LUT_FORMATS = ("IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ1_S", "IQ1_M")


def weight(type_name: str, rows: int, cols: int, seed: int):
    """Random blocks of `type_name`: the float32 de-quantized weight and our codes."""
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    raw = torch.from_numpy(random_blocks(type_name, rows * cols // block, seed=seed))
    return dequantize(raw, type_name, (rows, cols)), from_gguf(raw, type_name, rows, cols)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("type_name", QWEIGHT_TYPES)
def test_codes_are_the_dequantized_weight_exactly(type_name):
    w, qw = weight(type_name, 48, 512, seed=21)
    assert torch.equal(qw.dequantize(), w)
    ids = torch.tensor([0, 47, 16, 5, 5, 31])
    assert torch.equal(qw.lookup(ids), w[ids])  # an embedding lookup expands just those rows
    assert qw.nbytes < w.nbytes / 2.5
    if type_name in LUT_FORMATS:  # 4-bit indices, looked up by the kernel
        assert qw.lut and qw.bits == 4 and qw.codes.nbytes == w.numel() // 2


def test_activation_quantization():
    x = torch.tensor([[0.5, -1.27, 0.0, 0.3] * 8 + [0.0] * 32])
    xq, dx = quantize_activations(x)
    assert dx[0, 0] == pytest.approx(1.27 / 127) and dx[0, 1] == 0  # an all-zero block has scale 0
    assert xq[0, 1] == -127 and xq[0, 0] == 50 and (xq[0, 32:] == 0).all()
    x = torch.cat([x, x * 2, torch.zeros(1, 128)], 1)  # 256 columns: one block (the k-quants' super-block)
    xq, dx = quantize_activations(x, 256)
    assert dx.shape == (1, 1) and dx[0, 0] == pytest.approx(2.54 / 127)
    assert xq[0, 1] == -64 and xq[0, 65] == -127 and xq[0, 0] == 25 and (xq[0, 192:] == 0).all()


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("build", ["native", "portable", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_activation_quantization_equals_reference(build, dtype, block):
    """The kernel's quantization (16 lanes at a time with AVX-512, 8 with AVX2, or plain C) gives
    the reference's codes and scales exactly, per 32 columns and per 256 (the k-quants'
    activations), ties to even included (a block whose max is 127 puts x.5 at ties)."""
    if build == "avx2" and not cpu_runs("avx2"):
        pytest.skip("no AVX2 on this CPU")
    lib = load("qmatmul", isa="avx2") if build == "avx2" else load("qmatmul", build == "portable")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 512, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    x[1, :32] = torch.arange(32) - 15.5  # max 15.5: ties scaled by 127 / 15.5
    x[2, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4)  # 1 / d = 1: exact ties
    x[3, 32:64] = 0.0  # an all-zero block
    x[4, 256:] = 0.0  # an all-zero block of 256
    x = x.to(dtype)
    native = quantize_activations_native(x, block, lib=lib)
    assert native is not None, "the C kernel did not build (is gcc installed?)"
    xq, dx = quantize_activations(x, block)
    assert dx.shape == (9, 512 // block)
    assert torch.equal(native[1], dx)
    assert torch.equal(native[0], xq)


@pytest.mark.parametrize("type_name", QWEIGHT_TYPES)
@pytest.mark.parametrize("portable", [False, True])
def test_kernel_equals_reference_arithmetic(type_name, portable):
    """The C kernel (AVX-512 VNNI, or its plain C loops) computes the reference's exact integer
    sums; only the float32 order of the per-group scaling differs. 80 rows (five tiles: two
    pairs and a tile alone; one activation row goes a tile at a time), 512 columns (two
    super-blocks of the K-quants) against 1 and 2 (the super-block path for Q4_K and Q6_K), 4, 6
    (one full pass), 7, 13 and 50 activation rows (more than one block of 48)."""
    lib = load("qmatmul", portable)
    assert lib is not None, "the C kernel did not build (is gcc installed?)"
    assert lib.qmatmul_vectorized() == (0 if portable else int(cpu_has("avx512_vnni") and default_isa() == "native"))
    w, qw = weight(type_name, 80, 512, seed=22)
    bias = torch.randn(80)
    for m in (1, 2, 4, 6, 7, 13, 50):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        ref = qmatmul_reference(x, qw, bias)
        assert rel(qmatmul(x, qw, bias, lib=lib), ref) < 1e-5
        xb = x.to(torch.bfloat16)  # bf16 in, bf16 out
        assert rel(qmatmul(xb, qw, bias, lib=lib), qmatmul_reference(xb, qw, bias)) < 2 ** -7
        exact = x @ w.T + bias  # int8 activations cost about 1% of the output's scale
        assert float((ref - exact).norm() / exact.norm()) < 0.02


SIMD_ISAS = [isa for isa in ("avx2", "avxvnni") if cpu_runs(isa)]


@pytest.mark.parametrize("isa", SIMD_ISAS or [pytest.param("avx2", marks=pytest.mark.skip(reason="no AVX2 here"))])
@pytest.mark.parametrize("type_name", QWEIGHT_TYPES)
def test_simd_loops_equal_the_plain_loop_bit_for_bit(isa, type_name):
    """The AVX2 loop and the AVX-VNNI one (``kernels/qmatmul_avx2.c``, built for those instruction
    sets on any CPU that has them: `nextoken.kernels.ISAS`) give the plain C loop's outputs bit for
    bit: the same integer sums, the same float operations in the same order. Every pass shape: 1
    to 9 rows (one pass over both halves of a tile, one per half, blocks of up to 8 split evenly),
    17, 33 and 512; every format; a bias; bf16 and float32 in."""
    lib, plain = load("qmatmul", isa=isa), load("qmatmul", portable=True)
    assert lib.qmatmul_loop().decode() == {"avx2": "avx2", "avxvnni": "avx-vnni"}[isa]
    assert plain.qmatmul_loop() == b"plain"
    _, qw = weight(type_name, 48, 512, seed=26)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(2))
    for m in (*range(1, 10), 17, 33, 512):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        for xin in (x, x.to(torch.bfloat16)):
            ours = qmatmul(xin, qw, bias, out_dtype=torch.float32, lib=lib)
            assert torch.equal(ours, qmatmul(xin, qw, bias, out_dtype=torch.float32, lib=plain)), (m, xin.dtype)


@pytest.mark.parametrize("build", ["native", "portable", "avx2"])
def test_rounded_float_output_equals_the_bf16_output_widened(build):
    """``rounded`` (the LM head's logits: float32 out, rounded as a bf16 output) gives the bf16
    output's values exactly, on every store of the kernel: one row, a few, 40 (AMX blocks where
    the CPU has them), a super-block format, a legacy one with a bias, and dense bf16 weights."""
    if build == "avx2" and not cpu_runs("avx2"):
        pytest.skip("no AVX2 on this CPU")
    lib = load("qmatmul", isa="avx2") if build == "avx2" else load("qmatmul", build == "portable")
    for type_name in ("Q6_K", "Q8_0"):
        _, qw = weight(type_name, 48, 512, seed=28)
        bias = torch.randn(48, generator=torch.Generator().manual_seed(4)) if type_name == "Q8_0" else None
        for m in (1, 3, 40):
            x = (torch.randn(m, 512, generator=torch.Generator().manual_seed(m)) * 2).to(torch.bfloat16)
            want = qmatmul(x, qw, bias, lib=lib).float()
            got = qmatmul(x, qw, bias, out_dtype=torch.float32, lib=lib, rounded=True)
            assert got.dtype == torch.float32 and torch.equal(got, want), (type_name, m)
    dense = torch.randn(48, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    c = dense_c_struct(dense)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    want = kernel_matmul(x, c, 48, lib=lib).float()
    assert torch.equal(kernel_matmul(x, c, 48, torch.float32, lib=lib, rounded=True), want)


@pytest.mark.parametrize("type_name", QWEIGHT_TYPES)
def test_amx_loop_equals_the_vnni_loop_bit_for_bit(type_name):
    """Calls of 32 rows or more run their blocks of 16 rows on AMX tiles (``kernels/qmatmul_amx.c``):
    the same integer sums as the AVX-512 VNNI loop and the same float operations after them, so every
    output equals that loop's bit for bit: full blocks of 16 rows and the tails the VNNI loop takes (33, 47),
    an odd number of groups (544 columns), a bias, bf16 and float32 in and out."""
    lib = load("qmatmul")
    assert lib is not None, "the C kernel did not build (is gcc installed?)"
    if not lib.qmatmul_amx(-1):
        pytest.skip("this CPU has no AMX-INT8 (or its kernel refuses the tile data)")
    cols = [512] + ([544] if type_name not in K_QUANTS else [])
    try:
        for k in cols:
            _, qw = weight(type_name, 48, k, seed=27)
            lib.qmatmul_amx(1)
            assert lib.qmatmul_amx_takes(ctypes.byref(qw.c_struct()), 32) == 1  # (else this compares VNNI with itself)
            bias = torch.randn(48, generator=torch.Generator().manual_seed(3))
            for m in (31, 32, 33, 47, 64, 130):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
                for xin, out in ((x, torch.float32), (x.to(torch.bfloat16), torch.bfloat16)):
                    assert lib.qmatmul_amx(1)
                    amx = qmatmul(xin, qw, bias, out_dtype=out, lib=lib)
                    lib.qmatmul_amx(0)
                    vnni = qmatmul(xin, qw, bias, out_dtype=out, lib=lib)
                    assert torch.equal(amx, vnni), (k, m, xin.dtype)
    finally:
        lib.qmatmul_amx(1)


@pytest.mark.parametrize("type_name", QWEIGHT_TYPES)
def test_kernel_rows_do_not_depend_on_their_neighbours(type_name):
    """One row alone (decode: one tile at a time, the L2 prefetch), two, four, five, seven and
    eight (a few sequences' decode: one tile a task, one pass of up to eight rows), twelve (pairs
    of tiles, passes of six, still streamed), and the same row among 13 and 40 (past the decode
    rows: the L1 prefetch) give the same output bit for bit, so a token scored in a prefill or a
    verification step gets the logits a decode step would give it."""
    _, qw = weight(type_name, 80, 512, seed=25)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    lib = load("qmatmul")
    many = qmatmul(x, qw, out_dtype=torch.float32, lib=lib)
    assert many is not None, "the C kernel did not build (is gcc installed?)"
    for i in (0, 5, 12):
        assert torch.equal(qmatmul(x[i : i + 1], qw, out_dtype=torch.float32, lib=lib), many[i : i + 1])
    for a, b in ((6, 8), (8, 12), (0, 5), (2, 9), (0, 8), (1, 13)):
        assert torch.equal(qmatmul(x[a:b], qw, out_dtype=torch.float32, lib=lib), many[a:b]), (a, b)
    x40 = torch.cat([x, x, x, x[:1]])  # 40 rows: two blocks of 16 on AMX where the CPU has it, 8 on VNNI
    assert torch.equal(qmatmul(x40, qw, out_dtype=torch.float32, lib=lib)[26:39], many)
    assert qw.act_block == (256 if type_name in K_QUANTS else 32)


@pytest.mark.parametrize("type_name", QWEIGHT_TYPES)
@pytest.mark.parametrize("portable", [False, True])
def test_kernel_lookup_equals_reference(type_name, portable):
    """``qlookup_bf16`` (the quick start's embedding lookup) is `QuantWeight.lookup` cast to bf16."""
    import ctypes

    _, qw = weight(type_name, 48, 512, seed=22)
    ids = torch.tensor([0, 47, 16, 5, 5, 31])
    out = torch.empty(len(ids), 512, dtype=torch.bfloat16)
    lib = load("qmatmul", portable)
    assert lib.qlookup_bf16(ctypes.byref(qw.c_struct()), ctypes.c_void_p(ids.data_ptr()), len(ids),
                            ctypes.c_void_p(out.data_ptr())) == 0
    assert torch.equal(out, qw.lookup(ids).to(torch.bfloat16))
    bad = torch.tensor([48])
    assert lib.qlookup_bf16(ctypes.byref(qw.c_struct()), ctypes.c_void_p(bad.data_ptr()), 1,
                            ctypes.c_void_p(out.data_ptr())) == 2


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K"])
def test_embedding_lookup_on_the_kernel_equals_the_pytorch_one(type_name):
    """A codes embedding with the plan's lookup kernel (what a bf16 model on our kernels gets)
    returns the PyTorch lookup's rows bit for bit; an id outside the table still raises, as the
    PyTorch path does; a float32 table keeps the PyTorch path."""
    from nextoken.layers.embedding import Embedding

    _, qw = weight(type_name, 48, 512, seed=22)
    emb = Embedding(48, 512, torch.bfloat16)
    emb.set_qweight(qw)
    ids = torch.tensor([3, 47, 0, 3])
    want = emb(ids)
    emb.lookup_kernel = load("qmatmul")
    assert emb._lookup_c(ids) is not None and torch.equal(emb(ids), want)
    with pytest.raises(IndexError):
        emb(torch.tensor([48]))
    emb.dtype = torch.float32
    assert emb._lookup_c(ids) is None


@pytest.mark.parametrize("type_name", K_QUANTS + ("Q5_1",))
@pytest.mark.parametrize("portable", [False, True])
def test_dense_expansion_equals_reference(type_name, portable):
    w, qw = weight(type_name, 32, 512, seed=23)
    dense = dequantize_bf16(qw, lib=load("qmatmul", portable))
    assert dense.shape == (32, 512)
    assert (dense.float() - w).abs().max() <= 2 ** -8 * w.abs().max()


def test_linear_paths_agree():
    """The kernel (every row count, here across row blocks) and the path without it (the weight
    expanded to bf16 for one matmul) give the same rows, both near the float32 product."""
    w, qw = weight("Q4_K", 96, 512, seed=24)
    lin = Linear(512, 96, False, torch.bfloat16)
    lin.set_qweight(qw, CodesMethod(load("qmatmul")))
    assert lin.weight is None
    x = torch.randn(100, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    kernel = lin(x).float()
    expanded = torch.nn.functional.linear(x, dequantize_bf16(qw, lib=load("qmatmul"))).float()
    few = torch.cat([lin(x[i : i + 4]).float() for i in range(0, len(x), 4)])
    ref = x.float() @ w.T
    assert float((expanded - ref).norm() / ref.norm()) < 1e-2
    assert float((kernel - ref).norm() / ref.norm()) < 2e-2
    assert torch.equal(kernel, few)  # rows are independent of their neighbours
