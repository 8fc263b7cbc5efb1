"""The BERT encoder's C kernels (kernels/encoder.c) against float64 references: attention within
packed sequences of every length a vector loop can trip on (1 key, 7, 8, 9, 31, 33, more than
128), for heads of 32 and 64 columns (compiled apart) and of 16 (the general path), in float32
and bf16; LayerNorm of a residual sum against PyTorch's, bf16 and float32, and with a float32
branch (one rounding less). Each for the native, AVX2 and portable builds."""

from __future__ import annotations

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
