"""Batch-invariant matmul and RMSNorm in Triton: a row's result does not depend on the other
rows of the call (``--batch-invariant``, `runner.plan.ExecutionPlan.batch_invariant`).

Why: cuBLAS picks its algorithm (tile shapes, split-K) from the problem's shape, and PyTorch's
reductions pick how many threads share a row from the number of rows, so one token's logits
change in their last bits with the size of the batch it runs in, and now and then a greedy token
flips (He et al. 2025, "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab; vLLM's
``VLLM_BATCH_INVARIANT``). These kernels fix every choice that touches the order of a row's sums:

- `linear`: ``y = x W^T + b`` with one tile shape for every number of rows (`BLOCK_M` x `BLOCK_N`
  outputs per program, K walked `BLOCK_K` at a time from 0, float32 sums, no split-K), so output
  ``[i, j]`` is the same function of row i and column j for any M;
- `rms_norm`: a fixed number of rows per program for a given width (`norm_rows`), each row's
  squares summed by one `tl.sum` over the same tile whatever the number of rows.

The attention kernel (`kernels.gpu.attention`) is batch-invariant once a decode's key splits do
not depend on the batch (the plan runs one split) and a sliding-window prefill chunk switches from
the ring's keys to the pass's at a key tile's boundary (its ``aligned``): a query's key tiles then
start at multiples of the tile wherever its chunk starts. Elementwise work (RoPE, activations,
residual adds) and PyTorch's row-wise softmax are invariant already.

Cost: no split-K and one tile shape mean fewer programs for a decode's few rows than cuBLAS
launches (`benchmarks/gpu_check.py` measures it). Arithmetic: bf16 (or float32, in IEEE float32,
never TF32) operands, float32 sums; under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU
tests) tiles are widened to float32 and summed in a fixed order (`kernels.gpu.dot`), and
the roundings to bf16 are written out (`_round_bf16`): the interpreter's conversion truncates,
a GPU's rounds to nearest even.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nextoken.kernels.gpu.dot import dot_f32
from nextoken.kernels.gpu.ints import cdiv, next_power_of_2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The launch option of the kernels that repeat PyTorch's roundings step by step (`rms_norm` here,
# `kernels.gpu.rowwise`): no fused multiply-add. Compiled with Triton's default contraction, the
# H200 run of 2026-11-30 showed RoPE's bf16 ``round(round(x1 c) - round(x2 s))`` as
# ``fma.rn.bf16(x1, c, -round(x2 s))`` and Gemma's float32 ``h + norm(a)`` as one fma: one
# rounding fewer than PyTorch's separate kernels, so not their values (and not transformers'); the
# interpreter never fuses. tests/helpers/triton_report.py compiles these kernels so too.
NO_FMA = {"enable_fp_fusion": False}
# one tile shape for every call (the invariance); 8 warps: with 4 the float32 (and just so the bf16)
# tile spills on Hopper (tests/kernels/test_triton_compile.py)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 8, 3


@triton.jit
def _round_bf16(x, ROUND: tl.constexpr):
    """float32 `x` rounded to bf16 precision, to nearest with ties to even (as a GPU converts),
    still in float32; with `ROUND` false (compiled Triton: its conversion rounds so) `x` itself."""
    if ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def dot_rows(x_ptr, w_ptr, rm, rn, M, N, k_lo, k_hi, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr):
    """The float32 ``[BLOCK_M, BLOCK_N]`` sums of rows `rm` of x (``< M``) times rows `rn` of W
    (``< N``) over ``k_lo <= k < k_hi``, `BLOCK_K` at a time in order: tensor-core products of
    bf16 operands, IEEE float32 (never TF32) of float32 ones; `WIDEN` (the interpreter): the
    operands converted to float32 first, exact products as the tensor cores' (bf16 x bf16 fits),
    summed in an order fixed by the tile's shape (`kernels.gpu.dot.dot_f32`)."""
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < k_hi), other=0.0)
        if WIDEN:
            acc += dot_f32(x, tl.trans(w), WIDEN)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   WIDEN: tl.constexpr, ROUND: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``x W^T (+ b)``. Grid: (M tiles, N tiles)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = dot_rows(x_ptr, w_ptr, rm, rn, M, N, 0, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, WIDEN)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    acc = _round_bf16(acc, ROUND)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b``, each output row a function of its input row alone.

    x ``[..., K]`` and weight ``[N, K]`` in one dtype (bf16 or float32), bias ``[N]`` or None.
    Returns ``[..., N]`` in x's dtype (the float32 sum, bias added, rounded once). Raises
    ValueError when the shapes or dtypes do not fit."""
    if x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype}" + (f" and bias {tuple(bias.shape)}" if bias is not None else ""))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))
        _linear_kernel[grid](x2, w, bias if bias is not None else w, out, m, n, k, x2.stride(0), w.stride(0),
                             out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                             HAS_BIAS=bias is not None, WIDEN=INTERPRET,
                             ROUND=INTERPRET and x.dtype == torch.bfloat16,
                             num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out.view(*lead, n)


@triton.jit
def _normed_rows(x, w_ptr, n, eps, BLOCK: tl.constexpr, GEMMA: tl.constexpr, ROUND: tl.constexpr):
    """RMSNorm of float32 rows x ``[rows, BLOCK]`` (columns from `n` on zero): ``x / sqrt(mean(x^2)
    + eps)`` in float32, then (Llama) rounded to the weight's dtype and times the weight, or
    (`GEMMA`) times the weight in float32; float32, to be rounded to the output's dtype once."""
    i = tl.arange(0, BLOCK)
    h = x * (1.0 / tl.sqrt(tl.sum(x * x, 1) / n + eps))[:, None]
    w = tl.load(w_ptr + i, mask=i < n, other=0.0)[None, :]
    if GEMMA:
        y = h * w.to(tl.float32)
    else:  # rounded to x's dtype, then times the weight: a product of two bf16 values is exact in float32,
        y = _round_bf16(h, ROUND).to(w.dtype).to(tl.float32) * w.to(tl.float32)  # so this rounds once, as a
    return _round_bf16(y, ROUND)  # bf16 multiply would


@triton.jit(do_not_specialize=["rows"])  # (as `rowwise._add_norm_kernel`'s)
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows, n, stride_x, stride_o, eps, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, GEMMA: tl.constexpr, ROUND: tl.constexpr):
    """`ROWS` rows of `_normed_rows`, stored in the output's dtype. Grid: (row tiles,)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, BLOCK)
    ok = (r[:, None] < rows) & (i[None, :] < n)
    x = tl.load(x_ptr + r[:, None] * stride_x + i[None, :], mask=ok, other=0.0).to(tl.float32)
    y = _normed_rows(x, w_ptr, n, eps, BLOCK, GEMMA, ROUND)
    tl.store(out_ptr + r[:, None] * stride_o + i[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def norm_rows(n: int) -> int:
    """Rows per program of `rms_norm` for rows of `n`: a tile of about 4096 values (registers), at
    most 64 rows; fixed by the width alone, so a row's sum never depends on the call's size."""
    return max(1, min(64, 4096 // next_power_of_2(n)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm of each row of x ``[..., n]`` with weight ``[n]``, `norm_rows` rows per program;
    x's dtype.
    The operation order of `layers.norm.rms_norm` (or, `gemma`, `rms_norm_gemma`); the mean is
    one float32 tree sum, so it may differ from PyTorch's in its last bit. Raises ValueError for a
    weight of another width."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not fit rows of {n}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        per = norm_rows(n)
        _rms_norm_kernel[(cdiv(rows, per),)](x2, weight, out, rows, n, x2.stride(0), out.stride(0), eps,
                                             ROWS=per, BLOCK=next_power_of_2(n), GEMMA=gemma,
                                             ROUND=INTERPRET and x.dtype == torch.bfloat16, num_warps=4, **NO_FMA)
    return out.view(x.shape)


class InvariantNorms:
    """What the plan hands the layers as their norm kernel in batch-invariant mode (in place of
    the C ``activation`` library): `layers.norm.rms_norm` calls `rms_norm` on it."""

    rms_norm = staticmethod(rms_norm)
