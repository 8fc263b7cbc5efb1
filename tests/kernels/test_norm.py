"""RMSNorm: our C kernel (``kernels/activation.c``, ``rms_norm(..., kernel=kernels.load("activation"))``) against its
reference, the PyTorch expression in ``layers/norm.py`` (transformers' LlamaRMSNorm order), and
both against the float32 value as the independent oracle."""

import pytest
import torch

from nextoken import kernels
from nextoken.layers.norm import rms_norm, rms_norm_gemma


@pytest.fixture(scope="module")
def lib():
    lib = kernels.load("activation")
    assert lib is not None, "the activation kernel did not build (is gcc installed?)"
    return lib


def rows(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 20).bfloat16()
    w = (torch.randn(shape[1], generator=g) * 2).bfloat16()
    return x, w


@pytest.mark.parametrize("shape", [(512, 1536), (3, 37), (1, 1), (7, 4100), (64, 576)])
def test_native_rms_norm_equals_pytorch_but_for_rare_roundings(lib, shape):
    """Sizes: Qwen2.5-1.5B's prefill (rows over threads), tails shorter than a vector, one value,
    a long row, SmolLM2's width. Rows of very different scales."""
    x, w = rows(shape, shape[1])
    out = rms_norm(x, w, 1e-6, kernel=kernels.load("activation"))
    ref = rms_norm(x, w, 1e-6)
    xf = x.float()
    exact = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()  # float32 oracle
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    tol = exact.abs() * 2 ** -7 + 1e-30  # two roundings to bf16 (2^-9 each) and a float32 mean
    assert (out.float() - exact).abs().le(tol).all()
    assert (ref.float() - exact).abs().le(tol).all()
    # where they differ at all, by one bf16 step of the output (a last-bit change of the mean)
    assert (out.float() - ref.float()).abs().le(ref.float().abs() * 2 ** -7 + 1e-30).all()
    assert (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("shape", [(512, 640), (3, 37), (1, 1), (7, 1152)])
def test_native_gemma_norm_equals_pytorch_but_for_rare_roundings(lib, shape):
    """Gemma's norm (the weight's product in float32, one rounding: ``rms_norm_rows_gemma``,
    the decode step's) against `rms_norm_gemma`'s PyTorch expression and the float32 value;
    widths of Gemma 3 270M and 1B."""
    x, w = rows(shape, shape[1] + 1)
    out = rms_norm_gemma(x, w, 1e-6, kernel=lib)
    ref = rms_norm_gemma(x, w, 1e-6)
    xf = x.float()
    exact = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    tol = exact.abs() * 2 ** -8 + 1e-30  # one rounding to bf16 and a float32 mean
    assert (out.float() - exact).abs().le(tol).all() and (ref.float() - exact).abs().le(tol).all()
    assert (out.float() - ref.float()).abs().le(ref.float().abs() * 2 ** -7 + 1e-30).all()
    assert (out != ref).float().mean() < 0.01
    x3 = x[None]  # (3-D, a per-head norm's shape: the PyTorch expression)
    assert torch.equal(rms_norm_gemma(x3, w, 1e-6, kernel=lib), rms_norm_gemma(x3, w, 1e-6))


def test_portable_loop_equals_the_vectorized_kernel(lib):
    """The plain C loop (CPUs without AVX-512) against the AVX-512 body: the same float32 squares
    summed in float64 in another order, so equal but where the mean's last bit moves a rounding."""
    portable = kernels.load("activation", portable=True)
    assert portable is not None and portable.activation_vectorized() == 0
    x, w = rows((40, 1000), 3)
    out = torch.empty_like(x)
    portable.rms_norm_rows_bf16(x.data_ptr(), w.data_ptr(), x.shape[0], x.shape[1], 1e-5, out.data_ptr())
    fast = rms_norm(x, w, 1e-5, kernel=kernels.load("activation"))
    assert (out.float() - fast.float()).abs().le(fast.float().abs() * 2 ** -8 + 1e-30).all()
    assert (out != fast).float().mean() < 0.001


def test_zero_rows_and_eps(lib):
    """A row of zeros gives zeros (eps keeps the root finite); a large eps damps small rows."""
    x = torch.zeros(2, 64).bfloat16()
    x[1] = 0.01
    w = torch.ones(64).bfloat16()
    out = rms_norm(x, w, 1.0, kernel=kernels.load("activation"))
    assert torch.equal(out, rms_norm(x, w, 1.0))
    assert out[0].eq(0).all() and out[1].float().sub(0.01 / (1 + 1e-4) ** 0.5).abs().lt(1e-4).all()


def test_other_inputs_take_pytorch():
    """float32, a 3-D x (per-head norms) and a non-contiguous x use the PyTorch expression."""
    before = kernels.fallbacks["rms_norm"]
    x, w = torch.randn(4, 64), torch.randn(64)
    assert torch.equal(rms_norm(x, w, 1e-6, kernel=kernels.load("activation")), rms_norm(x, w, 1e-6))
    xb, wb = x.bfloat16(), w.bfloat16()
    strided = xb.t().contiguous().t()
    assert not strided.is_contiguous()
    assert torch.equal(rms_norm(strided, wb, 1e-6, kernel=kernels.load("activation")), rms_norm(strided, wb, 1e-6))
    x3 = torch.randn(4, 2, 64).bfloat16()
    assert torch.equal(rms_norm(x3, wb, 1e-6, kernel=kernels.load("activation")), rms_norm(x3, wb, 1e-6))
    assert kernels.fallbacks["rms_norm"] > before  # each such call is counted, never silent



@pytest.mark.parametrize("gemma", [False, True])
def test_the_final_norm_in_place_equals_a_new_output(lib, gemma):
    """`add_rms_norm(..., in_place=True)` (the one-call decode step's final norm) writes the C
    kernel's output over h: the same values as into a new tensor, and h is that tensor; the
    PyTorch path (no kernel) leaves h alone and returns a new one."""
    from nextoken.layers.norm import add_rms_norm

    x, w = rows((16, 576), 9)
    want = add_rms_norm(x.clone(), None, w, 1e-6, lib, gemma=gemma)[1]
    h = x.clone()
    s, y = add_rms_norm(h, None, w, 1e-6, lib, gemma=gemma, in_place=True)
    assert y is h and s is h and torch.equal(y, want) and not torch.equal(h, x)
    h = x.clone()
    y = add_rms_norm(h, None, w, 1e-6, None, gemma=gemma, in_place=True)[1]
    assert y is not h and torch.equal(h, x)
