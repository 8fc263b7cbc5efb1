"""The batch-invariant Triton matmul and RMSNorm (`kernels.gpu.batch_invariant`) against float64
arithmetic and PyTorch's own formula, and the property they exist for: a row's output is the
same bits whatever the other rows of the call are and however many there are.

Without a GPU the kernels' own source runs under Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py); with one (``TRITON_INTERPRET=0``, as benchmarks/gpu_check.py runs
the tests) compiled, on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu.batch_invariant import linear, rms_norm  # noqa: E402
from tests.helpers.triton_device import randn  # noqa: E402

ULP = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -23}  # half a unit in the last place, relative


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_linear_is_the_rounded_exact_product_and_rows_are_independent(dtype, m):
    """K = 200 and N = 100 (neither a multiple of the tiles): each output is the float64 product
    plus bias rounded to the dtype, within a rounding of the float32 sum; each row equals the
    row computed alone and among other rows (70: two tiles of rows)."""
    k, n = 200, 100
    x, w, b = randn(m, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
    y = linear(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    assert y.dtype == dtype and y.shape == (m, n)
    bound = exact.abs() * 2 * ULP[dtype] + x.double().abs() @ w.double().abs().T * k * 2.0 ** -24
    assert ((y.double() - exact).abs() <= bound).all()
    others = torch.cat([randn(37, k, dtype=dtype, seed=4), x])  # the same rows after 37 others
    assert torch.equal(linear(others, w, b)[37:], y)
    for i in {0, m // 2, m - 1}:
        assert torch.equal(linear(x[i : i + 1], w, b), y[i : i + 1])
    assert torch.equal(linear(x[:, None, :], w, None).squeeze(1), linear(x, w, None))  # leading dims kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_equals_pytorchs_formula_row_by_row(dtype, gemma):
    """Rows of 96 (a width that is not a power of two): PyTorch's `layers.norm` formula (Llama's
    order, or Gemma's float32 product) within one unit in the last place where the float32 mean
    rounds differently; each row alone equals the row in any batch; 3-D inputs (heads) too."""
    from nextoken.layers.norm import rms_norm as torch_rms_norm
    from nextoken.layers.norm import rms_norm_gemma

    x, w = randn(9, 96, dtype=dtype, seed=5) * 3, randn(96, dtype=dtype, seed=6)
    y = rms_norm(x, w, 1e-6, gemma=gemma)
    ref = (rms_norm_gemma if gemma else torch_rms_norm)(x, w, 1e-6)
    assert y.dtype == dtype
    step = ref.double().abs() * 4 * ULP[dtype] + 1e-30
    assert ((y.double() - ref.double()).abs() <= step).all()
    if dtype == torch.bfloat16:  # (in float32 a mean one unit apart moves the whole row)
        assert (y == ref).double().mean() > 0.9
    for i in (0, 4, 8):
        assert torch.equal(rms_norm(x[i : i + 1], w, 1e-6, gemma=gemma), y[i : i + 1])
    others = torch.cat([randn(40, 96, dtype=dtype, seed=7), x])  # (over two programs' rows)
    assert torch.equal(rms_norm(others, w, 1e-6, gemma=gemma)[40:], y)
    heads = x.view(9, 3, 32)
    assert torch.equal(rms_norm(heads, w[:32], 1e-6, gemma=gemma),
                       rms_norm(heads.reshape(27, 32), w[:32], 1e-6, gemma=gemma).view(9, 3, 32))


def test_shapes_that_do_not_fit_are_refused():
    x, w = randn(2, 8, dtype=torch.float32, seed=0), randn(4, 6, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        linear(x, w)
    with pytest.raises(ValueError, match="does not fit"):
        linear(x, randn(4, 8, dtype=torch.bfloat16, seed=0))
    with pytest.raises(ValueError, match="does not fit"):
        rms_norm(x, w[0], 1e-6)
    assert linear(x[:0], randn(4, 8, dtype=torch.float32, seed=0)).shape == (0, 4)


@pytest.mark.parametrize("dim", [64, 128, 80])
def test_the_int8_caches_key_rotation_on_a_gpu(dim):
    """`kv_cache.tensors.hadamard_rows` on a GPU is this linear by the symmetric
    `hadamard_matrix` (bf16 queries widened to float32 first): the float64 rotation within
    float32 rounding, each row the same bits alone or among others."""
    from nextoken.kv_cache.tensors import hadamard_matrix, hadamard_rows

    x = randn(9, 3, dim, dtype=torch.bfloat16, seed=5)
    h = hadamard_matrix(dim).to(x.device)
    y = linear(x.float(), h)
    exact = x.double() @ h.double()
    assert y.dtype == torch.float32 and torch.allclose(y.double(), exact, rtol=0, atol=1e-5 * float(exact.abs().max()))
    assert torch.equal(linear(x[4:5].float(), h), y[4:5])
    if x.is_cuda:
        assert torch.equal(hadamard_rows(x, h), y)
