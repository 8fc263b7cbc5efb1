"""The GPU path's matmul for a decode step of 5-64 rows: ``y = x W^T + b`` as tiles of all the
rows by `BLOCK_N` output features, the K range split over several programs when the tiles alone
are too few for the GPU (split-K), their partial sums added by a second launch.

Why: on the H200 (`benchmarks/gpu_check.py`'s profile, 2026-11-30) the 64-sequence decode step of
a Qwen2.5-1.5B-shaped model ran its matmuls on cuBLAS at about 42% of the card's bandwidth: at
64 rows a matmul is still a weight read (64 x 1536 x 8960 products against 27 MB of weights), and
an output of N = 1536 features makes only 24 tiles of 64 for 132 multiprocessors unless K is
split. Here the rows are padded to 16, 32 or 64 (`BLOCK_M`, one tensor-core tile: every row in
one program), N in tiles of 64, and K split so that there are about two programs per
multiprocessor, each still running at least four K steps (`splits`). Every weight value is read
once.

Which is faster per weight shape is measured, not assumed: `choose_rows` times this kernel
against PyTorch's matmul on the model's own weights at load, at 8, 16, 32 and 64 rows, and the
plan keeps it for the row counts (rounded up to those) where it wins
(`layers.quantization.methods.dense_matmul`); `benchmarks/gpu_check.py` measures the step with
and without it.

Arithmetic (bf16 only): float32 sums of the tensor cores' products, the splits' partial sums
added in split order, the bias added, rounded once to the output's dtype, as cuBLAS's bf16 GEMM
with float32 accumulation; the order of the sums differs, so an output can differ from
PyTorch's by one rounding. Under Triton's interpreter
(``TRITON_INTERPRET=1``, the CPU tests) the products are widened to float32 and the rounding to
bf16 written out (`batch_invariant._round_bf16`). The reference is
``torch.nn.functional.linear`` (tests/kernels/test_skinny.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nextoken.kernels.gpu.batch_invariant import _round_bf16, dot_rows
from nextoken.kernels.gpu.gemv import MAX_ROWS as GEMV_ROWS
from nextoken.kernels.gpu.gemv import fits, refuse
from nextoken.kernels.gpu.timing import graph_seconds

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MIN_ROWS, MAX_ROWS = GEMV_ROWS + 1, 64  # the rows a call takes (fewer: the GEMV's)
BUCKETS = (8, 16, 32, 64)  # the row counts timed at load; a call's rows round up to one
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 4, 4
REDUCE_BLOCK = 1024  # outputs per program of the split-K sum
MIN_K_STEPS = 4  # the fewest BLOCK_K steps a split runs
_SMS: dict = {}


def bucket(m: int) -> int:
    """The timed row count a call of `m` rows (`MIN_ROWS` to `MAX_ROWS`) falls under."""
    return next(b for b in BUCKETS if b >= m)


def splits(n: int, k: int, device: torch.device) -> int:
    """How many programs share each output tile's K range: enough for about two programs per
    multiprocessor, each at least `MIN_K_STEPS` K steps (1 under the interpreter: fewer, larger
    numpy passes; the tests ask for more themselves)."""
    if INTERPRET or device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = triton.cdiv(n, BLOCK_N)
    return max(1, min(triton.cdiv(2 * _SMS[device], tiles), k // (BLOCK_K * MIN_K_STEPS)))


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om, k_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, ROUND: tl.constexpr):
    """Every row times `BLOCK_N` weight rows over one K range (``k_split`` values from the
    program's split): with `SPLIT`, the float32 sums to ``part[split, m, n]``, else the output
    (bias added, rounded). Grid: (N tiles, splits)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    acc = dot_rows(x_ptr, w_ptr, rm, rn, M, N, k_lo, k_hi, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, WIDEN)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        part = part_ptr + (tl.program_id(1) * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(part, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        acc = _round_bf16(acc, ROUND)
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, S, stride_om, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ROUND: tl.constexpr):
    """``out[m, n] = sum over splits s in order of part[s, m, n] (+ b[n])``, rounded once.
    Grid: (M * N / `BLOCK`,)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, S):
        acc += tl.load(part_ptr + s * M * N + i, mask=ok, other=0.0)
    m = i // N
    n = i % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    acc = _round_bf16(acc, ROUND)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `skinny` computes this call (`gemv.fits`): `MIN_ROWS` to `MAX_ROWS` rows, bf16 (not
    float32, the reference's dtype: without tensor cores its 64-row tile spills)."""
    return fits(x, weight, bias, (MIN_ROWS, MAX_ROWS), (torch.bfloat16,))


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           split: int | None = None) -> torch.Tensor:
    """``x W^T + b`` for a call `takes` accepts: x ``[M, K]``, weight ``[N, K]``, bias ``[N]`` or
    None -> ``[M, N]`` in x's dtype (contiguous). `split`: programs per output tile's K range
    (default `splits`'). Raises ValueError for another call."""
    if not takes(x, weight, bias):
        raise refuse("skinny", x, weight, bias, f"{MIN_ROWS}-{MAX_ROWS} bf16 rows")
    m, k = x.shape
    n = weight.shape[0]
    split = split or splits(n, k, x.device)
    k_split = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K  # (whole K steps per split)
    split = triton.cdiv(k, k_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    widen = rnd = INTERPRET
    _skinny_kernel[(triton.cdiv(n, BLOCK_N), split)](
        x, weight, bias if bias is not None else weight, out, part, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), k_split, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        SPLIT=split > 1, HAS_BIAS=bias is not None, WIDEN=widen, ROUND=rnd, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    if split > 1:
        _reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            part, bias if bias is not None else weight, out, m, n, split, out.stride(0), BLOCK=REDUCE_BLOCK,
            HAS_BIAS=bias is not None, ROUND=rnd)
    return out


def choose_rows(groups: dict, timer=None) -> dict:
    """For each group of weights of one shape (``{key: [(weight, bias), ...]}``), the timed row
    counts (`BUCKETS`) at which `skinny` beats ``torch.nn.functional.linear``: both timed over the
    group's weights in turn (as a decode step reads them, from memory rather than L2). `timer(fn)
    -> seconds` (default: `timing.graph_seconds`, a CUDA graph's replay). Returns ``{key: (rows,
    ...)}``."""
    timer = timer or graph_seconds
    out = {}
    for key, pairs in groups.items():
        w0 = pairs[0][0]
        won = []
        for m in BUCKETS:
            x = torch.randn(m, w0.shape[1], device=w0.device).to(w0.dtype)
            if timer(lambda: [skinny(x, w, b) for w, b in pairs]) < timer(
                    lambda: [torch.nn.functional.linear(x, w, b) for w, b in pairs]):
                won.append(m)
        out[key] = tuple(won)
    return out
