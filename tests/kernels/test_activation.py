"""The gated activations: our C SwiGLU (``kernels/activation.c``) against its reference, PyTorch's
``F.silu(gate) * up`` in bf16 (silu rounded to bf16, then the product: the kernel rounds the
same way, so only the last bits of e^-x may move a rounding), and the float32 value as the
independent oracle."""

import pytest
import torch
import torch.nn.functional as F

from nextoken import kernels
from nextoken.layers.activation import silu_and_mul


@pytest.fixture(scope="module")
def lib():
    lib = kernels.load("activation")
    assert lib is not None, "the activation kernel did not build (is gcc installed?)"
    return lib


@pytest.mark.parametrize("shape", [(512, 8960), (3, 37), (1, 1), (7, 4100)])
def test_native_swiglu_within_one_bf16_step(lib, shape):
    """Sizes: Qwen2.5-1.5B's prefill (several OpenMP chunks), tails shorter than a vector, one
    value, a chunk and a bit. Gates spread over +-40 so e^-x both overflows and underflows."""
    g = torch.Generator().manual_seed(shape[1])
    gate = (torch.randn(*shape, generator=g) * 8).clamp(-40, 40).bfloat16()
    up = torch.randn(*shape, generator=g).bfloat16()
    out = silu_and_mul(gate, up, kernel=kernels.load("activation"))
    exact = (F.silu(gate.float()) * up.float())  # float32 oracle
    ref = silu_and_mul(gate, up)  # PyTorch in bf16
    assert out.dtype == torch.bfloat16 and out.shape == gate.shape
    assert (out.float() - exact).abs().le(exact.abs() * 2 ** -7 + 1e-30).all()  # two roundings of 2^-9
    assert (out.float() - ref.float()).abs().le(ref.float().abs() * 2 ** -7 + 1e-30).all()
    assert (out != ref).float().mean() < 0.01  # PyTorch's values but for rare roundings


def test_portable_loop_equals_the_vectorized_kernel(lib):
    """The plain C loop (CPUs without AVX-512) against the AVX-512 body: the same roundings, so
    equal except where e^-x's last bits move a rounding (one bf16 step)."""
    portable = kernels.load("activation", portable=True)
    assert portable is not None and portable.activation_vectorized() == 0
    g = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(1000, generator=g) * 6).bfloat16(), torch.randn(1000, generator=g).bfloat16()
    out = torch.empty_like(gate)
    portable.silu_mul_bf16(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    fast = silu_and_mul(gate, up, kernel=kernels.load("activation"))
    assert (out.float() - fast.float()).abs().le(fast.float().abs() * 2 ** -8 + 1e-30).all()
    assert (out != fast).float().mean() < 0.01


def test_native_swiglu_special_values(lib):
    gate = torch.tensor([0.0, -0.0, 100.0, -100.0, float("inf"), float("-inf"), float("nan"), 1.0]).bfloat16()
    up = torch.tensor([1.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0, float("nan")]).bfloat16()
    out = silu_and_mul(gate, up, kernel=kernels.load("activation")).float()
    assert out[:3].tolist() == [0.0, 0.0, 200.0]
    assert out[3].abs() < 1e-30  # silu(-100) is about -3.7e-42
    assert out[4] == float("inf") and out[6].isnan() and out[7].isnan()
    assert out[5].isnan() == F.silu(torch.tensor(float("-inf"))).isnan()  # -inf * 0 or -inf / inf


def test_non_contiguous_or_float32_inputs_take_pytorch():
    before = kernels.fallbacks["silu_and_mul"]
    gate, up = torch.randn(4, 64), torch.randn(4, 64)
    assert torch.equal(silu_and_mul(gate, up, kernel=kernels.load("activation")), F.silu(gate) * up)
    gb, ub = gate.bfloat16().t(), up.bfloat16().t()
    assert torch.equal(silu_and_mul(gb, ub, kernel=kernels.load("activation")), F.silu(gb) * ub)
    assert kernels.fallbacks["silu_and_mul"] > before  # each such call is counted, never silent



@pytest.mark.parametrize("shape", [(512, 2048), (3, 37), (1, 1)])
def test_native_geglu_within_one_bf16_step(lib, shape):
    """Gemma's GeGLU kernel against PyTorch's ``F.gelu(gate, approximate="tanh") * up`` in bf16
    and the float32 value, gates over +-40 (tanh saturates) and tails shorter than a vector."""
    from nextoken.layers.activation import gelu_tanh_and_mul

    g = torch.Generator().manual_seed(shape[1] + 1)
    gate = (torch.randn(*shape, generator=g) * 4).clamp(-40, 40).bfloat16()
    gate.view(-1)[-2:] = torch.tensor([40.0, -40.0])[-gate.numel():]
    up = torch.randn(*shape, generator=g).bfloat16()
    out = gelu_tanh_and_mul(gate, up, kernel=lib)
    exact = F.gelu(gate.float(), approximate="tanh") * up.float()
    ref = gelu_tanh_and_mul(gate, up)
    assert (out.float() - exact).abs().le(exact.abs() * 2 ** -7 + 1e-6).all()
    assert (out.float() - ref.float()).abs().le(ref.float().abs() * 2 ** -7 + 1e-6).all()
    # PyTorch's x/2 (1 + tanh a) cancels to 0 below x = -4 or so, where the kernel's x / (1 + e^-2a)
    # keeps the tiny true value (the float32 check above): elsewhere the same values but for rare roundings
    big = exact.abs() > 1e-3
    assert (out != ref)[big].sum() <= 0.01 * big.sum()


@pytest.mark.parametrize("fn", ["silu_mul_bf16", "gelu_tanh_mul_bf16"])
def test_avx2_bodies_equal_the_portable_loop_but_for_rare_roundings(fn):
    """The AVX2 bodies (exp8; any x86 CPU with AVX2 runs them, so they are built and run here when
    this CPU has AVX2) against the plain C loops."""
    if not kernels.cpu_runs("avx2"):
        pytest.skip("this CPU has no AVX2")  # the plain loop is then what runs, and it is tested above
    avx2, portable = kernels.load("activation", isa="avx2"), kernels.load("activation", portable=True)
    assert avx2.activation_vectorized() == 1 and portable.activation_vectorized() == 0
    g = torch.Generator().manual_seed(9)
    gate, up = (torch.randn(5003, generator=g) * 6).bfloat16(), torch.randn(5003, generator=g).bfloat16()
    a, b = torch.empty_like(gate), torch.empty_like(gate)
    getattr(avx2, fn)(gate.data_ptr(), up.data_ptr(), a.data_ptr(), gate.numel())
    getattr(portable, fn)(gate.data_ptr(), up.data_ptr(), b.data_ptr(), gate.numel())
    assert (a.float() - b.float()).abs().le(b.float().abs() * 2 ** -8 + 1e-6).all()
    assert (a != b).float().mean() < 0.01
