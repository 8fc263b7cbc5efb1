"""The GPU path's row-wise Triton kernels (`kernels.gpu.rowwise`) against their PyTorch references
(`layers.activation`, `layers.rotary`): the same roundings, so the same values but where the
exponential's last bits move a bf16 rounding; the fused projections (`layers.linear.FusedLinear`)
against the separate ones; and a model on the GPU plan's kernels and fused projections against
the same model on PyTorch's.

Without a GPU the kernels' own source runs under Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py); with one (``TRITON_INTERPRET=0``, as benchmarks/gpu_check.py runs
the tests) compiled, on CUDA tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu.rowwise import Rowwise, act_and_mul, apply_rope_qk  # noqa: E402
from nextoken.layers.rotary import apply_rope as torch_rope, inv_frequencies, rope_cos_sin  # noqa: E402
from tests.helpers.triton_device import DEV, randn  # noqa: E402

STEP = {torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -22}  # about one unit in the last place, relative


def off_by_at_most_a_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Each value within a few units in the last place of the reference's (float32: e^x and the
    formula's order move the last bits; bf16: one rounding), or within 1e-6 of the largest
    (GELU's far tail: PyTorch's tanh form gives 0 where the logistic form gives 1e-11)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    gap, ref = (got.double() - want.double()).abs(), want.double().abs()
    assert (gap <= ref * 4 * STEP[want.dtype] + 1e-6 * ref.max()).all(), gap.max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gelu", [False, True])
def test_act_and_mul_is_pytorchs_expression(dtype, gelu):
    """3 x 700 values (not a multiple of the block), scaled to reach SiLU's and GELU's tails: within
    a few units in the last place of the activation and product taken in float64 and rounded as
    the kernel rounds (in bf16, equal to it for almost every value), and within one bf16 rounding
    of ``F.silu(g) * u`` / ``F.gelu(g, approximate="tanh") * u``. (PyTorch writes GELU as ``0.5 g
    (1 + tanh a)``, which cancels for negative g: near g = -3 it loses about 1e-5 of its float32
    value, so its bf16 roundings differ there; the kernel's logistic form does not cancel.)"""
    g, u = randn(3, 700, dtype=dtype, seed=1, scale=4), randn(3, 700, dtype=dtype, seed=2)
    got = act_and_mul(g, u, gelu=gelu)
    x = g.double()
    exact = x / (1 + torch.exp(-2 * 0.7978845608028654 * (x + 0.044715 * x ** 3))) if gelu else x * torch.sigmoid(x)
    want = (exact.to(dtype).double() * u.double()).to(dtype)
    off_by_at_most_a_rounding(got, want)
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.99
        off_by_at_most_a_rounding(got, (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u)
    gu = torch.cat([g, u], dim=1)  # the halves of a fused gate/up product: rows strided
    assert torch.equal(act_and_mul(gu[:, :700], gu[:, 700:], gelu=gelu), got)
    assert act_and_mul(g[:, ::2], u[:, ::2]) is None  # (columns strided: the caller's PyTorch runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,rope_dim", [(64, 64), (80, 32)])
def test_rope_of_queries_and_keys_is_the_rotary_reference(dtype, head_dim, rope_dim):
    """3 query heads and 1 key head of 5 tokens at scattered positions, taken as views of one fused
    q/k/v product (strided rows), full and partial rotation (the dims after `rope_dim` copied):
    `layers.rotary.apply_rope`'s values for each within one rounding (its roundings are the
    kernel's, so bf16 agrees but where a product's float32 rounding differs)."""
    qkv = randn(5, (3 + 1 + 1) * head_dim, dtype=dtype, seed=3, scale=2)
    q, k = qkv[:, : 3 * head_dim].view(5, 3, head_dim), qkv[:, 3 * head_dim : 4 * head_dim].view(5, 1, head_dim)
    cos, sin = rope_cos_sin(torch.tensor([0, 7, 100, 2048, 31999], device=DEV), inv_frequencies(rope_dim, 1e4).to(DEV))
    for got, x in zip(apply_rope_qk(q, k, cos, sin), (q, k)):
        off_by_at_most_a_rounding(got, torch_rope(x, cos, sin))
        assert torch.equal(got[..., rope_dim:], x[..., rope_dim:])


def test_layers_take_the_kernels_and_fall_back_counted():
    """`layers.rotary.apply_rope_qk` and `layers.activation.silu_and_mul` given the kernels use
    them; an input they refuse runs PyTorch and is counted as a fallback."""
    from nextoken.kernels import FallbackCounts, counting
    from nextoken.layers.activation import silu_and_mul
    from nextoken.layers.rotary import apply_rope_qk as layer_rope

    g, u = randn(4, 64, dtype=torch.bfloat16, seed=4), randn(4, 64, dtype=torch.bfloat16, seed=5)
    counts = FallbackCounts()
    with counting(counts):
        off_by_at_most_a_rounding(silu_and_mul(g, u, kernel=Rowwise), F.silu(g) * u)
        assert torch.equal(silu_and_mul(g.T, u.T, kernel=Rowwise), F.silu(g.T) * u.T)
        q, k = g.view(4, 2, 32), u[:, :32].reshape(4, 1, 32)
        cos, sin = rope_cos_sin(torch.arange(4, device=DEV), inv_frequencies(32, 1e4).to(DEV))
        got = layer_rope(q, k, cos, sin, kernel=Rowwise)
        assert all(torch.equal(a, b) for a, b in zip(got, apply_rope_qk(q, k, cos, sin)))
        assert all(torch.equal(a, torch_rope(x, cos, sin))  # (float64 angles: not taken)
                   for a, x in zip(layer_rope(q, k, cos.double(), sin.double(), kernel=Rowwise), (q, k)))
    assert counts.snapshot() == {"silu_and_mul": 1, "apply_rope": 1}


def test_fused_linears_equal_the_separate_ones_and_share_their_memory():
    """q/k/v-like linears with biases as one matmul: the separate outputs (float32), each linear's
    weight now rows of the fused one (no memory added; each still runs alone), unused while a
    pass's adapters sit on one of them; refused for a linear that is not plainly dense."""
    from types import SimpleNamespace

    from nextoken.layers.linear import FusedLinear, Linear
    from nextoken.layers.quantization.methods import InvariantMethod

    parts = [Linear(16, n, True, torch.float32) for n in (12, 4, 4)]
    for i, lin in enumerate(parts):
        lin.weight.data = randn(lin.out_features, 16, dtype=torch.float32, seed=10 + i)
        lin.bias.data = randn(lin.out_features, dtype=torch.float32, seed=20 + i)
    x = randn(5, 16, dtype=torch.float32, seed=9)
    want = [lin(x) for lin in parts]
    fused = FusedLinear.of(parts)
    got = fused(x)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    assert parts[1].weight.data_ptr() == fused.weight[12:].data_ptr() and torch.equal(parts[2](x), want[2])
    assert fused.usable()
    parts[0].lora = SimpleNamespace(batch=SimpleNamespace(ids=[1]))
    assert not fused.usable()
    odd = [Linear(16, 4, False, torch.float32), Linear(16, 4, False, torch.float32)]
    odd[1].method = InvariantMethod()
    assert FusedLinear.of(odd) is None


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_model_on_the_gpu_plans_rowwise_kernels_equals_pytorchs(tiny_gguf, arch, monkeypatch):
    """A whole model on the GPU path with the plan's row-wise kernels and fused projections (Qwen
    2: RMSNorm, SwiGLU, RoPE, q/k/v with biases; Gemma 3: its norms with the float32 product,
    QK-norm, GeGLU, two RoPE tables) against the same path on PyTorch's: float32 logits of a
    prompt and two decodes within 1e-5."""
    import dataclasses

    from nextoken.loader.source import open_model
    from nextoken.runner import plan as plan_module
    from nextoken.runner.device import resolve_device
    from nextoken.runner.model_runner import ModelRunner
    from tests.tiny_models import OneSequence

    path = str(tiny_gguf[arch][0])
    kw = dict(enforce_eager=True, attention_backend="triton", device=resolve_device(DEV))  # (eager: PyTorch's)
    plain = ModelRunner(open_model(path), torch.float32, **kw)
    choose = plan_module.ExecutionPlan.choose.__func__
    monkeypatch.setattr(plan_module.ExecutionPlan, "choose", classmethod(
        lambda cls, *a, **k: dataclasses.replace(choose(cls, *a, **k), rowwise=True, fused=True)))
    fused = ModelRunner(open_model(path), torch.float32, **kw)
    line = fused.plan.describe(fused.model)
    assert "Triton (with RoPE)" in line and "fused matmuls" in line and not plain.plan.rowwise, line
    a, b = OneSequence(plain, 32, block_size=4), OneSequence(fused, 32, block_size=4)
    for ids in ([5, 17, 200, 33, 41, 270, 90, 12, 7], [44], [61]):
        want, got = a.forward(ids, all_logits=True), b.forward(ids, all_logits=True)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
