"""The sampler's draw on a GPU in Triton: one program per row, the rule of
`sample.sampler.torch_draw` (and ``kernels/sampling.c``) without sorting the vocabulary.

Why: on the H200 (`benchmarks/gpu_check.py`'s profile, 2026-11-30), the PyTorch draw of 64
sampled rows (temperature and top-p) over Qwen 2.5's 151,936 tokens took 1.8 ms a step: a
stable sort of every row (0.66 ms), a float64 cumulative sum for top-p (0.58 ms) and another
for the draw, against a decode step whose graph ran 4.4 ms. Here a row is one program that
reads its logits about twenty times (from the L2 cache) and writes one token id.

The rule, per row of logits l ``[V]`` (the reference's, whose docstrings give the sources):

- greedy (temperature 0): the first index of max l (one pass);
- x = l / T (IEEE division, as PyTorch's), m = max x, e = exp(x - m) (CUDA's expf, as
  PyTorch's; the interpreter's is NumPy's);
- the tokens in the order x descending, ties by id (the reference's stable sort). Each token's
  32-bit order key is its float's bits, the lower 31 flipped for negatives, so one compare of
  keys is one compare of x: no sort is needed to ask "how many tokens, and how much mass, lie
  above x = v";
- top-k: the K-th token's key by bisection on counts (16 passes, each trying three keys); of
  the tokens tied at that key the first ones by id, as many as K leaves;
- top-p: with L = top_p times the mass of the top-k set (float64), the last kept token's key by
  bisection on masses: the smallest key v with mass(x > v) < L (16 passes). A token
  above it is kept (the mass before it is below L); one tied at it is kept while the mass
  above plus that of the ties before it by id is below L;
- min-p: e >= min_p; the first token (max x, lowest id) is always kept;
- the draw: the kept tokens in id order, S their running float64 sum of e; the first token whose
  S exceeds u times the total.

A sampled row's passes after the first (about twenty with top-p: the mass at three keys a pass,
float64) read its order keys and e from scratch that its second pass writes (int32 and float32,
8 bytes a token; `SCRATCH_ROWS` rows a launch), not the logits: on the H200 (2026-11-30) a pass
that divided and exponentiated the row again kept its one multiprocessor computing, 1.6 ms for
one row of 151,936 against PyTorch's 0.74. ``cached=False`` recomputes, for `gpu_check`'s
comparison; the tokens are the same.

One program a row uses one multiprocessor: a batch of few rows leaves the GPU idle where
PyTorch's sort spreads a row over all of it. So the plan times both on this GPU at load
(`choose_min_rows`) and the sampler takes this kernel from the batch size where it is faster.

Sums are float64 as the reference's, but summed in another order (lanes across tiles, then a
tree; the reference's is sequential on the CPU and a parallel scan on a GPU), so a token can
differ from the reference's only where u or top_p falls within float64's rounding of a
boundary. Each program reads one row, so a row's token does not depend on its batch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nextoken.kernels.gpu.ints import next_power_of_2
from nextoken.kernels.gpu.timing import eager_seconds

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TILE = 1024  # logits a program reads per step of a pass (compiled)
INTERPRET_TILE = 4096  # under the interpreter, where each step costs NumPy calls
NUM_WARPS = 8
SCRATCH_ROWS = 64  # rows a cached draw launches at once: their scratch, 8 bytes a token (78 MB at 152k tokens)
LOW: tl.constexpr = tl.constexpr(-(2**31) - 1)  # below every order key: "no cut"


@triton.jit
def _order_key(x):
    """The int64 key of float32 `x` (no NaN) whose order is x's: the bits, the lower 31 flipped
    for negatives; -0.0 as +0.0 (equal floats, equal keys)."""
    b = x.to(tl.int32, bitcast=True)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, k).to(tl.int64)


@triton.jit
def _from_key(k):
    """The float32 whose `_order_key` is int64 `k` (the map is its own inverse on the bits)."""
    b = (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.int32)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _exp(z, INTERPRET: tl.constexpr):
    """e^z in float32: CUDA's expf (PyTorch's), or NumPy's under the interpreter."""
    if INTERPRET:
        e = tl.exp(z)
    else:
        e = libdevice.exp(z)
    return e


@triton.jit
def _x(base, i, ok, T):
    """x = l / T of the logits at `i` (``-inf`` outside the row)."""
    return tl.math.div_rn(tl.load(base + i, mask=ok, other=float("-inf")), T)


@triton.jit
def _key_e(base, kc, ec, i, ok, T, m, CACHED: tl.constexpr, INTERPRET: tl.constexpr):
    """The order keys (int64; `LOW` outside the row) and e of the tokens at `i`: computed from the
    logits, or (`CACHED`) read back from the row's scratch, where `_fill` wrote the same values."""
    if CACHED:
        key = tl.where(ok, tl.load(kc + i, mask=ok, other=0).to(tl.int64), LOW)
        e = tl.load(ec + i, mask=ok, other=0.0)
    else:
        x = _x(base, i, ok, T)
        key = tl.where(ok, _order_key(x), LOW)
        e = tl.where(ok, _exp(x - m, INTERPRET), 0.0)
    return key, e


@triton.jit
def _fill(base, kc, ec, V, T, m, TILE: tl.constexpr, INTERPRET: tl.constexpr):
    """Write the row's order keys (int32: they come from 32-bit floats) and e (float32) to its
    scratch, so that the passes after read 8 bytes a token instead of recomputing x and e^x."""
    offs = tl.arange(0, TILE)
    for start in range(0, V, TILE):
        i = start + offs
        ok = i < V
        x = _x(base, i, ok, T)
        tl.store(kc + i, _order_key(x).to(tl.int32), mask=ok)
        tl.store(ec + i, _exp(x - m, INTERPRET), mask=ok)


@triton.jit
def _above(base, kc, ec, V, T, m, t1, t2, t3, MASS: tl.constexpr, TILE: tl.constexpr, CACHED: tl.constexpr,
           INTERPRET: tl.constexpr):
    """How many tokens of the row (or, `MASS`, how much of e in float64) lie above each of the
    keys t1 <= t2 <= t3: one pass for three thresholds of a bisection."""
    offs = tl.arange(0, TILE)
    if MASS:
        a1 = tl.zeros([TILE], tl.float64)
    else:
        a1 = tl.zeros([TILE], tl.int32)
    a2 = a1
    a3 = a1
    for start in range(0, V, TILE):
        i = start + offs
        key, e = _key_e(base, kc, ec, i, i < V, T, m, CACHED, INTERPRET)
        if MASS:
            w = e.to(tl.float64)
        else:
            w = tl.full([TILE], 1, tl.int32)
        a1 += tl.where(key > t1, w, 0)
        a2 += tl.where(key > t2, w, 0)
        a3 += tl.where(key > t3, w, 0)
    return tl.sum(a1, 0), tl.sum(a2, 0), tl.sum(a3, 0)


@triton.jit
def _bisect(base, kc, ec, V, T, m, lo, hi, at_hi, limit, MASS: tl.constexpr, TILE: tl.constexpr,
            CACHED: tl.constexpr, INTERPRET: tl.constexpr):
    """The smallest key k in (lo, hi] with (count or mass) above k < `limit`, and that amount:
    the amount above `lo` must not be below `limit`, the amount above `hi` (`at_hi`) must. Each
    pass tries three keys, so a range of 2^32 keys takes 16 passes."""
    while hi - lo > 1:
        t1 = lo + (hi - lo) // 4
        t2 = lo + (hi - lo) // 2
        t3 = lo + 3 * ((hi - lo) // 4)
        s1, s2, s3 = _above(base, kc, ec, V, T, m, t1, t2, t3, MASS, TILE, CACHED, INTERPRET)
        if (s1 < limit) & (t1 > lo):
            hi = t1
            at_hi = s1
        elif s2 < limit:
            lo = tl.maximum(lo, t1)
            hi = t2
            at_hi = s2
        elif (s3 < limit) & (t3 > t2):
            lo = t2
            hi = t3
            at_hi = s3
        else:
            lo = tl.maximum(t2, t3)
    return hi, at_hi


@triton.jit
def _kept(key, e, i, ok, best, cut_k, allow_k, ties_k, cut_p, G, L, e_p, ties_p, Mp):
    """Which tokens of a tile (their order keys, int64, and e) survive the filters (bool), and
    the counts of tokens tied at each cut so far (the ranks of the next tile's ties start there).
    `cut_k`, `cut_p`: the keys of the top-k and top-p cuts (`LOW`: off); `allow_k` ties at the
    top-k cut are kept; a tie at the top-p cut is kept while ``G + rank * e_p < L``; min-p:
    ``e >= Mp``; `best` always."""
    tie_k = (ok & (key == cut_k)).to(tl.int32)
    rank_k = ties_k + tl.cumsum(tie_k, 0) - tie_k
    tie_p = (ok & (key == cut_p)).to(tl.int32)
    rank_p = ties_p + tl.cumsum(tie_p, 0) - tie_p
    in_k = (key > cut_k) | ((tie_k != 0) & (rank_k < allow_k))
    in_p = (key > cut_p) | ((tie_p != 0) & (G + rank_p.to(tl.float64) * e_p < L))
    kept = (ok & in_k & in_p & (e >= Mp)) | (i == best)
    return kept, ties_k + tl.sum(tie_k, 0), ties_p + tl.sum(tie_p, 0)


@triton.jit
def _draw_kernel(l_ptr, stride_l, V, t_ptr, k_ptr, p_ptr, mp_ptr, u_ptr, out_ptr, kc_ptr, ec_ptr, stride_c,
                 TILE: tl.constexpr, CACHED: tl.constexpr, INTERPRET: tl.constexpr):
    """One row's token (see the module docstring); `CACHED`: its keys and e written once to the
    row's scratch (``kc_ptr``, ``ec_ptr``: int32 and float32, ``stride_c`` a row) and read back by
    every later pass. Grid: (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * stride_l
    kc = kc_ptr + row * stride_c
    ec = ec_ptr + row * stride_c
    T = tl.load(t_ptr + row)
    Td = tl.where(T > 0.0, T, 1.0)  # (greedy rows: x = l)
    offs = tl.arange(0, TILE)
    best_v = tl.full([TILE], float("-inf"), tl.float32)
    best_i = tl.zeros([TILE], tl.int32)
    for start in range(0, V, TILE):  # the max and the first index of it
        i = start + offs
        x = _x(base, i, i < V, Td)
        better = x > best_v
        best_i = tl.where(better, i, best_i)
        best_v = tl.where(better, x, best_v)
    m = tl.max(best_v, 0)
    best = tl.min(tl.where(best_v == m, best_i, V), 0)
    token = best
    if T > 0.0:
        K = tl.load(k_ptr + row)
        P = tl.load(p_ptr + row)
        Mp = tl.load(mp_ptr + row)
        u = tl.load(u_ptr + row).to(tl.float64)
        if CACHED:
            _fill(base, kc, ec, V, T, m, TILE, INTERPRET)
            tl.debug_barrier()  # (the program's own stores, read back by its other threads)
        top = _order_key(m)
        cut_k = tl.full([], LOW, tl.int64)
        allow_k = tl.zeros([], tl.int32) + V
        zk = tl.zeros([], tl.float64)
        if (K > 0) & (K < V):  # top-k: the smallest key with fewer than K tokens above it
            hi, above = _bisect(base, kc, ec, V, T, m, tl.full([], LOW, tl.int64), top, tl.zeros([], tl.int32), K,
                                False, TILE, CACHED, INTERPRET)
            cut_k = hi
            allow_k = K - above
            e_k = _exp(_from_key(hi) - m, INTERPRET).to(tl.float64)
            zk = _above(base, kc, ec, V, T, m, hi, hi, hi, True, TILE, CACHED, INTERPRET)[0] \
                + allow_k.to(tl.float64) * e_k
        elif P < 1.0:
            zk = _above(base, kc, ec, V, T, m, LOW, LOW, LOW, True, TILE, CACHED, INTERPRET)[0]
        cut_p = tl.full([], LOW, tl.int64)
        G = tl.zeros([], tl.float64)
        L = P.to(tl.float64) * zk
        e_p = tl.zeros([], tl.float64)
        if P < 1.0:  # top-p: the smallest key with less than L of mass above it
            lo = tl.where(cut_k > LOW, cut_k - 1, cut_k)
            cut_p, G = _bisect(base, kc, ec, V, T, m, lo, top, tl.zeros([], tl.float64), L, True, TILE, CACHED,
                               INTERPRET)
            e_p = _exp(_from_key(cut_p) - m, INTERPRET).to(tl.float64)
        # the total of the kept tokens' e in id order, then the first whose running sum passes u * total
        ties_k = tl.zeros([], tl.int32)
        ties_p = tl.zeros([], tl.int32)
        run = tl.zeros([], tl.float64)
        for start in range(0, V, TILE):
            i = start + offs
            ok = i < V
            key, e = _key_e(base, kc, ec, i, ok, T, m, CACHED, INTERPRET)
            kept, ties_k, ties_p = _kept(key, e, i, ok, best, cut_k, allow_k, ties_k, cut_p, G, L, e_p,
                                         ties_p, Mp)
            run = tl.max(run + tl.cumsum(tl.where(kept, e.to(tl.float64), 0.0), 0), 0)
        target = u * run
        token = tl.zeros([], tl.int32) + V
        start = tl.zeros([], tl.int32)
        ties_k = tl.zeros([], tl.int32)
        ties_p = tl.zeros([], tl.int32)
        run = tl.zeros([], tl.float64)
        while (start < V) & (token == V):
            i = start + offs
            ok = i < V
            key, e = _key_e(base, kc, ec, i, ok, T, m, CACHED, INTERPRET)
            kept, ties_k, ties_p = _kept(key, e, i, ok, best, cut_k, allow_k, ties_k, cut_p, G, L, e_p,
                                         ties_p, Mp)
            s = run + tl.cumsum(tl.where(kept, e.to(tl.float64), 0.0), 0)
            token = tl.min(tl.where(ok & (s > target), i, V), 0)
            run = tl.max(s, 0)
            start += TILE
        token = tl.minimum(token, V - 1)
    tl.store(out_ptr + row, token.to(tl.int64))


def draw_rows(rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, u: torch.Tensor, cached: bool = True) -> torch.Tensor | None:
    """The token of each row of float32 logits ``[b, vocab]`` (unit stride along the vocabulary)
    under its settings ``[b]`` (temperature float32, 0: greedy; top_k int32, 0: off; top_p
    float32, 1: off; min_p float32, 0: off) and uniform number u float32 ``[b]`` in [0, 1):
    int64 ``[b]`` on the rows' device, as `sample.sampler.torch_draw` draws them. None for rows it
    does not take (another dtype or layout, settings not on the rows' device): the caller's
    PyTorch path runs. `cached`: each sampled row's order keys and e^(x - m) computed once into
    scratch (8 bytes a token, `SCRATCH_ROWS` rows a launch) and read back by the ~20 passes after,
    instead of each pass dividing and exponentiating the row again; the same tokens."""
    if rows.dim() != 2 or rows.dtype != torch.float32 or rows.stride(1) != 1 or rows.shape[1] >= 2**31 - 1:
        return None
    settings = (temperature, top_k, top_p, min_p, u)
    dtypes = (torch.float32, torch.int32, torch.float32, torch.float32, torch.float32)
    b, V = rows.shape
    if any(s.device != rows.device or s.dtype != d or s.shape != (b,) for s, d in zip(settings, dtypes)):
        return None
    out = torch.empty(b, dtype=torch.int64, device=rows.device)
    if b:
        settings = tuple(s.contiguous() for s in settings)
        tile = min(INTERPRET_TILE if INTERPRET else TILE, next_power_of_2(V))
        if not cached:
            _draw_kernel[(b,)](rows, rows.stride(0), V, *settings, out, rows, rows, 0, TILE=tile, CACHED=False,
                               INTERPRET=INTERPRET, num_warps=NUM_WARPS)
            return out
        n = min(b, SCRATCH_ROWS)
        keys = torch.empty(n, V, dtype=torch.int32, device=rows.device)
        es = torch.empty(n, V, dtype=torch.float32, device=rows.device)
        for a in range(0, b, n):  # (a launch per `SCRATCH_ROWS` rows, in order on the stream: one scratch)
            z = min(b, a + n)
            _draw_kernel[(z - a,)](rows[a:z], rows.stride(0), V, *(s[a:z] for s in settings), out[a:z], keys, es,
                                   V, TILE=tile, CACHED=True, INTERPRET=INTERPRET, num_warps=NUM_WARPS)
    return out


TIMED_ROWS = (1, 4, 16, 64, 256)  # the batch sizes `choose_min_rows` times


def choose_min_rows(vocab: int, device: torch.device, reference, timer=None, sizes: tuple[int, ...] = TIMED_ROWS
                    ) -> tuple[int, dict[int, tuple[float, float]]]:
    """The fewest rows from which `draw_rows` beats the PyTorch draw (`reference`:
    `sample.sampler.torch_draw`) at every batch size timed (`sizes`), both on random rows
    ``[b, vocab]`` (logits of spread 2, temperature 0.8, top-p 0.95: a draw's usual settings; the
    kernel's passes do not depend on the values), each as the engine runs it (eagerly, launches
    included). `timer(fn) -> seconds`
    (default `timing.eager_seconds`). Returns (that row count, 0 when no size has it faster at that size
    and every larger one; ``{rows: (ours, PyTorch's) seconds}``)."""
    timer = timer or eager_seconds
    times = {}
    for b in sizes:
        g = torch.Generator(device="cpu").manual_seed(b)
        rows = (torch.randn(b, vocab, generator=g) * 2).to(device)
        T, P = torch.full((b,), 0.8, device=device), torch.full((b,), 0.95, device=device)
        K, M = torch.zeros(b, dtype=torch.int32, device=device), torch.zeros(b, device=device)
        u = torch.rand(b, generator=g).to(device)
        sampled = list(range(b))
        times[b] = (timer(lambda: draw_rows(rows, T, K, P, M, u)),
                    timer(lambda: reference(rows, T, K, P, M, u, sampled=sampled, active=True)))
    return next((b for b in sizes if all(times[c][0] < times[c][1] for c in sizes if c >= b)), 0), times
