"""The BERT encoder's C kernels (kernels/encoder.c) against float64 references: attention within
packed sequences of every length a vector loop can trip on (1 key, 7, 8, 9, 31, 33, more than
128), for heads of 32 and 64 columns (compiled apart) and of 16 (the general path), in float32
and bf16; LayerNorm of a residual sum against PyTorch's, bf16 and float32, and with a float32
branch (one rounding less); GELU against its exact form. Each for the native, AVX2 and portable
builds."""

from __future__ import annotations

import itertools

import pytest
import torch

from nextoken.kernels import load

LENS = [1, 2, 7, 8, 9, 31, 33, 64, 100, 130]


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def lib(request):
    """The library as the CPU's own build, the AVX2 build (Zen 3) and the portable one (SSE: the
    vector extensions' 8 lanes as pairs of 4), each where this CPU runs it."""
    from nextoken.kernels import cpu_runs

    if not cpu_runs(request.param):
        pytest.skip(f"this CPU cannot run a {request.param} build")
    lib = load("encoder", isa=request.param)
    assert lib is not None
    return lib


def reference_attention(qkv: torch.Tensor, lens: list[int], heads: int) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(D)) v within each sequence."""
    t, h3 = qkv.shape
    h, out, at = h3 // 3, torch.empty(t, h3 // 3, dtype=torch.float64), 0
    for n in lens:
        q, k, v = (z.view(n, heads, -1).transpose(0, 1) for z in qkv[at : at + n].double().split(h, -1))
        att = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1) @ v
        out[at : at + n] = att.transpose(0, 1).reshape(n, h)
        at += n
    return out


def run_attention(lib, qkv: torch.Tensor, lens: list[int], heads: int) -> tuple[int, torch.Tensor]:
    t, h = qkv.shape[0], qkv.shape[1] // 3
    starts, n = torch.tensor([0, *lens[:-1]]).cumsum(0), torch.tensor(lens)
    out = torch.empty(t, h, dtype=qkv.dtype)
    rc = lib.encoder_attention(qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), t, h, heads, starts.data_ptr(),
                               n.data_ptr(), len(lens), out.data_ptr())
    return rc, out


@pytest.mark.parametrize("head_dim,heads", [(32, 12), (64, 4), (16, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_within_packed_sequences(lib, head_dim, heads, dtype):
    torch.manual_seed(head_dim)
    qkv = (torch.randn(sum(LENS), 3 * head_dim * heads) * 2).to(dtype)
    rc, out = run_attention(lib, qkv, LENS, heads)
    want = reference_attention(qkv, LENS, heads)  # of the inputs as given (bf16 values exactly)
    assert rc == 0
    if dtype == torch.float32:
        assert (out.double() - want).abs().max() < 2e-5  # float32 sums of up to 130 terms of values near 4
    else:  # one rounding of the float32 result: within a bf16 ulp of the exact value (and the float32
        # error of a sum whose terms cancel, where the result is near 0)
        ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert ((out.double() - want).abs() <= ulp + 2e-5).all()


def test_heads_the_kernel_does_not_take_are_refused(lib):
    """A head that is not a multiple of 8 columns, or wider than 128, returns 1 (the model then
    runs PyTorch's attention and counts a fallback), writing nothing."""
    for head_dim in (12, 136):
        qkv = torch.randn(10, 3 * head_dim)
        rc, _ = run_attention(lib, qkv, [4, 6], 1)
        assert rc == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_equals_pytorchs(lib, dtype):
    torch.manual_seed(1)
    t, n = 300, 384
    x, r = torch.randn(t, n).to(dtype), torch.randn(t, n).to(dtype)
    w, b = (torch.rand(n) + 0.5).to(dtype), torch.randn(n).to(dtype)
    out = torch.empty_like(x)
    bf16 = int(dtype == torch.bfloat16)
    assert lib.encoder_add_norm(x.data_ptr(), r.data_ptr(), 0, w.data_ptr(), b.data_ptr(), bf16, t, n, 1e-12,
                                out.data_ptr()) == 0
    want = torch.nn.functional.layer_norm(x + r, (n,), w, b, 1e-12)
    if dtype == torch.float32:
        assert torch.allclose(out, want, atol=2e-5)
    else:  # the same roundings; a float32 sum order may move one in a thousand by an ulp
        diff = (out.float() - want.float()).abs()
        assert (diff > 0).float().mean() < 1e-3 and diff.max() <= 2 ** -6
    if bf16:  # a float32 branch: the sum unrounded, closer to float64 than PyTorch's double rounding
        r32 = torch.randn(t, n)
        assert lib.encoder_add_norm(x.data_ptr(), r32.data_ptr(), 1, w.data_ptr(), b.data_ptr(), 1, t, n, 1e-12,
                                    out.data_ptr()) == 0
        exact = torch.nn.functional.layer_norm(x.double() + r32.double(), (n,), w.double(), b.double(), 1e-12)
        rounded = torch.nn.functional.layer_norm(x + r32.bfloat16(), (n,), w, b, 1e-12)
        assert (out.double() - exact).abs().mean() < (rounded.double() - exact).abs().mean()


def int8_reference(x: torch.Tensor, packed) -> torch.Tensor:
    """float64 out = x_q W_q^T + b of the codes both sides stand for: x's (smoothed) 7-bit codes
    with a minimum per block of 32 (`quantize_u7`, as the kernel computes them) and the Q8_0
    weight (smoothed)."""
    from nextoken.models.bert import quantize_u7

    q, step, lo = quantize_u7(x, packed.smooth)
    xq = (q.double() * step.double() + lo.double()).view(x.shape)
    return xq @ packed.dequantized().double().T + packed.bias.double()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 33, 512])
def test_int8_gemm_equals_the_plain_loop_and_its_reference(lib, rows):
    """``encoder_linear_s8`` (the encoder's Q8_0 linears): every build's loop (AVX-512 VNNI,
    AVX-VNNI, AVX2) equals the plain C loop bit for bit, at row counts around each loop's tile of
    4 or 8 rows and a panel of 16 columns cut short (N = 40); and each equals the float64 sum of
    the quantized operands within float32 rounding. Inputs: float32 and bf16 rows with an outlier
    column, a constant row (its blocks' range is 0) and a zero row; float32 and bf16 outputs;
    with and without SmoothQuant's factors."""
    from nextoken.kernels import load
    from nextoken.models.bert import PackedS8

    torch.manual_seed(rows)
    k, n = 96, 40
    w, b = torch.randn(n, k) * 0.1, torch.randn(n)
    x = torch.randn(rows, k)
    x[:, 3] *= 30
    x[rows // 2] = 0.7
    x[-1] = 0.0
    plain = load("encoder", portable=True)
    for packed, dtype in itertools.product((PackedS8.quantize(w, b), PackedS8.quantize(w, b, x.abs().amax(0))),
                                           (torch.float32, torch.bfloat16)):
        for out in (torch.float32, torch.bfloat16):
            xs = x.to(dtype)
            got, want = packed(xs, lib, out), packed(xs, plain, out)
            assert torch.equal(got, want)
            ref = int8_reference(xs.float(), packed)
            tol = 2 ** -22 * (xs.float().abs().double() @ packed.dequantized().abs().double().T + 1) * 8
            if out == torch.bfloat16:
                tol = tol + ref.abs() * 2 ** -8
            assert ((got.double() - ref).abs() <= tol).all()


def test_int8_gemm_is_near_the_float_linear(lib):
    """Gaussian weights and activations: the int8 linear's relative error is what rounding to
    the two grids predicts (a block of 32 normal values spans about 4.8 sigma: 7-bit steps of
    0.038 sigma, error sigma / 91; Q8_0's steps amax / 127, error sigma / 170: about 1.25% in
    all) and not more."""
    from nextoken.models.bert import PackedS8

    torch.manual_seed(0)
    w, b, x = torch.randn(384, 384) * 0.05, torch.randn(384) * 0.1, torch.randn(300, 384)
    want = torch.nn.functional.linear(x, w, b)
    got = PackedS8.quantize(w, b)(x, lib, torch.float32)
    assert 0.008 < (got - want).norm() / want.norm() < 0.016


def test_smoothing_moves_an_outlier_column_into_the_weight(lib):
    """An activation column 50x the others (as BERT's hidden states have) coarsens its blocks'
    7-bit steps for every other column; with SmoothQuant's factors from the columns' maxima the
    int8 linear's error against float32 drops by more than half."""
    from nextoken.models.bert import PackedS8

    torch.manual_seed(0)
    w, b, x = torch.randn(64, 128) * 0.05, torch.zeros(64), torch.randn(300, 128)
    x[:, 7] *= 50
    want = torch.nn.functional.linear(x, w, b)
    plain, smoothed = PackedS8.quantize(w, b), PackedS8.quantize(w, b, x.abs().amax(0))
    err = [float((p(x, lib, torch.float32) - want).norm() / want.norm()) for p in (plain, smoothed)]
    assert err[1] < err[0] / 2, err


def test_int8_gemm_refuses_inputs_not_in_blocks_of_32(lib):
    from nextoken.errors import ModelLoadError
    from nextoken.models.bert import PackedS8

    with pytest.raises(ModelLoadError, match="multiple of 32"):
        PackedS8.quantize(torch.randn(16, 40), torch.zeros(16))
    x, out = torch.randn(2, 40), torch.empty(2, 16)
    assert lib.encoder_linear_s8(x.data_ptr(), 0, 2, 40, None, 0, 0, 0, 0, 16, 0, out.data_ptr()) == 1
    packed = PackedS8.quantize(torch.randn(16, 64), torch.zeros(16))
    assert packed(torch.empty(0, 64), lib, torch.float32).shape == (0, 16)  # no rows: nothing to do, no error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_equals_the_exact_form(lib, dtype):
    """``encoder_gelu`` against float64 x / 2 (1 + erf(x / sqrt 2)), in place, over the range a BERT
    intermediate takes and past it (e^(-z^2) underflows, erf saturates), signed zeros, and a length
    with a tail for every vector width. The formula's 1 + erf cancels for negative x (as PyTorch's
    F.gelu does), so the bound is absolute: float32 within 3e-7 |x|, bf16 within that plus its own
    rounding (2^-8 of the value), both beside the float32 rounding of the value itself."""
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(4099, generator=g) * 3, torch.linspace(-12, 12, 1001),
                   torch.tensor([0.0, -0.0, 40.0, -40.0])])
    y = x.to(dtype).contiguous()
    xd = y.double()
    want = xd / 2 * (1 + torch.erf(xd / 2 ** 0.5))
    lib.encoder_gelu(y.data_ptr(), int(dtype == torch.bfloat16), y.numel(), y.data_ptr())
    err = (y.double() - want).abs() - 3e-7 * xd.abs() - want.abs() * 2 ** -21  # (and 4 float32 ulps)
    if dtype == torch.bfloat16:
        err -= want.abs() * 2 ** -8
    assert float(err.max()) <= 1e-30
    if dtype == torch.bfloat16:  # and mostly the very bits of PyTorch's
        assert float((y != torch.nn.functional.gelu(x.to(dtype))).float().mean()) < 0.05
