"""The GPU path's row-wise layers in Triton: RMSNorm, the residual add with the RMSNorm after it,
the gated activations and RoPE, one launch each (RoPE: the queries and the keys together, and
the keys and values written into the paged cache in the same launch) where PyTorch's
expressions launch several small kernels.

Why: on the H200 (`benchmarks/gpu_check.py`'s profile, 2026-11-30) a batch-1 decode step of a
Qwen2.5-1.5B-shaped model ran 3.4 ms on the GPU against 0.76 ms of weight reads: besides its
seven matmuls, each layer launched about 34 small kernels (RMSNorm's float32 conversion, square,
mean, epsilon, reciprocal root, products and cast back, twice; RoPE's products, concatenations
and sums for the queries and the keys; SiLU and its product), about 1.5 us each even inside a
CUDA graph: 1.4 ms of the step. Here a norm is one kernel (with the residual add before it, where
the layer has one), an activation and its product one, and the rotation of the queries and keys
with the cache's write one.

Each computes its PyTorch reference's function with the same roundings: `rms_norm` is
`kernels.gpu.batch_invariant.rms_norm` (its fixed rows per program also suit a decode's few
rows); `act_and_mul` rounds the activation to the inputs' dtype before the product, as
``F.silu(gate) * up`` in bf16 does; `apply_rope_qk` rounds cos and sin to the inputs' dtype and each
product and the sum, as `layers.rotary.apply_rope` in bf16 does. float32 inputs stay in float32
throughout. The exponential is the GPU's, so a bf16 result can differ from PyTorch's by one
rounding where the last bits of e^x move it. They compile without fused multiply-adds
(`batch_invariant.NO_FMA`): Triton's default would merge a product into the sum after it and skip
the product's rounding. Under Triton's interpreter (``TRITON_INTERPRET=1``,
the CPU tests) the roundings to bf16 are written out (`batch_invariant._round_bf16`): its
conversion truncates. The references these are tested against are `layers.norm`,
`layers.activation` and `layers.rotary` (tests/kernels/test_rowwise.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nextoken.kernels.gpu.batch_invariant import NO_FMA, _normed_rows, _round_bf16, norm_rows, rms_norm
from nextoken.kernels.gpu.ints import cdiv, next_power_of_2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ACT_BLOCK = 1024  # elements per program of `act_and_mul`
ADD_NORM_WARPS = 4  # warps of `add_rms_norm`'s programs (and of the GEMV that joins it: the same sums' order)


@triton.jit
def _rounded(x, BF16: tl.constexpr, ROUND: tl.constexpr):
    """float32 `x` rounded to the inputs' dtype (bf16: `BF16`; float32: itself), still float32:
    written out under the interpreter (`ROUND`), the hardware's conversion when compiled."""
    if BF16:
        if ROUND:
            x = _round_bf16(x, True)
        else:
            x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _act_mul_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                    GELU: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr):
    """``act(gate) * up`` over `BLOCK` columns of one row: SiLU ``g / (1 + e^-g)`` or (`GELU`)
    GELU's tanh form ``g / (1 + e^(-2a))``, ``a = sqrt(2/pi) (g + 0.044715 g^3)`` (the same
    function: ``0.5 (1 + tanh a) = 1 / (1 + e^-2a)``), in float32, rounded to the dtype, times up,
    rounded. Grid: (rows, column blocks); rows strided (a fused gate/up product's halves)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + row * stride_g + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + i, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        a = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = g / (1.0 + tl.exp(-2.0 * a))
    else:
        act = g / (1.0 + tl.exp(-g))
    y = _rounded(_rounded(act, BF16, ROUND) * u, BF16, ROUND)
    tl.store(out_ptr + row * stride_o + i, y.to(out_ptr.dtype.element_ty), mask=ok)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, gelu: bool = False) -> torch.Tensor | None:
    """``silu(gate) * up`` (or, `gelu`, ``gelu_tanh(gate) * up``) for gate and up of one shape and
    dtype (bf16 or float32) whose rows are contiguous (the halves of a fused gate/up product are),
    in that dtype, contiguous; None for other inputs (the caller's PyTorch expression runs)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in (torch.bfloat16, torch.float32) \
            or gate.dim() == 0:
        return None
    cols = gate.shape[-1]
    g2, u2 = gate.reshape(-1, cols), up.reshape(-1, cols)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        return None
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = g2.shape[0]
    if rows and cols:
        bf16 = gate.dtype == torch.bfloat16
        _act_mul_kernel[(rows, cdiv(cols, ACT_BLOCK))](
            g2, u2, out, cols, g2.stride(0), u2.stride(0), cols, BLOCK=ACT_BLOCK, GELU=gelu, BF16=bf16,
            ROUND=INTERPRET and bf16, num_warps=4, **NO_FMA)
    return out


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_qot, stride_qoh, stride_kot, stride_koh, stride_c, heads_q,
                 v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_vt, stride_vh, stride_ch,
                 HALF: tl.constexpr, HALF_P2: tl.constexpr, REST: tl.constexpr, REST_P2: tl.constexpr,
                 D_P2: tl.constexpr, STORE: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr):
    """One head of one token, of the queries (the first `heads_q` heads of the grid) or the keys:
    its first ``2 HALF`` dims rotated in halves (``x1 cos - x2 sin``, ``x2 cos + x1 sin``, each
    product and the sum rounded to the dtype, cos and sin first), the `REST` dims after them
    copied. `STORE`: a key head's program also writes the rotated key and the value of its head
    at the token's slot of the paged cache (``[heads, slots, head_dim]``, head stride
    `stride_ch`). Grid: (tokens, query heads + key heads)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h - heads_q
    key = hk >= 0
    if key:
        src = k_ptr + t * stride_kt + hk * stride_kh
        dst = ko_ptr + t * stride_kot + hk * stride_koh
    else:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = qo_ptr + t * stride_qot + h * stride_qoh
    i = tl.arange(0, HALF_P2)
    ok = i < HALF
    x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=ok, other=0.0).to(tl.float32)
    c1 = _rounded(tl.load(cos_ptr + t * stride_c + i, mask=ok, other=0.0).to(tl.float32), BF16, ROUND)
    c2 = _rounded(tl.load(cos_ptr + t * stride_c + HALF + i, mask=ok, other=0.0).to(tl.float32), BF16, ROUND)
    s1 = _rounded(tl.load(sin_ptr + t * stride_c + i, mask=ok, other=0.0).to(tl.float32), BF16, ROUND)
    s2 = _rounded(tl.load(sin_ptr + t * stride_c + HALF + i, mask=ok, other=0.0).to(tl.float32), BF16, ROUND)
    y1 = _rounded(_rounded(x1 * c1, BF16, ROUND) - _rounded(x2 * s1, BF16, ROUND), BF16, ROUND)
    y2 = _rounded(_rounded(x2 * c2, BF16, ROUND) + _rounded(x1 * s2, BF16, ROUND), BF16, ROUND)
    tl.store(dst + i, y1.to(qo_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF + i, y2.to(qo_ptr.dtype.element_ty), mask=ok)
    if REST > 0:
        j = tl.arange(0, REST_P2)
        keep = tl.load(src + 2 * HALF + j, mask=j < REST, other=0.0)
        tl.store(dst + 2 * HALF + j, keep, mask=j < REST)
    if STORE:
        if key:
            row = hk * stride_ch + tl.load(slot_ptr + t) * (2 * HALF + REST)
            tl.store(kc_ptr + row + i, y1.to(kc_ptr.dtype.element_ty), mask=ok)
            tl.store(kc_ptr + row + HALF + i, y2.to(kc_ptr.dtype.element_ty), mask=ok)
            if REST > 0:
                r = tl.arange(0, REST_P2)
                tl.store(kc_ptr + row + 2 * HALF + r, tl.load(src + 2 * HALF + r, mask=r < REST, other=0.0),
                         mask=r < REST)
            d = tl.arange(0, D_P2)
            vals = tl.load(v_ptr + t * stride_vt + hk * stride_vh + d, mask=d < 2 * HALF + REST, other=0.0)
            tl.store(vc_ptr + row + d, vals, mask=d < 2 * HALF + REST)


def _rope_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float32) and x.stride(-1) == 1
            and cos.dtype in (torch.float32, x.dtype) and cos.dtype == sin.dtype and cos.shape == sin.shape
            and cos.stride() == sin.stride()
            and cos.stride(-1) == 1 and cos.shape[0] == x.shape[0] and cos.shape[1] % 2 == 0
            and cos.shape[1] <= x.shape[2])


def _store_takes(store, k: torch.Tensor) -> bool:
    """Whether the kernel can write k and `store.v` into `store`'s paged cache: the cache in k's
    dtype, ``[kv heads, blocks, block_size, head_dim]`` contiguous, v like k with contiguous
    rows, one int64 slot per token."""
    kc, vc, slots, v = store.k_cache, store.v_cache, store.slot_mapping, store.v
    return (kc.dtype == vc.dtype == v.dtype == k.dtype and kc.shape == vc.shape and kc.dim() == 4
            and kc.shape[0] == k.shape[1] and kc.shape[3] == k.shape[2] and kc.is_contiguous() and vc.is_contiguous()
            and v.shape == k.shape and v.stride(-1) == 1 and slots.dtype == torch.int64 and slots.shape == k.shape[:1]
            and slots.is_contiguous())


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  store=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`layers.rotary.apply_rope` of the queries and the keys in one launch: q ``[T, heads,
    head_dim]`` and k ``[T, kv heads, head_dim]`` (one dtype, bf16 or float32, the last dim
    contiguous; strided rows taken, as views of a fused q/k/v product), cos and sin ``[T,
    rope_dim]`` in float32 or q's dtype (the model's tables: `models.base.DecoderModel.rope`;
    contiguous rows; rope_dim even, at most head_dim). Returns new tensors like q and k; None
    for other inputs (the caller's PyTorch expression runs).

    `store` (`layers.attention.KVStore`, or None): the same launch also writes the rotated keys
    and ``store.v`` into the layer's paged cache at ``store.slot_mapping``, as
    `kv_cache.tensors.PagedKVCache.write` would, and sets ``store.written``; a store it cannot
    take (another dtype or layout) is left unwritten."""
    if not (_rope_takes(q, cos, sin) and _rope_takes(k, cos, sin)) or k.dtype != q.dtype \
            or k.shape[::2] != q.shape[::2]:
        return None
    t, hq, d = q.shape
    hk = k.shape[1]
    half = cos.shape[1] // 2
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    take = store is not None and _store_takes(store, k)
    kc, vc, slots, v = (store.k_cache, store.v_cache, store.slot_mapping, store.v) if take else (k, k, cos, k)
    if t and hq + hk:
        bf16 = q.dtype == torch.bfloat16
        rest = d - 2 * half
        _rope_kernel[(t, hq + hk)](q, k, cos, sin, qo, ko, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                   qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos.stride(0), hq,
                                   v, kc, vc, slots, v.stride(0), v.stride(1), kc.stride(0) if take else 0,
                                   HALF=half, HALF_P2=next_power_of_2(half), REST=rest,
                                   REST_P2=next_power_of_2(max(rest, 1)), D_P2=next_power_of_2(d),
                                   STORE=take, BF16=bf16, ROUND=INTERPRET and bf16, num_warps=1, **NO_FMA)
    if take:
        store.written = True
    return qo, ko


@triton.jit(do_not_specialize=["rows"])  # (a pass's token count: one compilation, not one each for 1, 16k, others)
def _add_norm_kernel(h_ptr, a_ptr, wa_ptr, w_ptr, s_ptr, y_ptr, rows, n, stride_h, stride_a, stride_s, stride_y, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, NORM_A: tl.constexpr, NORM_OUT: tl.constexpr,
                     GEMMA: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr):
    """`ROWS` rows of the residual stream (`_add_norm_rows`). Grid: (row tiles,)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    _add_norm_rows(r, h_ptr, a_ptr, wa_ptr, w_ptr, s_ptr, y_ptr, rows, n, stride_h, stride_a, stride_s, stride_y, eps,
                   BLOCK, NORM_A, NORM_OUT, GEMMA, BF16, ROUND, "")


@triton.jit
def _add_norm_rows(r, h_ptr, a_ptr, wa_ptr, w_ptr, s_ptr, y_ptr, rows, n, stride_h, stride_a, stride_s, stride_y, eps,
                   BLOCK: tl.constexpr, NORM_A: tl.constexpr, NORM_OUT: tl.constexpr, GEMMA: tl.constexpr,
                   BF16: tl.constexpr, ROUND: tl.constexpr, A_CACHE: tl.constexpr):
    """Rows `r` (int64 ``[R]``, those ``< rows`` real) of the residual stream: ``s = h + a``
    (`NORM_A`: a first normed by its weight and rounded, Gemma 3's post-norms), rounded to the
    dtype and stored, then (`NORM_OUT`) the RMSNorm of s stored (`batch_invariant._normed_rows`).
    `A_CACHE`: a's loads' cache modifier (``".cg"``: from L2, a's stores being other programs'
    of the same launch, `gemv.gemv_add_norm`)."""
    i = tl.arange(0, BLOCK)
    ok = (r[:, None] < rows) & (i[None, :] < n)
    a = tl.load(a_ptr + r[:, None] * stride_a + i[None, :], mask=ok, other=0.0, cache_modifier=A_CACHE).to(tl.float32)
    if NORM_A:
        a = _rounded(_normed_rows(a, wa_ptr, n, eps, BLOCK, GEMMA, ROUND), BF16, ROUND)
    h = tl.load(h_ptr + r[:, None] * stride_h + i[None, :], mask=ok, other=0.0).to(tl.float32)
    s = _rounded(h + a, BF16, ROUND)
    tl.store(s_ptr + r[:, None] * stride_s + i[None, :], s.to(s_ptr.dtype.element_ty), mask=ok)
    if NORM_OUT:
        y = _normed_rows(s, w_ptr, n, eps, BLOCK, GEMMA, ROUND)
        tl.store(y_ptr + r[:, None] * stride_y + i[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor | None, eps: float, gemma: bool = False,
                 a_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`layers.norm.add_rms_norm` in one launch: the residual add ``s = h + a`` (with `a_weight`,
    ``h + rms_norm(a, a_weight)``) and the RMSNorm of s by `weight` (None: s alone), for h and a
    ``[T, n]`` of one dtype (bf16 or float32, contiguous rows) and weights ``[n]`` of it. `gemma`:
    Gemma's norm (the weight's product in float32). Returns (s, y or None), new contiguous
    tensors; None for other inputs (the caller's PyTorch expressions run). Rows per program as
    `batch_invariant.rms_norm`'s, so a row's values do not depend on the batch."""
    n = h.shape[-1]
    if not add_norm_takes(h, a, weight, a_weight):
        return None
    s = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    y = torch.empty_like(s) if weight is not None else None
    rows = h.shape[0]
    if rows and n:
        per, bf16 = norm_rows(n), h.dtype == torch.bfloat16
        _add_norm_kernel[(cdiv(rows, per),)](
            h, a, a_weight if a_weight is not None else h, weight if weight is not None else h, s,
            y if y is not None else s, rows, n, h.stride(0), a.stride(0), n, n, eps, ROWS=per,
            BLOCK=next_power_of_2(n), NORM_A=a_weight is not None, NORM_OUT=weight is not None,
            GEMMA=gemma, BF16=bf16, ROUND=INTERPRET and bf16, num_warps=ADD_NORM_WARPS, **NO_FMA)
    return s, y


def add_norm_takes(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor | None,
                   a_weight: torch.Tensor | None) -> bool:
    """Whether `add_rms_norm` takes these: h and a ``[T, n]`` of one dtype (bf16 or float32,
    contiguous rows), weights ``[n]`` of it or None."""
    n = h.shape[-1]
    return (h.shape == a.shape and h.dim() == 2 and h.dtype == a.dtype and h.dtype in (torch.bfloat16, torch.float32)
            and h.stride(-1) == 1 and a.stride(-1) == 1
            and all(w is None or (w.shape == (n,) and w.dtype == h.dtype and w.stride(0) == 1)
                    for w in (weight, a_weight)))


class Rowwise:
    """What a GPU plan hands the layers as their row-wise kernels (`runner.plan.ExecutionPlan.settle`):
    `layers.norm` calls `rms_norm` and `add_rms_norm`, `layers.activation` `act_and_mul`,
    `layers.rotary` `apply_rope_qk` on it."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    act_and_mul = staticmethod(act_and_mul)
    apply_rope_qk = staticmethod(apply_rope_qk)
