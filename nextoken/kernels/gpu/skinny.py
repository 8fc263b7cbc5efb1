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

Which is faster per weight shape is measured, not assumed: `choose` times the kernel's launches
(`LAUNCHES`: the N tile, the K step, warps, pipeline stages and programs per multiprocessor; none
of them spills on sm_90, tests/kernels/test_triton_compile.py) at 64 rows on the model's own
weights at load, keeps the fastest, times it against PyTorch's matmul at 8, 16, 32 and 64 rows,
and the plan keeps it for the row counts (rounded up to those) where it wins
(`layers.quantization.methods.dense_matmul`); `benchmarks/gpu_check.py` logs the times and
measures the step with and without it.

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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nextoken.kernels.gpu.batch_invariant import _round_bf16, dot_rows
from nextoken.kernels.gpu.gemv import MAX_ROWS as GEMV_ROWS
from nextoken.kernels.gpu.gemv import fits, refuse
from nextoken.kernels.gpu.ints import cdiv, next_power_of_2
from nextoken.kernels.gpu.timing import fastest, per_shape

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MIN_ROWS, MAX_ROWS = GEMV_ROWS + 1, 64  # the rows a call takes (fewer: the GEMV's)
BUCKETS = (8, 16, 32, 64)  # the row counts timed at load; a call's rows round up to one
REDUCE_BLOCK = 1024  # outputs per program of the split-K sum
MIN_K_STEPS = 4  # the fewest K steps a split runs
_SMS: dict = {}


@dataclass(frozen=True)
class Launch:
    """How `skinny` launches: output features per tile (`block_n`), K values per step
    (`block_k`), warps per program, software-pipeline stages, and `per_sm`: K is split for about
    this many programs per multiprocessor."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    per_sm: int = 2

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_k}/{self.num_warps}w/{self.num_stages}s/{self.per_sm}pm"


DEFAULT = Launch()
# the launches `choose` times: narrower or wider tiles, longer K steps, deeper pipelines, more
# splits (none spills at 16-64 rows under Triton 3.6 or 3.9; 32 x 256 and 128 x 128 over 8 warps did)
LAUNCHES = (DEFAULT, Launch(32, 128), Launch(64, 256, 8, 3), Launch(128, 64), Launch(64, 64, 4, 6),
            Launch(64, 256, 4, 3), Launch(per_sm=4))


def bucket(m: int) -> int:
    """The timed row count a call of `m` rows (`MIN_ROWS` to `MAX_ROWS`) falls under."""
    return next(b for b in BUCKETS if b >= m)


def splits(n: int, k: int, device: torch.device, launch: Launch = DEFAULT) -> int:
    """How many programs share each output tile's K range: enough for about `launch.per_sm`
    programs per multiprocessor, each at least `MIN_K_STEPS` K steps (1 under the interpreter:
    fewer, larger numpy passes; the tests ask for more themselves)."""
    if INTERPRET or device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = cdiv(n, launch.block_n)
    return max(1, min(cdiv(launch.per_sm * _SMS[device], tiles), k // (launch.block_k * MIN_K_STEPS)))


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
           split: int | None = None, launch: Launch | None = None) -> torch.Tensor:
    """``x W^T + b`` for a call `takes` accepts: x ``[M, K]``, weight ``[N, K]``, bias ``[N]`` or
    None -> ``[M, N]`` in x's dtype (contiguous). `launch`: how (default `DEFAULT`); `split`:
    programs per output tile's K range (default `splits`' for the launch). Raises
    `gemv.Refused` (a ValueError) for another call."""
    if not takes(x, weight, bias):
        raise refuse("skinny", x, weight, bias, f"{MIN_ROWS}-{MAX_ROWS} bf16 rows")
    launch = launch or DEFAULT
    m, k = x.shape
    n = weight.shape[0]
    split = split or splits(n, k, x.device, launch)
    k_split = cdiv(cdiv(k, split), launch.block_k) * launch.block_k  # (whole K steps per split)
    split = cdiv(k, k_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    widen = rnd = INTERPRET
    _skinny_kernel[(cdiv(n, launch.block_n), split)](
        x, weight, bias if bias is not None else weight, out, part, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), k_split, BLOCK_M=max(16, next_power_of_2(m)), BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, SPLIT=split > 1, HAS_BIAS=bias is not None, WIDEN=widen, ROUND=rnd,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    if split > 1:
        _reduce_kernel[(cdiv(m * n, REDUCE_BLOCK),)](
            part, bias if bias is not None else weight, out, m, n, split, out.stride(0), BLOCK=REDUCE_BLOCK,
            HAS_BIAS=bias is not None, ROUND=rnd)
    return out


def choose(groups: dict, timer=None, report: dict | None = None) -> dict:
    """For each group of weights of one shape (``{key: [(weight, bias), ...]}``): the launch of
    `LAUNCHES` that times fastest at 64 rows (`timing.fastest`: one that raises drops out; if
    every one raises, so does this), and the timed row counts (`BUCKETS`) at which `skinny` with
    it beats ``torch.nn.functional.linear``. Each timing runs over the group's weights in turn (as
    a decode step reads them, from memory rather than L2). `timer(fn) -> seconds` (default:
    `timing.graph_seconds`, a CUDA graph's replay, each choice made once per process for its
    shapes: `timing.per_shape`). `report`: gets ``{key: {str(launch) or "torch": seconds at 64
    rows}}``. Returns ``{key: ((rows, ...), launch)}``."""
    return per_shape("skinny", groups, _choose, timer, report)


def _choose(pairs: list, timer) -> tuple[tuple[int, ...], Launch, dict]:
    """`choose`'s row counts and launch for one group, and the times at 64 rows (its report)."""
    w0 = pairs[0][0]
    x = torch.randn(BUCKETS[-1], w0.shape[1], device=w0.device).to(w0.dtype)
    best, times = fastest(LAUNCHES, lambda launch: [skinny(x, w, b, launch=launch) for w, b in pairs], timer)
    won, report = [], {}
    for m in BUCKETS:
        x = torch.randn(m, w0.shape[1], device=w0.device).to(w0.dtype)
        ours = times[best] if m == BUCKETS[-1] else timer(lambda: [skinny(x, w, b, launch=best) for w, b in pairs])
        theirs = timer(lambda: [torch.nn.functional.linear(x, w, b) for w, b in pairs])
        if m == BUCKETS[-1]:
            report = {**{str(launch): t for launch, t in times.items()}, "torch": theirs}
        if ours < theirs:
            won.append(m)
    return tuple(won), best, report
