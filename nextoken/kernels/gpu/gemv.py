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
computes the product for the whole input it reads). Likewise a fused q/k/v product applies RoPE
to its query and key heads and writes the keys and values into the paged cache in its epilogue
(`gemv_rope`, `layers.linear.qkv_rope`; each program takes a head's dims j and j + half, the
pair RoPE rotates together): the RoPE kernel's launch (28 a step, 49 us of that graph) goes,
where `choose_rope` times it faster. And an o or down projection takes the residual add and
RMSNorm after it (`gemv_add_norm`: the program that finishes last, by a ticket taken after each
program's stores, runs the add-norm kernel's code over the whole rows, reading the others'
outputs from L2): the add-norm's launch (56 a step, 105 us of that graph) goes, where
`choose_norm` times it faster.

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

from nextoken.kernels.gpu.batch_invariant import NO_FMA, _round_bf16, norm_rows
from nextoken.kernels.gpu.ints import cdiv, next_power_of_2
from nextoken.kernels.gpu.rowwise import ADD_NORM_WARPS, _add_norm_rows, _rounded, add_norm_takes
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
def _row_sums(x_ptr, w_ptr, u_ptr, rn, M, N, K, stride_xm, stride_wn, stride_um, M_PAD: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, BF16: tl.constexpr,
              ROUND: tl.constexpr):
    """The float32 sums ``[M_PAD, ROWS]`` of every input row times weight rows `rn`: float32
    products summed per lane over the K chunks, then across the lanes; with `SILU_MUL` the input
    is ``silu(x) * u`` (x the gate, u the up projection), each value computed as
    `rowwise._act_mul_kernel` computes it, with its roundings."""
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
    return tl.sum(acc, 2)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, u_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_um,
                 M_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SILU_MUL: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr):
    """`ROWS` output features for every input row (`_gemv_tile`). Grid: (N / `ROWS`,)."""
    _gemv_tile(x_ptr, w_ptr, b_ptr, out_ptr, u_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_um, M_PAD, ROWS,
               BLOCK_K, HAS_BIAS, SILU_MUL, BF16, ROUND)


@triton.jit
def _gemv_tile(x_ptr, w_ptr, b_ptr, out_ptr, u_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_um,
               M_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
               SILU_MUL: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr):
    """This program's `ROWS` output features for every input row: ``out[m, n] = sum_k x[m, k]
    W[n, k] (+ b[n])`` (`_row_sums`), the bias added, rounded once to the output's dtype."""
    rn = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = tl.arange(0, M_PAD)
    y = _row_sums(x_ptr, w_ptr, u_ptr, rn, M, N, K, stride_xm, stride_wn, stride_um, M_PAD, ROWS, BLOCK_K, SILU_MUL,
                  BF16, ROUND)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y = _round_bf16(y, ROUND)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gemv_add_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, u_ptr, h_ptr, wa_ptr, nw_ptr, s_ptr, y_ptr, ticket_ptr,
                          M, N, K, stride_xm, stride_wn, stride_um, stride_h, eps, M_PAD: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                          NORM_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NORM_A: tl.constexpr,
                          NORM_OUT: tl.constexpr, GEMMA: tl.constexpr, ROUND: tl.constexpr):
    """The bf16 product a = x W^T (+ b) into `out` (``[M, N]``, contiguous; `_gemv_tile`), then
    the residual add and RMSNorm after it over whole rows (`rowwise._add_norm_rows`: ``s = h + a``
    into `s_ptr`, its norm into `y_ptr`), done by the program that finishes last, as
    `attention._join_last` joins its key splits: each program's stores, a barrier, a ticket (an
    acquire-release atomic add at GPU scope); the program that takes the last one reads every
    program's a from L2 (``.cg``) in row tiles of `NORM_ROWS` (as `rowwise.add_rms_norm` tiles
    them, with its warps: the same sums in the same order) and sets the ticket back to 0. One
    launch instead of the GEMV's and the add-norm's. Grid: (N / `ROWS`,)."""
    _gemv_tile(x_ptr, w_ptr, b_ptr, out_ptr, u_ptr, M, N, K, stride_xm, stride_wn, N, stride_um, M_PAD, ROWS,
               BLOCK_K, HAS_BIAS, SILU_MUL, True, ROUND)
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        tl.debug_barrier()
        for r0 in tl.static_range(0, M_PAD, NORM_ROWS):
            r = r0 + tl.arange(0, NORM_ROWS).to(tl.int64)
            _add_norm_rows(r, h_ptr, out_ptr, wa_ptr, nw_ptr, s_ptr, y_ptr, M, N, stride_h, N, N, N, eps, BLOCK_N, NORM_A,
                           NORM_OUT, GEMMA, True, ROUND, ".cg")
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemv_rope_kernel(x_ptr, w_ptr, b_ptr, out_ptr, order_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
                      M, N, K, stride_xm, stride_wn, stride_om, stride_c, stride_ch, rope_end, k_start, v_start,
                      M_PAD: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HALF: tl.constexpr, HEAD_DIM: tl.constexpr, STORE: tl.constexpr, ROUND: tl.constexpr):
    """A fused q/k/v product with RoPE (and the paged cache's write) in its epilogue: `PAIRS` pairs
    of output features a program (one on a GPU), `order`'s (``order[2 i]``, ``order[2 i + 1]``):
    a query or key head's dims j and j + `HALF` (j < `HALF`), rotated as
    `rowwise._rope_kernel` rotates them (the GEMV's bf16 outputs; each product and the sum
    rounded, cos and sin first), or two features kept as they are (a value's, a head's dims past
    the rotated ones). Features from `k_start` on (keys, then values from `v_start`) are also
    stored at each row's slot of the cache (`STORE`: ``[kv heads, slots, HEAD_DIM]``, head stride
    `stride_ch`). bf16 only; compiled without fused multiply-adds (`batch_invariant.NO_FMA`),
    which bf16 products, exact in float32, never needed. Grid: (N / (2 `PAIRS`),)."""
    at = tl.program_id(0) * 2 * PAIRS + 2 * tl.arange(0, PAIRS)
    fa = tl.load(order_ptr + at)  # each pair's first feature, and its second
    fb = tl.load(order_ptr + at + 1)
    rm = tl.arange(0, M_PAD)
    rn = tl.reshape(tl.join(fa, fb), [2 * PAIRS])  # (a0, b0, a1, b1, ...): the pairs side by side
    y = _row_sums(x_ptr, w_ptr, x_ptr, rn, M, N, K, stride_xm, stride_wn, 0, M_PAD, 2 * PAIRS, BLOCK_K, False, True,
                  ROUND)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    # the GEMV's bf16 outputs, in float32: rounded here, compiled too (`_round_bf16` alone rounds only under the
    # interpreter, for a value that is stored next; these are multiplied first)
    ya, yb = tl.split(tl.reshape(_rounded(y, True, ROUND), [M_PAD, PAIRS, 2]))
    j = fa % HEAD_DIM
    rotate = ((fa < rope_end) & (j < HALF))[None, :]  # a query or key head's dims j and j + HALF
    rows_ok = rm < M
    take = rows_ok[:, None] & rotate
    cs = rm.to(tl.int64)[:, None] * stride_c + j[None, :]
    c1 = _rounded(tl.load(cos_ptr + cs, mask=take, other=0.0).to(tl.float32), True, ROUND)
    c2 = _rounded(tl.load(cos_ptr + cs + HALF, mask=take, other=0.0).to(tl.float32), True, ROUND)
    s1 = _rounded(tl.load(sin_ptr + cs, mask=take, other=0.0).to(tl.float32), True, ROUND)
    s2 = _rounded(tl.load(sin_ptr + cs + HALF, mask=take, other=0.0).to(tl.float32), True, ROUND)
    y1 = tl.where(rotate, _rounded(_rounded(ya * c1, True, ROUND) - _rounded(yb * s1, True, ROUND), True, ROUND), ya)
    y2 = tl.where(rotate, _rounded(_rounded(yb * c2, True, ROUND) + _rounded(ya * s2, True, ROUND), True, ROUND), yb)
    slot = tl.load(slot_ptr + rm, mask=rows_ok & STORE, other=0)
    _store_features(out_ptr, kc_ptr, vc_ptr, slot, rm, fa, y1, M, N, stride_om, stride_ch, k_start, v_start, HEAD_DIM,
                    STORE)
    _store_features(out_ptr, kc_ptr, vc_ptr, slot, rm, fb, y2, M, N, stride_om, stride_ch, k_start, v_start, HEAD_DIM,
                    STORE)


@triton.jit
def _store_features(out_ptr, kc_ptr, vc_ptr, slot, rm, f, y, M, N, stride_om, stride_ch, k_start, v_start,
                    HEAD_DIM: tl.constexpr, STORE: tl.constexpr):
    """Output features `f` ``[P]`` of rows `rm` (values `y` ``[M_PAD, P]``) into the output and,
    (`STORE`) the keys' and values' among them at each row's `slot` of the paged cache."""
    ok = (rm < M)[:, None] & (f[None, :] < N)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + f[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)
    if STORE:
        value = f >= v_start
        g = tl.where(value, f - v_start, f - k_start)
        dst = (g // HEAD_DIM).to(tl.int64)[None, :] * stride_ch + slot[:, None] * HEAD_DIM + (g % HEAD_DIM)[None, :]
        tl.store(kc_ptr + dst, y.to(kc_ptr.dtype.element_ty), mask=ok & ((f >= k_start) & ~value)[None, :])
        tl.store(vc_ptr + dst, y.to(vc_ptr.dtype.element_ty), mask=ok & value[None, :])


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


_TICKETS: dict = {}


def tickets(device: torch.device) -> torch.Tensor:
    """The int32 ticket `gemv_add_norm`'s launches on `device` take (zero between launches: the
    last program of each sets it back; launches on one stream run one after another), made once
    (before a CUDA graph's capture, by the eager run before it)."""
    key = str(device)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _TICKETS[key]


def gemv_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor,
                  norm_weight: torch.Tensor | None, eps: float, gemma: bool = False,
                  a_weight: torch.Tensor | None = None, launch: Launch | None = None, rows: int | None = None,
                  up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step's product and the residual add and RMSNorm after it in one launch
    (`_gemv_add_norm_kernel`): the values of ``a = gemv(x, weight, bias, up=up)`` and then
    ``rowwise.add_rms_norm(h, a, norm_weight, eps, gemma, a_weight)``, which this returns: (s, y
    or None). bf16 only (compiled without fused multiply-adds, as the add-norm kernel is; the
    GEMV's bf16 products are exact in float32, so its sums keep their values), x ``[M, K]`` of 1
    to `MAX_ROWS` rows, h ``[M, N]``; `launch` with `rowwise.ADD_NORM_WARPS` warps (the norm's
    sums in its order). Raises `Refused` (a ValueError) for another call."""
    m = x.shape[0]
    n = weight.shape[0]
    launch = launch or DEFAULT
    if not (takes(x, weight, bias) and x.dtype == h.dtype == torch.bfloat16 and h.shape == (m, n)
            and add_norm_takes(h, h, norm_weight, a_weight) and launch.num_warps == ADD_NORM_WARPS
            and (up is None or (up.shape == x.shape and up.dtype == x.dtype and up.stride(-1) == 1))):
        raise refuse("gemv_add_norm", x, weight, bias, f"1-{MAX_ROWS} bf16 rows, a residual [rows, N] and norm "
                     f"weights [N] of bf16, a launch of {ADD_NORM_WARPS} warps")
    k = x.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # (a: read back by the last program)
    s = torch.empty(m, n, dtype=x.dtype, device=x.device)
    y = torch.empty_like(s) if norm_weight is not None else None
    rows = rows or rows_per_program(n, x.device, launch.per_sm)
    _gemv_add_norm_kernel[(cdiv(n, rows),)](
        x, weight, bias if bias is not None else weight, out, up if up is not None else x, h,
        a_weight if a_weight is not None else h, norm_weight if norm_weight is not None else h, s,
        y if y is not None else s, tickets(x.device), m, n, k, x.stride(0), weight.stride(0),
        up.stride(0) if up is not None else 0, h.stride(0), eps, M_PAD=next_power_of_2(m), ROWS=rows,
        BLOCK_K=max(16, launch.tile // rows), HAS_BIAS=bias is not None, SILU_MUL=up is not None,
        NORM_ROWS=norm_rows(n), BLOCK_N=next_power_of_2(n), NORM_A=a_weight is not None,
        NORM_OUT=norm_weight is not None, GEMMA=gemma, ROUND=INTERPRET, num_warps=launch.num_warps,
        num_stages=NUM_STAGES, **NO_FMA)
    return s, y


_ORDERS: dict = {}


def rope_order(n: int, head_dim: int, half: int, rope_end: int, device: torch.device) -> torch.Tensor:
    """int32 ``[n]``: the output features of a fused q/k/v product in pairs, as
    `_gemv_rope_kernel` takes them: each query and key head's dims ``(j, j + half)`` for j <
    `half`, then its dims past ``2 half`` two by two, then the values' two by two (features from
    `rope_end` on); kept per device and shape."""
    key = (n, head_dim, half, rope_end, str(device))
    if key not in _ORDERS:
        order = []
        for head in range(0, rope_end, head_dim):
            order += [f for j in range(half) for f in (head + j, head + j + half)]
            order += range(head + 2 * half, head + head_dim)
        order += range(rope_end, n)
        _ORDERS[key] = torch.tensor(order, dtype=torch.int32, device=device)
    return _ORDERS[key]


def gemv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, head_dim: int, q_features: int, kv_features: int, store=None,
              launch: Launch | None = None, pairs: int | None = None) -> torch.Tensor:
    """A decode step's fused q/k/v product with RoPE applied to its query and key heads in the
    same launch (`_gemv_rope_kernel`), and, with `store` (anything with ``k_cache``, ``v_cache``
    and ``slot_mapping``: `layers.attention.KVStore`), the keys and values written into the
    layer's paged cache at its slots (its ``written`` set): the values of `gemv` (launched two
    features a program) and then `rowwise.apply_rope_qk`, one launch instead of two.

    x ``[M, K]`` bf16 (1 to `MAX_ROWS` rows), weight ``[q_features + 2 kv_features, K]`` (q, k,
    v rows of heads of `head_dim`), bias or None; cos, sin ``[M, rope_dim]`` (bf16 or float32,
    contiguous rows; rope_dim even, at most head_dim: the first rope_dim dims of each head
    rotate in halves). Returns ``[M, N]`` bf16: rotated q and k, then v. `launch`: its K chunk
    and warps; `pairs`: pairs of features a program (default one, `INTERPRET_ROWS` / 2 under the
    interpreter, which runs programs one by one). Raises `Refused` for another call."""
    n = weight.shape[0]
    ok = (takes(x, weight, bias) and x.dtype == torch.bfloat16 and n == q_features + 2 * kv_features
          and q_features % head_dim == 0 and kv_features % head_dim == 0 and head_dim % 2 == 0
          and cos.shape == sin.shape == (x.shape[0], cos.shape[1]) and cos.dtype == sin.dtype
          and cos.dtype in (torch.bfloat16, torch.float32) and cos.stride() == sin.stride() and cos.stride(-1) == 1
          and cos.shape[1] % 2 == 0 and 0 < cos.shape[1] <= head_dim)
    if ok and store is not None:
        kc, vc, slots = store.k_cache, store.v_cache, store.slot_mapping
        ok = (kc.dtype == vc.dtype == x.dtype and kc.shape == vc.shape and kc.dim() == 4
              and kc.shape[0] * head_dim == kv_features and kc.shape[3] == head_dim and kc.is_contiguous()
              and vc.is_contiguous() and slots.dtype == torch.int64 and slots.shape == x.shape[:1]
              and slots.is_contiguous())
    if not ok:
        raise refuse("gemv_rope", x, weight, bias, f"1-{MAX_ROWS} bf16 rows, q/k/v heads and their RoPE tables")
    launch = launch or DEFAULT
    m, k = x.shape
    half = cos.shape[1] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    order = rope_order(n, head_dim, half, q_features + kv_features, x.device)
    kc, vc, slots = (store.k_cache, store.v_cache, store.slot_mapping) if store is not None else (x, x, order)
    if pairs is None:
        pairs = INTERPRET_ROWS // 2 if INTERPRET else 1
    if (n // 2) % pairs:
        pairs = 1
    _gemv_rope_kernel[(n // (2 * pairs),)](
        x, weight, bias if bias is not None else weight, out, order, cos, sin, kc, vc, slots, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), cos.stride(0), kc.stride(0) if store is not None else 0,
        q_features + kv_features, q_features, q_features + kv_features,
        M_PAD=next_power_of_2(m), PAIRS=pairs, BLOCK_K=max(16, launch.tile // 2), HAS_BIAS=bias is not None, HALF=half,
        HEAD_DIM=head_dim, STORE=store is not None, ROUND=INTERPRET, num_warps=launch.num_warps,
        num_stages=NUM_STAGES, **NO_FMA)
    if store is not None:
        store.written = True
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
        return remembered(key, lambda: _choose_silu(pairs, launch, max_rows, graph_seconds, checked=True))
    return _choose_silu(pairs, launch, max_rows, timer)


def _choose_silu(pairs: list, launch: Launch | None, max_rows: int, timer, checked: bool = False) -> tuple[int, dict]:
    """`choose_silu`'s rows and times, timed with `timer`; `checked`: first `same_values`."""
    from nextoken.kernels.gpu.rowwise import act_and_mul

    w0 = pairs[0][0]

    def ways(m: int):
        g, u = (torch.randn(m, w0.shape[1], device=w0.device).to(w0.dtype) for _ in range(2))
        return (lambda w, b: gemv(g, w, b, launch=launch, up=u)), (lambda w, b: gemv(act_and_mul(g, u), w, b,
                                                                                      launch=launch))

    return timed_fusion("SiLU inside the GEMV", ways, pairs, max_rows, timer, checked)


def timed_fusion(what: str, ways, pairs: list, max_rows: int, timer, checked: bool) -> tuple[int, dict]:
    """`fused_rows` of a fusion whose ``ways(rows) -> (fused, apart[, same])`` compute, for one
    weight and bias, its result and its two launches' (timed over every pair of `pairs`); `checked`:
    before each row count is timed, the fusion and its two launches (`same`, where their launch
    differs from the model's: the fused q/k/v's GEMV at two features a program) on the first pair
    must give the same bits (`same_values`)."""

    def both(m: int) -> tuple[float, float]:
        fused, apart, *same = ways(m)
        if checked:
            same_values(what, lambda: fused(*pairs[0]), lambda: (same or [apart])[0](*pairs[0]))
        return timer(lambda: [fused(w, b) for w, b in pairs]), timer(lambda: [apart(w, b) for w, b in pairs])

    return fused_rows(both, max_rows)


class Unequal(ValueError):
    """A fusion whose values are not its two launches' on this device (`same_values`)."""


def same_values(what: str, fused, apart) -> None:
    """Raise `Unequal` unless ``fused()`` and ``apart()`` (each a tensor or a tuple of tensors)
    hold the same bits: a fusion is kept only where it computes its two launches' values (as the
    tests hold it under the interpreter), which a compiler or a race on some GPU could break."""
    a, b = fused(), apart()
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            differ = "all" if x is None or y is None or x.shape != y.shape else int((x != y).sum())
            raise Unequal(f"{what}: {differ} of its values differ from its two launches' on this device")


def fused_rows(both, max_rows: int) -> tuple[int, dict]:
    """The most rows (of 1, 2, 4, up to `max_rows`) up to which a fusion is faster, ``both(rows)
    -> (fused seconds, apart seconds)`` timing the two ways at a row count (in order, stopping at
    the first it loses), and ``{"fused", "apart": seconds at one row}``."""
    rows, report = 0, {}
    for m in (1, 2, 4):
        if m > max_rows:
            break
        fused, apart = both(m)
        if m == 1:
            report = {"fused": fused, "apart": apart}
        if fused >= apart:
            break
        rows = m
    return rows, report


def choose_rope(weights: list, head_dim: int, q_features: int, kv_features: int, rope_dim: int,
                launch: Launch | None, max_rows: int, timer=None) -> tuple[int, dict]:
    """Up to how many rows (0 to `max_rows`, of 1, 2, 4) the fused q/k/v products `weights`
    (``[(weight, bias), ...]``, one shape, bf16, on `launch`) take RoPE and the cache's write
    inside the GEMV (`gemv_rope`), timed against the GEMV and then the RoPE kernel with its
    store (`rowwise.apply_rope_qk`) over a scratch cache: two features a program whatever
    `launch`'s rows, and the tables read in every program, against a launch less (``timer``:
    default `timing.graph_seconds`, once per process for its shapes). Returns (rows, ``{"fused" |
    "apart": seconds at one row}``)."""
    from nextoken.kernels.gpu.timing import graph_seconds, remembered

    w0 = weights[0][0]
    args = (weights, head_dim, q_features, kv_features, rope_dim, launch, max_rows)
    if timer is None:
        key = ("gemv rope", str(w0.device), tuple(w0.shape), weights[0][1] is not None, len(weights), head_dim,
               q_features, rope_dim, str(launch), max_rows)
        return remembered(key, lambda: _choose_rope(*args, graph_seconds, checked=True))
    return _choose_rope(*args, timer)


def _choose_rope(weights: list, head_dim: int, q_features: int, kv_features: int, rope_dim: int,
                 launch: Launch | None, max_rows: int, timer, checked: bool = False) -> tuple[int, dict]:
    """`choose_rope`'s rows and times, timed with `timer`; `checked`: first `same_values` (the
    products and the scratch caches they write)."""
    from types import SimpleNamespace

    from nextoken.kernels.gpu.rowwise import apply_rope_qk

    w0 = weights[0][0]
    dev, hkv = w0.device, kv_features // head_dim

    def ways(m: int):
        x = torch.randn(m, w0.shape[1], device=dev).to(w0.dtype)
        cos, sin = (torch.rand(m, rope_dim, device=dev).to(w0.dtype) for _ in range(2))
        slots = torch.arange(m, dtype=torch.int64, device=dev)
        caches = [[torch.zeros(hkv, 8, 16, head_dim, dtype=w0.dtype, device=dev) for _ in range(2)] for _ in range(2)]

        def store(way, v):  # (`layers.attention.KVStore`'s fields, over a scratch cache of each way)
            return SimpleNamespace(k_cache=caches[way][0], v_cache=caches[way][1], slot_mapping=slots, v=v,
                                   written=False)

        def fused(w, b):
            return gemv_rope(x, w, b, cos, sin, head_dim, q_features, kv_features, store(0, None), launch=launch), \
                *caches[0]

        def apart(w, b, rows=None):  # (the model's two launches; at two features a program, the fused
            # launch's K chunk and so its sums' order: the values it must give)
            q, k, v = gemv(x, w, b, rows=rows, launch=launch).split([q_features, kv_features, kv_features], 1)
            qo, ko = apply_rope_qk(q.view(m, -1, head_dim), k.view(m, -1, head_dim), cos, sin,
                                   store(1, v.view(m, -1, head_dim)))
            return torch.cat([qo.view(m, -1), ko.view(m, -1), v], 1), *caches[1]

        return fused, apart, lambda w, b: apart(w, b, rows=2)

    return timed_fusion("RoPE inside the GEMV", ways, weights, max_rows, timer, checked)


def choose_norm(pairs: list, eps: float, launch: Launch | None, max_rows: int, timer=None) -> tuple[int, dict]:
    """Up to how many rows (0 to `max_rows`, of 1, 2, 4) the products `pairs` (``[(weight, bias),
    ...]``, one shape, bf16, on `launch`: o or down projections) take the residual add and
    RMSNorm after them inside the GEMV (`gemv_add_norm`), timed against the GEMV and then
    `rowwise.add_rms_norm`: a launch less, against the last program's serial pass over the whole
    rows after every other program has finished (``timer``: default `timing.graph_seconds`, once
    per process for its shapes). Returns (rows, ``{"fused" | "apart": seconds at one row}``)."""
    from nextoken.kernels.gpu.timing import graph_seconds, remembered

    w0 = pairs[0][0]
    if timer is None:
        key = ("gemv norm", str(w0.device), tuple(w0.shape), pairs[0][1] is not None, len(pairs), str(launch),
               max_rows)
        return remembered(key, lambda: _choose_norm(pairs, eps, launch, max_rows, graph_seconds, checked=True))
    return _choose_norm(pairs, eps, launch, max_rows, timer)


def _choose_norm(pairs: list, eps: float, launch: Launch | None, max_rows: int, timer,
                 checked: bool = False) -> tuple[int, dict]:
    """`choose_norm`'s rows and times, timed with `timer`; `checked`: first `same_values`."""
    from nextoken.kernels.gpu.rowwise import add_rms_norm

    w0 = pairs[0][0]
    n, k = w0.shape
    weight = (1 + 0.1 * torch.randn(n, device=w0.device)).to(w0.dtype)

    def ways(m: int):
        x = torch.randn(m, k, device=w0.device).to(w0.dtype)
        h = torch.randn(m, n, device=w0.device).to(w0.dtype)
        return (lambda w, b: gemv_add_norm(x, w, b, h, weight, eps, launch=launch)), \
            (lambda w, b: add_rms_norm(h, gemv(x, w, b, launch=launch), weight, eps))

    return timed_fusion("the add and norm inside the GEMV", ways, pairs, max_rows, timer, checked)
