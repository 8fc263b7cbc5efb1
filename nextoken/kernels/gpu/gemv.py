"""The GPU path's matmul for a decode step's few rows (GEMV): ``y = x W^T + b`` for x of at most
`MAX_ROWS` rows, a program per `ROWS` output features streaming their weight rows whole.

Why: on the H200 (`benchmarks/gpu_check.py`'s profile, 2026-11-30) a batch-1 decode step of a
Qwen2.5-1.5B-shaped model spent 1.55 ms in cuBLAS against 0.76 ms of weight reads: its kernels
for one row read the large projections at about 2.8 TB/s of the card's 4.2 (gate and up 9.7 us
each, down 10.1 us plus a split-K reduction) and the small ones at under 1 TB/s (q, k, v and o
4.9-6.6 us, latency-bound). Here a program reads `ROWS` contiguous weight rows of K values in
`BLOCK_K` chunks (each chunk one coalesced load per row) and multiplies them by the few input
rows, which stay in L2; every output's sum is one program's, so there is no split-K. A small N
takes fewer rows and longer K chunks per program (`rows_per_program`: 768 programs of 2 rows for
N = 1536 on 132 multiprocessors), so every multiprocessor keeps several programs' loads in
flight.

A SwiGLU model's down projection takes the gate and up projections' output and computes
``silu(gate) * up`` as it loads its input (`gemv`'s ``up``; `layers.linear.silu_mul_down`): the
activation's own launch (28 a step, 33 us of the 1.45 ms batch-1 graph of Qwen2.5-1.5B on the
H200) goes, with the same values, where `choose_silu` times it faster on the GPU (every program
computes the product for the whole input it reads).

Which is faster per weight shape is measured, not assumed: `choose` times the kernel's launches
(`LAUNCHES`: the K chunk, warps and programs per multiprocessor; none of them spills on sm_90,
tests/kernels/test_triton_compile.py) on the model's own weights at load
(`runner.plan.ExecutionPlan.settle`), keeps the fastest, and keeps the kernel only for the row
counts where that launch beats PyTorch's matmul; `benchmarks/gpu_check.py` logs the times and
measures the step with and without it. The launches differ in how many weight bytes each
multiprocessor keeps in flight, which is what sets a stream's bandwidth, and no one of them is
known to be best on every card and shape. (Triton does not pipeline this loop's loads: they feed
no `tl.dot`, and the PTX is the same for any `num_stages`; a step's loads are all in flight
together, so the K chunk is what sets the bytes a program has in flight.)

Arithmetic: float32 products and sums (bf16 inputs widened; float32 in IEEE float32), the bias
added, rounded once to the output's dtype, as cuBLAS's bf16 GEMM with float32 accumulation; the
order of the sums differs from cuBLAS's, so a bf16 output can differ from PyTorch's by one
rounding. Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) the rounding to bf16
is written out (`batch_invariant._round_bf16`). The reference is ``torch.nn.functional.linear``
(tests/kernels/test_gemv.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nextoken.kernels.gpu.batch_invariant import _round_bf16
from nextoken.kernels.gpu.ints import cdiv, next_power_of_2
from nextoken.kernels.gpu.rowwise import _rounded
from nextoken.kernels.gpu.timing import fastest, per_shape

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 4  # the most input rows a call takes (decode batches of 1, 2 and 4: the smallest CUDA graphs)
ROWS = 4  # the most output features per program
INTERPRET_ROWS = 32  # under the interpreter (the CPU tests): fewer programs, each a numpy pass of its own
_SMS: dict = {}


NUM_STAGES = 1  # (see the module's docstring: the loop is not pipelined)


@dataclass(frozen=True)
class Launch:
    """How `gemv` launches: `tile` weight values a program loads per step of its K loop, whatever
    its rows (its K chunk is ``tile / rows``), warps per program, and `per_sm`: the output
    features per program halve from `ROWS` while there would be fewer than this many programs per
    multiprocessor."""

    tile: int = 2048
    num_warps: int = 4
    per_sm: int = 4

    def __str__(self) -> str:
        return f"{self.tile}/{self.num_warps}w/{self.per_sm}pm"


DEFAULT = Launch()
# the launches `choose` times: more or fewer bytes per step, warps and programs (the registers of
# each at 1-4 rows are in the compile report; 4096 values over 8 warps spilled at 1)
LAUNCHES = (DEFAULT, Launch(1024), Launch(2048, 8), Launch(4096), Launch(8192, 8), Launch(per_sm=8),
            Launch(per_sm=2))


def rows_per_program(n: int, device: torch.device, per_sm: int = DEFAULT.per_sm) -> int:
    """Output features per program for N = `n`: `ROWS`, halved (down to 1) while that leaves
    fewer than `per_sm` programs per multiprocessor, so that a small N (1536: o and down of
    Qwen2.5-1.5B) still keeps several programs' loads in flight on every one; the K chunk grows
    as the rows shrink (`Launch.tile`). Under the interpreter `INTERPRET_ROWS`."""
    if INTERPRET or device.type != "cuda":
        return INTERPRET_ROWS
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    rows = ROWS
    while rows > 1 and cdiv(n, rows) < per_sm * _SMS[device]:
        rows //= 2
    return rows


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, u_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_um,
                 M_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SILU_MUL: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr):
    """`ROWS` output features for every input row: ``out[m, n] = sum_k x[m, k] W[n, k] (+ b[n])``,
    float32 products summed per lane over the K chunks, then across the lanes; with `SILU_MUL`
    the input is ``silu(x) * u`` (x the gate, u the up projection), each value computed as
    `rowwise._act_mul_kernel` computes it, with its roundings. Grid: (N / `ROWS`,)."""
    rn = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    u_rows = u_ptr + rm.to(tl.int64)[:, None] * stride_um
    acc = tl.zeros([M_PAD, ROWS, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0).to(tl.float32)
        if SILU_MUL:
            u = tl.load(u_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0).to(tl.float32)
            x = _rounded(_rounded(x / (1.0 + tl.exp(-x)), BF16, ROUND) * u, BF16, ROUND)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, 2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y = _round_bf16(y, ROUND)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: tuple[int, int],
         dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether x is ``[M, K]`` with ``rows[0] <= M <= rows[1]`` in one of `dtypes`, weight
    ``[N, K]`` in x's dtype, both with contiguous rows, bias ``[N]`` contiguous or None: the calls
    a few-row matmul kernel of this package takes."""
    return (x.dim() == 2 and rows[0] <= x.shape[0] <= rows[1] and x.dtype in dtypes
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == x.shape[1]
            and x.stride(-1) == 1 and weight.stride(-1) == 1
            and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous())))


class Refused(ValueError):
    """A call a few-row matmul kernel of this package does not take (`refuse`): the caller may
    run PyTorch's matmul instead."""


def refuse(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, takes: str) -> Refused:
    """The error of kernel `name` for a call it does not take (`takes`: what it takes)."""
    return Refused(f"{name}: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} (bias "
                   f"{None if bias is None else tuple(bias.shape)}): it takes {takes} with contiguous rows")


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `gemv` computes this call (`fits`): 1 to `MAX_ROWS` rows, bf16 or float32."""
    return fits(x, weight, bias, (1, MAX_ROWS), (torch.bfloat16, torch.float32))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         rows: int | None = None, launch: Launch | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for a call `takes` accepts: x ``[M, K]``, weight ``[N, K]``, bias ``[N]``
    or None -> ``[M, N]`` in x's dtype (contiguous). `launch`: how (default `DEFAULT`); `rows`:
    output features per program (a power of two; default `rows_per_program`'s for the launch),
    each program's K chunk ``launch.tile / rows``. `up` (``[M, K]`` like x, contiguous rows): the
    input is ``silu(x) * up`` instead, SwiGLU's product taken as `rowwise.act_and_mul` takes it
    (the same values), so a decode's down projection reads the gate and up projections' output
    without a launch of its own between them. Raises `Refused` (a ValueError) for another call."""
    if not takes(x, weight, bias) or (up is not None and (up.shape != x.shape or up.dtype != x.dtype
                                                          or up.stride(-1) != 1)):
        raise refuse("gemv", x, weight, bias, f"1-{MAX_ROWS} rows of one dtype (bf16 or float32)"
                     + ("" if up is None else ", and an up projection like x,"))
    launch = launch or DEFAULT
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    rows = rows or rows_per_program(n, x.device, launch.per_sm)
    bf16 = x.dtype == torch.bfloat16
    _gemv_kernel[(cdiv(n, rows),)](
        x, weight, bias if bias is not None else weight, out, up if up is not None else x, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), up.stride(0) if up is not None else 0,
        M_PAD=next_power_of_2(m), ROWS=rows, BLOCK_K=max(16, launch.tile // rows), HAS_BIAS=bias is not None,
        SILU_MUL=up is not None, BF16=bf16, ROUND=INTERPRET and bf16, num_warps=launch.num_warps,
        num_stages=NUM_STAGES)
    return out


def choose(groups: dict, timer=None, report: dict | None = None) -> dict:
    """For each group of weights of one shape (``{key: [(weight, bias), ...]}``, e.g. every
    layer's down projection): the launch of `LAUNCHES` that times fastest at one row, and the most
    rows (0, 1, 2 or 4) up to which `gemv` with it beats ``torch.nn.functional.linear``. Each
    timing runs over the group's weights in turn (as a decode step reads them, from memory rather
    than L2); the rows stop at the first count where PyTorch's is as fast. A launch that raises
    (one this GPU or Triton cannot build) drops out; if every one raises, so does this
    (`timing.fastest`).
    `timer(fn) -> seconds` (default: `timing.graph_seconds`, a CUDA graph's replay, each choice
    made once per process for its shapes: `timing.per_shape`). `report`: gets ``{key:
    {str(launch) or "torch": seconds at one row}}``. Returns ``{key: (rows, launch)}``."""
    return per_shape("gemv", groups, _choose, timer, report)


def _choose(pairs: list, timer) -> tuple[int, Launch, dict]:
    """`choose`'s rows and launch for one group, and the times at one row (`choose`'s report)."""
    w0 = pairs[0][0]
    x = torch.randn(1, w0.shape[1], device=w0.device).to(w0.dtype)
    best, times = fastest(LAUNCHES, lambda launch: [gemv(x, w, b, launch=launch) for w, b in pairs], timer)
    rows, report = 0, {}
    for m in (1, 2, 4):
        x = torch.randn(m, w0.shape[1], device=w0.device).to(w0.dtype)
        ours = times[best] if m == 1 else timer(lambda: [gemv(x, w, b, launch=best) for w, b in pairs])
        theirs = timer(lambda: [torch.nn.functional.linear(x, w, b) for w, b in pairs])
        if m == 1:
            report = {**{str(launch): t for launch, t in times.items()}, "torch": theirs}
        if ours >= theirs:
            break
        rows = m
    return rows, best, report


def choose_silu(pairs: list, launch: Launch | None, max_rows: int, timer=None) -> tuple[int, dict]:
    """Up to how many rows (0 to `max_rows`, of 1, 2, 4) the down projections `pairs` (``[(weight,
    bias), ...]``, one shape, on `launch`) take SwiGLU's product inside the GEMV (`gemv`'s `up`),
    timed against the activation's own launch (`rowwise.act_and_mul`) and then the GEMV: the
    fused GEMV reads the gate and the up projection and computes ``silu(g) u`` in every program
    (each reads the whole input), which saves a launch but adds that work to the weight stream,
    so which is faster is measured (``timer``: default `timing.graph_seconds`, once per process
    for its shapes). Returns (rows, ``{"fused" | "apart": seconds at one row}``)."""
    from nextoken.kernels.gpu.timing import graph_seconds, remembered

    w0 = pairs[0][0]
    if timer is None:
        key = ("gemv silu", str(w0.device), tuple(w0.shape), w0.dtype, pairs[0][1] is not None, len(pairs), str(launch),
               max_rows)
        return remembered(key, lambda: _choose_silu(pairs, launch, max_rows, graph_seconds))
    return _choose_silu(pairs, launch, max_rows, timer)


def _choose_silu(pairs: list, launch: Launch | None, max_rows: int, timer) -> tuple[int, dict]:
    """`choose_silu`'s rows and times, timed with `timer`."""
    from nextoken.kernels.gpu.rowwise import act_and_mul

    w0 = pairs[0][0]
    rows, report = 0, {}
    for m in (1, 2, 4):
        if m > max_rows:
            break
        g, u = (torch.randn(m, w0.shape[1], device=w0.device).to(w0.dtype) for _ in range(2))
        fused = timer(lambda: [gemv(g, w, b, launch=launch, up=u) for w, b in pairs])
        apart = timer(lambda: [gemv(act_and_mul(g, u), w, b, launch=launch) for w, b in pairs])
        if m == 1:
            report = {"fused": fused, "apart": apart}
        if fused >= apart:
            break
        rows = m
    return rows, report
