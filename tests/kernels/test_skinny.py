"""The GPU path's split-K GEMM of 5-64 rows (`kernels.gpu.skinny`) against float64 and
``torch.nn.functional.linear``, the dense matmul's switch to it
(`layers.quantization.methods.dense_matmul`), and the plan's choice per weight shape
(`kernels.gpu.skinny.choose`).

Without a GPU the kernel's own source runs under Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py); with one (``TRITON_INTERPRET=0``, as benchmarks/gpu_check.py runs the
tests) compiled, on CUDA tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu.skinny import BUCKETS, DEFAULT, LAUNCHES, bucket, choose, skinny, takes  # noqa: E402
from tests.helpers.triton_device import DEV, randn  # noqa: E402


@pytest.mark.parametrize("m", [5, 8, 24, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_is_the_linear_in_float32_sums(m, bias):
    """m bf16 rows times a weight of 150 x 1100 (neither a multiple of the N tile nor of the K
    step), with and without a bias, the K range whole and split over 3 programs (their partial
    sums added by the second launch): within one bf16 rounding of the float64 product, as
    PyTorch's own bf16 linear on the CPU, and mostly that product rounded. (On the H200, 2026-11-30,
    PyTorch's bf16 linear fell outside one rounding with a bias at every row count and without
    one at 24 and 64 rows: cuBLAS may reduce split-K partial sums in bf16, PyTorch's
    ``allow_bf16_reduced_precision_reduction``, and benchmarks/gpu_check.py measures by how much.)"""
    x = randn(m, 1100, dtype=torch.bfloat16, seed=1)
    w = randn(150, 1100, dtype=torch.bfloat16, seed=2, scale=0.1)
    b = randn(150, dtype=torch.bfloat16, seed=3) if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    step = exact.abs() * 2.0**-7 + 1e-6 * exact.abs().max()  # one bf16 rounding of the float32 sum
    for split in (1, 3):
        got = skinny(x, w, b, split=split)
        assert got.shape == (m, 150) and got.dtype == torch.bfloat16 and got.is_contiguous()
        for y in (got, F.linear(x, w, b)) if DEV == "cpu" else (got,):
            assert ((y.double() - exact).abs() <= step).all()
        assert (got == exact.to(torch.bfloat16)).float().mean() > 0.9


@pytest.mark.parametrize("launch", [x for x in LAUNCHES[1:] if x.per_sm == DEFAULT.per_sm], ids=str)
def test_every_launch_is_the_same_linear(launch):
    """Each launch `choose` may time (N tiles of 32-128 against N = 150, K steps of 64-256 against
    K = 1100) computes the same linear: 24 bf16 rows with a bias, the K range whole and split over
    3 programs, within one bf16 rounding of the float64 product. (A launch that differs from the
    default in its splits alone runs the default's kernel, split as these are.)"""
    x = randn(24, 1100, dtype=torch.bfloat16, seed=31)
    w = randn(150, 1100, dtype=torch.bfloat16, seed=32, scale=0.1)
    b = randn(150, dtype=torch.bfloat16, seed=33)
    exact = x.double() @ w.double().T + b.double()
    step = exact.abs() * 2.0**-7 + 1e-6 * exact.abs().max()
    for split in (1, 3):
        got = skinny(x, w, b, split=split, launch=launch)
        assert got.shape == (24, 150) and ((got.double() - exact).abs() <= step).all()


def test_skinny_refuses_what_it_does_not_take():
    """4 rows (the GEMV's), 65, float32 (the reference's dtype), strided rows: `takes` says no and
    `skinny` raises a ValueError naming the call."""
    x, w = randn(65, 64, dtype=torch.bfloat16, seed=4), randn(8, 64, dtype=torch.bfloat16, seed=5)
    assert takes(x[:5], w, None) and takes(x[:64], w, None)
    assert not takes(x[:4], w, None) and not takes(x, w, None)
    assert not takes(x[:8].float(), w.float(), None) and not takes(x[:8, ::2], w[:, ::2], None)
    with pytest.raises(ValueError, match="it takes 5-64 bf16 rows"):
        skinny(x, w)


def test_dense_matmul_switches_by_timed_row_counts():
    """`dense_matmul` runs the GEMM for a call of 5-64 rows whose count rounds up to one of its
    `skinny_rows` (10 rows -> 16), and PyTorch's otherwise (6 rows -> 8, not timed faster); a call
    it does not take (float32) runs PyTorch's, counted."""
    from nextoken.kernels import FallbackCounts, counting
    from nextoken.layers.quantization.methods import dense_matmul

    x, w = randn(10, 96, dtype=torch.bfloat16, seed=6), randn(40, 96, dtype=torch.bfloat16, seed=7)
    assert [bucket(m) for m in (5, 8, 9, 16, 17, 33, 64)] == [8, 8, 16, 16, 32, 64, 64]
    assert torch.equal(dense_matmul(x, w, None, 4, (16,)), skinny(x, w))
    assert torch.equal(dense_matmul(x[:6], w, None, 4, (16,)), F.linear(x[:6], w))
    counts = FallbackCounts()
    with counting(counts):
        assert torch.equal(dense_matmul(x.float(), w.float(), None, 0, BUCKETS), F.linear(x.float(), w.float()))
    assert counts.snapshot() == {"skinny": 1}


def test_choose_times_every_launch_and_keeps_the_row_counts_it_wins(monkeypatch):
    """With a timer under which one launch is the fastest at 64 rows and another raises, and the
    GEMM launched the fastest way is faster than PyTorch's at 16, 32 and 64 rows on one shape and
    at none on another, the choice is ((16, 32, 64), that launch) and ((), that launch); each
    timing runs over all the group's weights, the other row counts with the chosen launch alone;
    the report holds every launch that ran and PyTorch's time at 64 rows."""
    import nextoken.kernels.gpu.skinny as S

    fast, broken = LAUNCHES[2], LAUNCHES[4]
    calls = []

    def ours(x, weight, bias, launch=None):
        if launch is broken:
            raise RuntimeError("out of resources")
        calls.append((launch, x.shape[0], weight.shape[0]))

    monkeypatch.setattr(S, "skinny", ours)
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, weight, bias: calls.append(("torch", x.shape[0], weight.shape[0])))

    def timer(fn):
        before = len(calls)
        fn()
        ran = calls[before:]
        assert len(ran) == 2 and len(set(ran)) == 1  # every weight of the group, one kind, one row count
        kind, rows, n = ran[0]
        if kind == "torch":
            return 2.0
        wins = n == 16 and rows >= 16
        return (1.0 if wins else 3.0) * (1.0 if kind is fast else 1.2)

    groups = {"a": [(randn(16, 32, dtype=torch.bfloat16, seed=8 + i), None) for i in range(2)],
              "b": [(randn(8, 32, dtype=torch.bfloat16, seed=20 + i), None) for i in range(2)]}
    report = {}
    assert choose(groups, timer=timer, report=report) == {"a": ((16, 32, 64), fast), "b": ((), fast)}
    assert report["a"]["torch"] == 2.0 and report["a"][str(fast)] == 1.0 and str(broken) not in report["a"]
    assert len(report["b"]) == len(LAUNCHES)  # (the launches that ran, and PyTorch's)
    assert {launch for launch, m, n in calls if m < 64} == {fast, "torch"}


def test_the_plan_gives_each_shape_its_timed_row_counts_or_none_when_timing_fails(tiny_gguf, monkeypatch):
    """On a GPU a bf16 plan times every weight shape (here a stand-in: its timing needs CUDA) and
    gives each matmul its group's row counts; should the timing raise, every matmul stays on
    PyTorch's and the plan line says why. A float32 plan takes none (the kernel is bf16's)."""
    import dataclasses

    import nextoken.kernels.gpu.skinny as S
    from nextoken.layers.linear import gemv_targets
    from nextoken.loader.source import open_model
    from nextoken.runner.device import Device, resolve_device
    from nextoken.runner.model_runner import ModelRunner

    runner = ModelRunner(open_model(str(tiny_gguf["qwen2"][0])), torch.bfloat16, enforce_eager=True,
                         attention_backend="triton", device=resolve_device(DEV))  # (compiled: on the GPU)
    model = runner.model
    gpu = dataclasses.replace(runner.plan, device=Device(torch.device("cuda"), "a GPU", "asked for"), skinny=True)
    monkeypatch.setattr(S, "choose", lambda groups, report=None: {
        key: ((32, 64), LAUNCHES[1]) if key[1] else ((), DEFAULT) for key in groups})
    targets = gemv_targets(model)
    keys = {(tuple(t.weight.shape), t.bias is not None) for t in targets}
    gpu.skinny_shapes = gpu._choose_skinny(model)
    assert gpu.skinny_shapes == (sum(1 for _, b in keys if b), len(keys))  # (Qwen 2: q, k, v have a bias)
    assert {(t.skinny_rows, t.skinny_launch) for t in targets if t.bias is not None} == {((32, 64), LAUNCHES[1])}
    assert {(t.skinny_rows, t.skinny_launch) for t in targets if t.bias is None} == {((), DEFAULT)}
    taken = sum(1 for _, b in keys if b)
    assert f"split-K GEMM for 5-64 rows on {taken} of {len(keys)} weight shapes, as timed on this GPU" in gpu.describe(model)

    def broken(groups, report=None):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(S, "choose", broken)
    gpu._choose_skinny(model)
    assert all(t.skinny_rows == () and t.skinny_launch is None for t in targets) and "split-K GEMM off: RuntimeError" in gpu.describe(model)
