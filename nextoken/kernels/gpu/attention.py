"""Paged attention in Triton: one kernel for the prefill chunks and the decodes of a batch.

``softmax(scale q k^T + mask) v`` (Vaswani et al. 2017) computed the FlashAttention way (Dao et
al. 2022): each program holds a tile of query rows, walks the keys a tile at a time and keeps a
running maximum, denominator and output (the online softmax, Milakov & Gimelshein 2018), so
the scores never reach memory. The keys and values are read where they lie in the paged cache
(``[Hkv, num_blocks, block_size, D]``, `kv_cache.tensors.PagedKVCache`): each key's block comes
from the sequence's block table. The query heads that share a KV head (GQA, Ainslie et al.
2023) are stacked as rows of one tile, so a key tile is read once for all of them.

One program covers one KV head and either one decode (``decode=True``: one query, its
`group` heads) or `block_q` consecutive queries of one prefill chunk (their `group` heads
each). A decode can also be split over the keys (flash-decoding, Dao et al. 2023): `splits`
programs each take a share of the keys and leave their partial maximum, denominator and output,
which the last of them to finish joins exactly, in the same launch (`_join_last`, over a ticket
per decode and KV head; `_combine_kernel`, a second launch, is its plain path); a long sequence
of a small batch then fills the GPU.

Masks: causal (key position <= the query's), a sliding window (key position > query position -
`window`, `transformers`' rule), and soft-capping of the scores (``softcap tanh(s /
softcap)``, Gemma 2) where a model has it. The cache may hold int8 rows with a float32 scale
each (``--kv-cache-dtype int8``): the codes are read as the queries' dtype (exactly) and the
scales act on the scores and on the probabilities, ``q (c s)^T = (q c^T) s`` and ``p (c s) =
(p s) c``, so the tile takes the registers of a bf16 one. With `k_new`/`v_new` (`fresh`), the
keys from the chunk's first new token on come from this pass's keys instead of the cache (a
sliding-window layer's ring is read before the chunk's own keys overwrite it): the key loop
runs twice, over the cache up to the first new token, then over the pass's rows, so each tile
has one source.

Arithmetic: bf16 queries, keys and probabilities multiply on the tensor cores with float32
sums; float32 inputs multiply in IEEE float32 (never TF32), so the float32 path is the
reference's function to float32 rounding. Under Triton's interpreter (``TRITON_INTERPRET=1``,
the CPU tests) the operands are widened to float32 before each product, which computes the
same exact products (bf16 x bf16 fits float32; Triton 3.6's interpreter multiplies bf16 tiles
wrongly otherwise), and summed in an order fixed by the tile's shape (`kernels.gpu.dot`). The
reference these are tested against is `layers.attention.naive_attention` (float32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nextoken.kernels.gpu.dot import dot_f32
from nextoken.kernels.gpu.ints import next_power_of_2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU tests: Triton's interpreter
LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(ptr, kv_head, stride_h, stride_b, tables_ptr, seq, stride_tab, kpos, ok, d, new_ptr, stride_nt,
               stride_nh, q_start, new_start, like, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               INT8: tl.constexpr, NEW: tl.constexpr, MIXED: tl.constexpr):
    """Keys (or values) at positions `kpos` ``[BLOCK_N]`` of sequence `seq`, ``[BLOCK_N, D]`` in
    the dtype of `like` (the queries): from the paged cache through the block table (`INT8`
    codes are converted exactly, through float32, which Triton's interpreter needs; their scales
    are `_load_scales`'), or (`NEW`) from this pass's rows,
    the sequence's new tokens from position `new_start` on, and (`MIXED`, not with `INT8`) the
    positions before `new_start` from the cache. Rows with `ok` false are zero. Each
    load reads its keys' blocks from the table again (an L1 hit): one set of row offsets kept for
    the keys, values and scales of a step stays live across its products, and made the int8 and
    64-dim prefill tiles spill under Triton 3.6 (16-80 bytes a thread)."""
    if NEW:
        row = (q_start + kpos - new_start).to(tl.int64)
        src = new_ptr + row * stride_nt + kv_head * stride_nh  # each key's row: one pointer per key
        if MIXED:
            old = kpos < new_start
            block = tl.load(tables_ptr + seq * stride_tab + kpos // BLOCK_SIZE, mask=ok & old, other=0).to(tl.int64)
            src = tl.where(old, ptr + kv_head * stride_h + block * stride_b + (kpos % BLOCK_SIZE) * HEAD_DIM, src)
        x = tl.load(src[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    else:
        block = tl.load(tables_ptr + seq * stride_tab + kpos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = kpos % BLOCK_SIZE
        x = tl.load(ptr + kv_head * stride_h + block[:, None] * stride_b + slot[:, None] * HEAD_DIM + d[None, :],
                    mask=ok[:, None], other=0)
        if INT8:
            x = x.to(tl.float32)
    return x.to(like.dtype)


@triton.jit
def _load_scales(scales_ptr, kv_head, stride_sh, stride_sb, tables_ptr, seq, stride_tab, kpos, ok,
                 BLOCK_SIZE: tl.constexpr):
    """An int8 cache's float32 scales of the rows at `kpos` ``[BLOCK_N]`` (0 where not `ok`)."""
    block = tl.load(tables_ptr + seq * stride_tab + kpos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    return tl.load(scales_ptr + kv_head * stride_sh + block * stride_sb + kpos % BLOCK_SIZE, mask=ok, other=0.0)


@triton.jit
def _key_range(acc, m_i, l_i, q, q_pos, row_ok, start, end, k_ptr, v_ptr, ks_ptr, vs_ptr, kn_ptr, vn_ptr,
               tables_ptr, seq, kv_head, q_start, new_start, scale, softcap, window,
               stride_kh, stride_kb, stride_sh, stride_sb, stride_nt, stride_nh, stride_tab,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, INT8: tl.constexpr,
               NEW: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, WIDEN: tl.constexpr,
               MIXED: tl.constexpr):
    """The online softmax over keys ``start .. end - 1`` (read from the cache, or `NEW`: from this
    pass's rows, `MIXED`: those before the first new token from the cache), a tile of `BLOCK_N` at
    a time: returns the updated (acc ``[BLOCK_M, D]``, running maximum m_i and denominator l_i
    ``[BLOCK_M]``), scores in base 2."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    qk_scale = scale * 1.4426950408889634  # scores in base 2: exp2 is the hardware's
    for first in range(start, end, BLOCK_N):
        kpos = first + n
        key_ok = kpos < end
        k = _load_tile(k_ptr, kv_head, stride_kh, stride_kb, tables_ptr, seq, stride_tab, kpos, key_ok, d, kn_ptr,
                       stride_nt, stride_nh, q_start, new_start, q, HEAD_DIM, BLOCK_SIZE, INT8, NEW, MIXED)
        s = dot_f32(q, tl.trans(k), WIDEN)
        if INT8 and not NEW:  # q . (codes x scale) = (q . codes) x scale: the scales act on the scores
            s = s * _load_scales(ks_ptr, kv_head, stride_sh, stride_sb, tables_ptr, seq, stride_tab, kpos, key_ok,
                                 BLOCK_SIZE)[None, :]
        if SOFTCAP:  # softcap * tanh(s * scale / softcap), tanh written with exp
            t = tl.exp(-2.0 * tl.abs(s * scale / softcap))
            s = softcap * tl.where(s >= 0, 1.0, -1.0) * (1.0 - t) / (1.0 + t) * 1.4426950408889634
        else:
            s = s * qk_scale
        seen = row_ok[:, None] & key_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        if WINDOW:
            seen = seen & (kpos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to scale
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptr, kv_head, stride_kh, stride_kb, tables_ptr, seq, stride_tab, kpos, key_ok, d, vn_ptr,
                       stride_nt, stride_nh, q_start, new_start, q, HEAD_DIM, BLOCK_SIZE, INT8, NEW, MIXED)
        if INT8 and not NEW:  # and on the probabilities for the values: p (codes x scale) = (p x scale) codes
            p = p * _load_scales(vs_ptr, kv_head, stride_sh, stride_sb, tables_ptr, seq, stride_tab, kpos, key_ok,
                                 BLOCK_SIZE)[None, :]
        p = p.to(q.dtype)  # probabilities rounded to the values' dtype for the product (as FlashAttention)
        pv = dot_f32(p, v, WIDEN)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_tab"])  # (a prefill's table width varies: one compilation)
def _attention_kernel(
        out_ptr, part_ptr, tickets_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kn_ptr, vn_ptr,
        tables_ptr, seq_lens_ptr, q_start_ptr, qb_seq_ptr, qb_first_ptr,
        scale, softcap, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_kb, stride_sh, stride_sb,
        stride_nt, stride_nh, stride_tab, num_heads,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE: tl.constexpr, SPLITS: tl.constexpr,
        INT8: tl.constexpr, FRESH: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
        WIDEN: tl.constexpr, ALIGNED: tl.constexpr, JOIN: tl.constexpr):
    """One tile of query rows against one KV head's keys; see the module docstring. Grid:
    (query tiles, KV heads, SPLITS). `JOIN` (decodes, SPLITS > 1): the last of a decode's splits
    to finish joins them (`_join_last`)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = pid
        q0 = 0
    else:
        seq = tl.load(qb_seq_ptr + pid)
        q0 = tl.load(qb_first_ptr + pid)
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    new_start = seq_len - q_len  # the position of the sequence's first new token

    m = tl.arange(0, BLOCK_M)
    qi = q0 + m // GROUP  # each row's query (among the sequence's new tokens) and head
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (qi < q_len)
    q_pos = new_start + qi
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    hi = new_start + tl.minimum(q0 + BLOCK_Q, q_len)  # the tile's last query sees keys < hi
    lo = 0
    if WINDOW:
        lo = tl.maximum(new_start + q0 - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLITS > 1:
        share = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * share
        hi = tl.minimum(hi, lo + share)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    mid = hi
    if FRESH:  # the cache's keys up to the first new token, then this pass's own rows; `ALIGNED`
        if ALIGNED:  # (batch invariance): the switch at a tile boundary, its tile read from both
            mid = tl.minimum(tl.maximum(new_start // BLOCK_N * BLOCK_N, lo), hi)
        else:
            mid = tl.minimum(tl.maximum(new_start, lo), hi)
    acc, m_i, l_i = _key_range(acc, m_i, l_i, q, q_pos, row_ok, lo, mid, k_ptr, v_ptr, ks_ptr, vs_ptr, kn_ptr,
                               vn_ptr, tables_ptr, seq, kv_head, q_start, new_start, scale, softcap, window,
                               stride_kh, stride_kb, stride_sh, stride_sb, stride_nt, stride_nh, stride_tab,
                               BLOCK_N, HEAD_DIM, BLOCK_SIZE, INT8, False, SOFTCAP, WINDOW, WIDEN, False)
    if FRESH:
        acc, m_i, l_i = _key_range(acc, m_i, l_i, q, q_pos, row_ok, mid, hi, k_ptr, v_ptr, ks_ptr, vs_ptr, kn_ptr,
                                   vn_ptr, tables_ptr, seq, kv_head, q_start, new_start, scale, softcap, window,
                                   stride_kh, stride_kb, stride_sh, stride_sb, stride_nt, stride_nh, stride_tab,
                                   BLOCK_N, HEAD_DIM, BLOCK_SIZE, INT8, True, SOFTCAP, WINDOW, WIDEN, ALIGNED)

    if SPLITS > 1:  # this split's share: running max, denominator and unnormalised output
        at = ((seq * num_heads + head) * SPLITS + split).to(tl.int64) * (HEAD_DIM + 2)
        tl.store(part_ptr + at[:, None] + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ptr + at + HEAD_DIM, m_i, mask=row_ok)
        tl.store(part_ptr + at + HEAD_DIM + 1, l_i, mask=row_ok)
        if JOIN:
            _join_last(out_ptr, part_ptr, tickets_ptr, q_start_ptr, seq, kv_head, stride_ot, stride_oh, num_heads,
                       GROUP, BLOCK_M, SPLITS, HEAD_DIM)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _join_last(out_ptr, part_ptr, tickets_ptr, q_start_ptr, seq, kv_head, stride_ot, stride_oh, num_heads,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """After a split has stored its partials: take a ticket for its (decode, KV head); the split
    that takes the last one joins the partials of the `GROUP` heads (rows ``< GROUP`` of
    `BLOCK_M`), as `_combine_kernel` does but summing the splits in order, and sets the ticket
    back to 0 for the next launch. The semaphore of CUTLASS's serial split-K: the barrier puts
    every thread's stores before the ticket, whose acquire-release atomic (at GPU scope) makes
    them visible to the program that takes the last one, which reads them from L2 (``.cg``).
    One launch instead of the attention's and `_combine_kernel`'s two. The split loops are
    unrolled: as loops, the 64-dim decode tile spilled a register on sm_90."""
    ticket_ptr = tickets_ptr + seq * tl.num_programs(1) + kv_head
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLITS - 1:
        tl.debug_barrier()
        row = tl.load(q_start_ptr + seq).to(tl.int64)  # (loaded again: kept live over the key loop, it spilled)
        g = tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        head = kv_head * GROUP + g
        ok = g < GROUP
        first = ((seq * num_heads + head) * SPLITS).to(tl.int64) * (HEAD_DIM + 2)  # each head's first split
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for k in tl.static_range(SPLITS):
            top = tl.maximum(top, tl.load(part_ptr + first + k * (HEAD_DIM + 2) + HEAD_DIM, mask=ok,
                                          other=float("-inf"), cache_modifier=".cg"))
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for k in tl.static_range(SPLITS):
            at = first + k * (HEAD_DIM + 2)
            m = tl.load(part_ptr + at + HEAD_DIM, mask=ok, other=float("-inf"), cache_modifier=".cg")
            w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))
            total += w * tl.load(part_ptr + at + HEAD_DIM + 1, mask=ok, other=0.0, cache_modifier=".cg")
            acc += w[:, None] * tl.load(part_ptr + at[:, None] + d[None, :], mask=ok[:, None], other=0.0,
                                        cache_modifier=".cg")
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=ok[:, None])
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _combine_kernel(out_ptr, part_ptr, q_start_ptr, stride_ot, stride_oh, num_heads,
                    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Join one decode head's `SPLITS` partial softmaxes: ``sum_s 2^(m_s - M) acc_s / sum_s
    2^(m_s - M) l_s``, a launch after the attention's (the plain path of `_join_last`). Grid:
    (decodes, query heads)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    at = ((seq * num_heads + head) * SPLITS + s).to(tl.int64) * (HEAD_DIM + 2)
    m = tl.load(part_ptr + at + HEAD_DIM)
    l = tl.load(part_ptr + at + HEAD_DIM + 1)
    acc = tl.load(part_ptr + at[:, None] + d[None, :])
    top = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - tl.where(top == float("-inf"), 0.0, top)))
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    row = tl.load(q_start_ptr + seq).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class Tiling:
    """Tile shapes of one kind of call: query rows per program (`block_m`, padded to a power of
    two; `block_q` queries of `group` heads each), keys per step (`block_n`), and Triton's
    launch settings."""

    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}/{self.num_warps}w/{self.num_stages}s"


# The tiles `choose_tilings` times, per head size (the catalog's 64, 128 and 256; a smaller head
# takes the next's), the default first: decodes (keys per step, warps[, software-pipeline stages:
# 2 by default]), prefill chunks (query rows, keys per step, warps[, stages]). The key loop's loads
# are pipelined (cp.async into shared memory, two or three steps ahead). Each compiles for sm_90
# without a spill, as Triton specializes a launch on the model's aligned tensors and strides, for
# every variant the catalog's models run (an int8 cache, sliding windows, the pass's own keys),
# under Triton 3.6 (the GPU machine's) and 3.9 (the tests'): tests/kernels/test_triton_compile.py.
# Left out for spills: 32 keys over 4 warps at 128 dims (8 bytes under 3.9), 32 keys over 8 warps
# in 3 stages at 128 and 256 (an int8 cache, under 3.9), 128 x 128 prefill tiles at 128 dims and
# 128 x 32 or 64 x 64 at 256.
DECODE_TILES = {64: ((64, 4), (32, 4), (128, 4), (128, 8), (64, 4, 3), (128, 8, 3)),
                128: ((64, 8), (64, 4), (128, 8), (32, 8), (64, 8, 3), (128, 8, 3)),
                256: ((32, 4), (16, 4), (64, 8), (32, 8), (64, 8, 3))}
PREFILL_TILES = {64: ((128, 64, 8), (128, 128, 8), (64, 64, 4), (128, 32, 8), (64, 128, 4), (128, 64, 8, 3)),
                 128: ((128, 32, 8), (128, 64, 8), (64, 64, 4), (64, 32, 4), (128, 32, 8, 3), (128, 64, 8, 3)),
                 256: ((32, 32, 8), (64, 32, 8), (32, 64, 8), (32, 32, 8, 3), (32, 64, 8, 3))}


def tilings(decode: bool, group: int, head_dim: int, f32: bool = False) -> tuple[Tiling, ...]:
    """The tiles for decodes (one query per program) or prefill chunks, for `group` query heads
    per KV head, heads of `head_dim` and bf16 (or, `f32`, float32) operands: `DECODE_TILES` or
    `PREFILL_TILES` for the head size, the default first, each with rows for at least the
    group's heads (16 at least: a tensor-core tile). float32 (the reference) has one set of
    small tiles: without tensor cores larger ones spill."""
    rows = max(16, next_power_of_2(group))
    size = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    if decode:
        if f32:
            return (Tiling(1, rows, 16, 4, 2),)
        return tuple(Tiling(1, rows, t[0], t[1], t[2] if len(t) > 2 else 2) for t in DECODE_TILES[size])
    if f32:
        m, n, warps = {64: (32, 16, 4), 128: (16, 32, 8), 256: (16, 16, 4)}[size]  # (16 x 32 over 4 warps at 128
        # dims spilled 8 bytes under Triton 3.6)
        return (Tiling(max(m, rows) // group, max(m, rows), n, warps, 2),)
    return tuple(Tiling(max(t[0], rows) // group, max(t[0], rows), t[1], t[2], t[3] if len(t) > 3 else 2)
                 for t in PREFILL_TILES[size])


def tiling(decode: bool, group: int, head_dim: int, f32: bool = False) -> Tiling:
    """The default tiles of `tilings`: what a call without a timed choice takes."""
    return tilings(decode, group, head_dim, f32)[0]


SPLIT_CHOICES = (1, 4, 16)  # few values, so few compiled variants of the kernel


@dataclass(frozen=True)
class Tilings:
    """The tiles a model's attention takes: one for its decodes, one for its prefill chunks."""

    decode: Tiling
    prefill: Tiling
    join: bool = True  # a decode's key splits may be joined in its own launch (`_join_last`): off where its
    # values differed from two launches' (`_combine_kernel`)
    join_splits: int = SPLIT_CHOICES[-1]  # ... up to this many splits (the last: every decode); a decode of more
    # splits joins in a second launch, where the last program's serial join timed slower (`choose_join`)

    def joins(self, splits: int) -> bool:
        """Whether a decode of `splits` key splits joins them in its own launch."""
        return self.join and splits <= self.join_splits


def default_tilings(group: int, head_dim: int, f32: bool = False) -> Tilings:
    """The default decode and prefill tiles (`tiling`'s): a CPU's (the interpreter's), float32's,
    and a GPU's until its timing has chosen (`choose_tilings`)."""
    return Tilings(tiling(True, group, head_dim, f32), tiling(False, group, head_dim, f32))


def choose_tilings(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                   device: torch.device, timer=None, report: dict | None = None) -> Tilings:
    """The decode and prefill tiles of `tilings` that time fastest (`timing.fastest`, each replayed
    as a CUDA graph: `timing.graph_seconds`, or `timer(fn) -> seconds`) on work of the model's head
    shapes, in its dtype, over a paged cache of `block_size` rows a block with random keys: the
    decodes of 64 sequences of 640 keys and of one of 1024 (their times added: the tiles serve
    every batch), the key splits as the engine takes them (`decode_splits`); a prefill chunk of
    2048 new tokens of one sequence. Each is timed over two caches' worth of keys (two layers),
    so that the L2 cache does not hold them. float32 (the reference) keeps its one set. Without
    `timer`, each choice is made once per process for its shapes (`timing.remembered`), and the
    decodes with the chosen tiles are run with their splits joined in their own launch and in a
    second one: unless the two agree (`joins_as_two_launches`), ``join`` is off; where they do,
    both ways are timed (`choose_join`: ``join_splits``).
    `report`: gets ``{"decode" or "prefill": {str(tiling): seconds}, "join": {...}}``."""
    from nextoken.kernels.gpu.timing import graph_seconds, remembered

    if dtype == torch.float32:
        return default_tilings(num_heads // num_kv_heads, head_dim, True)
    args = (num_heads, num_kv_heads, head_dim, dtype, block_size, device)
    if timer is None:
        chosen, times = remembered(("attention", str(device), *args[:5]),
                                   lambda: _choose_tilings(*args, graph_seconds, checked=True))
    else:
        chosen, times = _choose_tilings(*args, timer)
    if report is not None:
        report.update(times)
    return chosen


def _choose_tilings(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                    device: torch.device, timer, checked: bool = False) -> tuple[Tilings, dict]:
    """`choose_tilings`' choice, timed with `timer`, and its report; `checked`: whether the
    chosen decode tiles' joined splits give the two launches' values (`joins_as_two_launches`)."""
    from nextoken.kernels.gpu.timing import fastest

    group = num_heads // num_kv_heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    scale = head_dim ** -0.5

    def cache(num_blocks: int):
        return [torch.randn(num_kv_heads, num_blocks, block_size, head_dim, device=device).to(dtype)
                for _ in range(4)]  # (k, v) of two layers

    def batch(lens: list[int], new: list[int]):
        """Block tables, seq_lens and query_start_loc for sequences of `lens` keys, `new` of them new."""
        per = -(-max(lens) // block_size)
        tables = torch.arange(len(lens) * per, dtype=torch.int32, device=device).view(len(lens), per)
        starts = torch.tensor([0] + new, dtype=torch.int32).cumsum(0).to(torch.int32)
        return tables, torch.tensor(lens, dtype=torch.int32, device=device), starts.to(device), starts.tolist()

    def decodes(lens: list[int]):
        tables, seq_lens, qsl, _ = batch(lens, [1] * len(lens))
        caches = cache(tables.numel())
        q = torch.randn(len(lens), num_heads, head_dim, device=device).to(dtype)
        out = torch.empty_like(q)
        splits = decode_splits(len(lens), num_kv_heads, sms)
        partials = torch.empty(len(lens) * num_heads * splits * (head_dim + 2), dtype=torch.float32, device=device)
        tickets = torch.zeros(len(lens) * num_kv_heads, dtype=torch.int32, device=device)
        return lambda t, join=True: ([paged_attention(q, caches[2 * i], caches[2 * i + 1], tables, seq_lens, qsl,
                                                      scale, out=out, decode=True, num_seqs=len(lens), splits=splits,
                                                      partials=partials, launch=t, tickets=tickets if join else None)
                                      for i in range(2)], out)[1]

    many, one = decodes([640] * 64), decodes([1024])
    decode, decode_times = fastest(tilings(True, group, head_dim), lambda t: (many(t), one(t)), timer)
    join = joins_as_two_launches((many, one), decode) if checked else True
    join_splits, join_times = SPLIT_CHOICES[-1], {}
    if join:
        join_splits, join_times = choose_join([(decode_splits(64, num_kv_heads, sms), many),
                                               (decode_splits(1, num_kv_heads, sms), one)], decode, timer)
    n = 2048
    tables, seq_lens, qsl, host_qsl = batch([n], [n])
    caches = cache(tables.numel())
    q = torch.randn(n, num_heads, head_dim, device=device).to(dtype)
    out = torch.empty_like(q)
    tiles = {t: tuple(torch.tensor(a, dtype=torch.int32, device=device) for a in query_tiles(host_qsl, t.block_q))
             for t in tilings(False, group, head_dim)}
    prefill, prefill_times = fastest(
        tiles, lambda t: [paged_attention(q, caches[2 * i], caches[2 * i + 1], tables, seq_lens, qsl, scale, out=out,
                                          decode=False, num_seqs=1, tiles=tiles[t], launch=t) for i in range(2)],
        timer)
    return Tilings(decode, prefill, join, join_splits), {"decode": {str(t): s for t, s in decode_times.items()},
                                                         "prefill": {str(t): s for t, s in prefill_times.items()},
                                                         "join": join_times}


def choose_join(runs: list, tiling: Tiling, timer) -> tuple[int, dict]:
    """Up to how many key splits a decode joins them in its own launch: `runs` holds (split count,
    ``run(tiling, join)``) pairs (decodes of that many splits: 64 sequences take few, one takes
    many), each timed both ways with `timer` (runs of one count together). The join in the launch
    saves the second launch, but its last program joins every split of its heads alone, serially:
    with many splits that tail can outlast the launch it saves. Returns (the most splits whose
    join timed no slower in the launch: `SPLIT_CHOICES`' last when every count did, 0 when the
    fewest splits' did not; a count of 1 has nothing to join), and ``{"N splits": {"own launch":
    s, "second launch": s}}``."""
    times, most = {}, SPLIT_CHOICES[-1]
    counts = sorted({s for s, _ in runs if s > 1})
    for splits in counts:
        group = [run for s, run in runs if s == splits]
        own = timer(lambda: [run(tiling, True) for run in group])
        second = timer(lambda: [run(tiling, False) for run in group])
        times[f"{splits} splits"] = {"own launch": own, "second launch": second}
        if own > second and most == SPLIT_CHOICES[-1]:  # (the first count past which the join costs)
            most = max([s for s in counts if s < splits], default=0)
    return most, times


def joins_as_two_launches(runs, tiling: Tiling, times: int = 10) -> bool:
    """Whether each ``run(tiling, join) -> out`` of `runs` (decodes with their key splits) gives
    its two launches' values when its splits are joined in its own launch (`_join_last`), `times`
    times over: finite, within a bf16 step of the largest. A race in the join (a partial read
    before its split stored it) would show here, on this device, before any request; then the
    engine joins in a second launch (`Tilings.join`)."""
    for _ in range(times):
        for run in runs:
            joined = run(tiling, True).float()
            two = run(tiling, False).float()
            if not bool(torch.isfinite(joined).all()) or \
                    float((joined - two).abs().max()) > 2.0**-7 * float(two.abs().max()):
                return False
    return True


def query_tiles(query_start_loc: list[int], block_q: int, first: int = 0) -> tuple[list[int], list[int]]:
    """The query tiles of sequences ``first ..``: for each tile, (its sequence, its first query
    among the sequence's new tokens), `block_q` queries per tile. query_start_loc: the batch's
    ``[num_seqs + 1]`` offsets (host integers)."""
    seqs, firsts = [], []
    for i in range(first, len(query_start_loc) - 1):
        n = query_start_loc[i + 1] - query_start_loc[i]
        for q0 in range(0, n, block_q):
            seqs.append(i)
            firsts.append(q0)
    return seqs, firsts


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Key splits per decode: enough programs for two per multiprocessor, rounded up to one of
    `SPLIT_CHOICES` (at most its last); 1 when the batch alone fills the GPU."""
    want = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    return next((s for s in SPLIT_CHOICES if s >= want), SPLIT_CHOICES[-1])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *, out: torch.Tensor,
                    decode: bool, num_seqs: int, tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
                    splits: int = 1, partials: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    aligned: bool = False, launch: Tiling | None = None,
                    tickets: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the queries of `num_seqs` sequences over their paged keys; writes `out`.

    q ``[T, H, D]`` (bf16 or float32; D a power of two >= 16); k_cache, v_cache ``[Hkv,
    num_blocks, block_size, D]`` in q's dtype, or int8 codes with `k_scales`, `v_scales`
    ``[Hkv, num_blocks, block_size]`` float32; block_tables int32 ``[>= num_seqs, max_blocks]``;
    seq_lens int32 ``[>= num_seqs]`` (keys of each sequence, its new tokens included: its new
    tokens sit at positions ``seq_len - q_len ..``); query_start_loc int32 ``[>= num_seqs + 1]``
    (each sequence's rows of q). out ``[T, H, D]``: each sequence's rows are written.

    decode: every sequence has one query; one program per (sequence, KV head, split), `splits`
    of them (a power of two) over the keys, joined through `partials` (float32 ``[num_seqs * H
    * splits * (D + 2)]``): with `tickets` (int32, at least ``num_seqs * Hkv`` zeros, which each
    launch leaves at zero) the last split of each (decode, KV head) to finish joins them in this
    launch, else a second launch does (`_combine_kernel`). Otherwise `tiles`: (sequence, first
    query) int32 ``[P]`` each (`query_tiles` with the prefill `tiling`'s block_q). window: a sliding window (0: none);
    softcap: soft-capping of the scores (0: none); k_new, v_new ``[T, Hkv, D]``: keys from each
    sequence's first new token on come from these rows (a sliding-window ring read before
    this pass writes it); aligned (with k_new, not with an int8 cache): the switch from the
    cache's keys to the pass's falls on a key tile's boundary, the tile that holds the first new
    token reading both, so a query's key tiles do not depend on where its chunk starts (the
    batch-invariant plan's); launch: the tiles (default `tiling`'s; a prefill's `tiles` are made
    with its block_q). Shapes are the caller's to get right: the kernel does not check them.
    Returns `out`."""
    hkv, _, block_size, d = k_cache.shape
    h = q.shape[1]
    group = h // hkv
    f32 = q.dtype == torch.float32
    int8 = k_scales is not None
    fresh = k_new is not None
    aligned = aligned and fresh and not int8 and not decode
    t = launch or tiling(decode, group, d, f32)
    if not decode:
        splits = 1
    grid = (num_seqs if decode else tiles[0].shape[0], hkv, splits)
    if grid[0] == 0:
        return out
    ks, vs = (k_scales, v_scales) if int8 else (q, q)  # (unused pointers when the cache is not int8)
    if fresh and k_new.stride() != v_new.stride():  # the kernel steps both by k_new's strides (a second pair
        k_new, v_new = k_new.contiguous(), v_new.contiguous()  # spills the 256-dim fresh tiles); a fused q/k/v
        # product leaves v a strided view: a copy of a sliding-window prefill chunk's values
    kn, vn = (k_new, v_new) if fresh else (q, q)
    qb_seq, qb_first = tiles if tiles is not None else (seq_lens, seq_lens)
    part = partials if splits > 1 else out
    join = splits > 1 and tickets is not None and tickets.numel() >= num_seqs * hkv
    _attention_kernel[grid](
        out, part, tickets if join else seq_lens, q, k_cache, v_cache, ks, vs, kn, vn, block_tables, seq_lens,
        query_start_loc, qb_seq, qb_first,
        scale, softcap, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0,
        kn.stride(0) if fresh else 0, kn.stride(1) if fresh else 0, block_tables.stride(0), h,
        GROUP=group, BLOCK_Q=t.block_q, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HEAD_DIM=d, BLOCK_SIZE=block_size,
        DECODE=decode, SPLITS=splits, INT8=int8, FRESH=fresh, SOFTCAP=softcap > 0, WINDOW=window > 0,
        WIDEN=INTERPRET, ALIGNED=aligned, JOIN=join, num_warps=t.num_warps, num_stages=t.num_stages)
    if splits > 1 and not join:
        _combine_kernel[(num_seqs, h)](out, partials, query_start_loc, out.stride(0), out.stride(1), h,
                                       SPLITS=splits, HEAD_DIM=d, num_warps=4)
    return out
