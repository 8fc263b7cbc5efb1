"""Causal self-attention over the paged KV cache, for a batch of sequences of different lengths.

``softmax(q k^T / sqrt(d) + causal_mask) v`` (Vaswani et al. 2017), query heads grouped over
shared key/value heads (GQA; Ainslie et al. 2023). One forward pass carries several sequences:
single-token decodes and prefill chunks, flattened into ``[num_tokens, ...]`` and described by
`AttentionMetadata`. A sequence's keys and values are read from its blocks (its block table).

The backends compute the same function, and the tests hold them equal:
- `paged_attention_reference`: gather each sequence's blocks, naive masked attention in
  float32; also returns the probabilities (for `nextoken explain`).
- `paged_attention`: decodes batched as grouped matmuls over padded gathered keys (or our C
  kernel); prefill chunks through `prefill_attention`, blocked causal matmuls.
- ``triton`` (a GPU's): our Triton kernel reading the cache in place (`layers.gpu_attention`).
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nextoken.kernels import KernelSet, bf16_matmul_native, count_fallback
from nextoken.kv_cache.tensors import Int8Rows, dequantize_rows

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class Ablation:
    """Zero-ablation of one component in a traced pass (the inspector's interventions): `kind`
    "head" (query head `head`'s attention output, before the output projection), "attention"
    (every head's output, before the output projection: a projection's bias stays) or "mlp" (the
    feed-forward's output: the layer adds nothing after its attention), in layer `layer`. A
    traced request runs in a pass of its own, so no other request sees it; the tracer carries it
    (``tracer.ablation``), the model's forward hands it to the metadata."""

    KINDS = ("head", "attention", "mlp")

    def __init__(self, layer: int, kind: str, head: int = 0):
        if kind not in self.KINDS:
            raise ValueError(f"ablation kind {kind!r}: expected one of {', '.join(self.KINDS)}")
        self.layer, self.kind, self.head = layer, kind, head

    def attention(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        """`layer`'s attention output ``[T, H, D]`` with the ablated part zeroed."""
        if layer != self.layer or self.kind == "mlp":
            return out
        if self.kind == "attention":
            return torch.zeros_like(out)
        out = out.clone()
        out[:, self.head] = 0
        return out

    def drops_mlp(self, layer: int) -> bool:
        return self.kind == "mlp" and layer == self.layer


@dataclass(slots=True)
class AttentionMetadata:
    """The layout of one batched forward pass.

    Sequences are ordered decodes (one new token) first, then prefill chunks. For sequence i:
    its new tokens are ``[query_start_loc[i], query_start_loc[i+1])`` of the flat batch, it has
    ``seq_lens[i]`` tokens in all once they are written (so its new tokens sit at positions
    ``seq_lens[i] - q_len .. seq_lens[i] - 1``), and ``block_tables[i]`` lists its blocks.

    slot_mapping: int64 ``[num_tokens]``, where each new token's key/value is written;
    block_tables: int64 ``[num_seqs, max_blocks]`` (padded with 0);
    num_decodes: how many leading sequences have exactly one new token.
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    num_decodes: int
    block_size: int
    backend: str = "torch"  # the execution plan's attention: "reference" | "native" | "torch" | "triton"
    kernels: KernelSet = KernelSet()  # with "native": the attention libraries the plan resolved
    # tracing: a list (the sink) makes every layer run the reference attention and leave its
    # per-sequence probabilities ``[H, q_len, seq_len]`` here, for the tracer; None: the usual paths
    probs: list | None = None
    # tracing: a list (the sink) where each layer leaves its residual stream after the attention's
    # residual add, before the feed-forward ``[T, hidden]``; None: nothing is kept
    mid: list | None = None
    first_block: list[int | None] | None = None  # per sequence: its first block if its blocks are consecutive
    sliding: object | None = None  # `sliding_attention.SlidingMetadata`, for models with sliding-window layers
    device: object | None = None  # with "triton": `gpu_attention.DeviceMetadata`, what the kernel reads
    ablation: Ablation | None = None  # a traced pass's zero-ablation (the inspector's interventions)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass(slots=True)
class KVStore:
    """Where a layer's RoPE kernel writes the pass's keys and values itself (a GPU plan's
    `kernels.gpu.rowwise.apply_rope_qk`, one launch fewer than `attend`'s own write): the
    layer's paged cache k_cache, v_cache ``[Hkv, num_blocks, block_size, D]``, the pass's
    slot_mapping int64 ``[T]`` and the values v ``[T, Hkv, D]``; the kernel sets `written`."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    v: torch.Tensor
    written: bool = False


def kv_store(kv, layer: int, meta: AttentionMetadata, sliding: bool, v: torch.Tensor) -> KVStore | None:
    """This layer's `KVStore` when its RoPE kernel may write the cache: a pass on the Triton
    attention, untraced, on a full-attention layer of an unquantized cache (`attend_triton` would
    write it first thing, as ``kv.write``); None otherwise."""
    if meta.backend != "triton" or meta.probs is not None or meta.ablation is not None or sliding or kv.quantized:
        return None
    i = kv.layer_index[layer]
    return KVStore(kv.k[i], kv.v[i], meta.slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """One sequence's keys (or values) ``[kv_heads, seq_len, head_dim]`` from its blocks.
    cache: ``[kv_heads, num_blocks, block_size, head_dim]`` (one layer)."""
    n_blocks = -(-seq_len // block_size)
    return gather_blocks(cache, block_table[:n_blocks]).flatten(1, 2)[:, :seq_len]


def gather_blocks(cache, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy blocks out of one layer's cache ``[Hkv, num_blocks, block_size, D]`` (a tensor, or
    `Int8Rows`, then dequantized to its dtype): block_ids of any shape ``[...]`` ->
    ``[Hkv, ..., block_size, D]``. (``index_select`` over rows of ``block_size * D`` copies whole
    rows; plain advanced indexing is slower.)"""
    heads, num_blocks, bs, d = cache.shape
    if isinstance(cache, Int8Rows):
        codes = gather_blocks(cache.codes, block_ids)
        scales = torch.index_select(cache.scales, 1, block_ids.flatten()).view(heads, *block_ids.shape, bs)
        return dequantize_rows(codes, scales, cache.dtype)
    rows = torch.index_select(cache.view(heads, num_blocks, bs * d), 1, block_ids.flatten())
    return rows.view(heads, *block_ids.shape, bs, d)


def causal_mask(q_len: int, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """bool ``[q_len, seq_len]`` on `device` (default the CPU): new token i (position seq_len -
    q_len + i) sees keys j <= it."""
    start = seq_len - q_len
    return torch.arange(seq_len, device=device)[None, :] <= torch.arange(start, seq_len, device=device)[:, None]


def naive_attention(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention in float32 for one sequence. q ``[T, H, D]``; k, v ``[Hkv, S, D]``.
    Returns output ``[T, H, D]`` (q's dtype) and probabilities ``[H, T, S]``."""
    group = q.shape[1] // k.shape[0]
    kf = k.float().repeat_interleave(group, dim=0)  # [H, S, D]
    vf = v.float().repeat_interleave(group, dim=0)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale  # [H, T, S]
    scores = scores.masked_fill(~causal_mask(q.shape[0], k.shape[1], q.device), float("-inf"))
    probs = scores.softmax(-1)
    return (probs @ vf).transpose(0, 1).to(q.dtype), probs


def paged_attention_reference(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                              sink: list | None = None) -> torch.Tensor:
    """q ``[num_tokens, H, D]``; caches ``[Hkv, num_blocks, block_size, D]`` (this layer;
    tensors or `Int8Rows`, dequantized as gathered). Returns the output ``[num_tokens, H, D]``;
    each sequence's probabilities ``[H, q_len, seq_len]`` go to `sink` when it is a list."""
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        k = gather_kv(k_cache, meta.block_tables[i], meta.seq_lens[i], meta.block_size)
        v = gather_kv(v_cache, meta.block_tables[i], meta.seq_lens[i], meta.block_size)
        out[a:b], probs = naive_attention(q[a:b], k, v, scale)
        if sink is not None:
            sink.append(probs)
    return out


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The fast path; same arguments and output as `paged_attention_reference`."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale)
    for i in range(nd, meta.num_seqs):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens[i]
        k = gather_kv(k_cache, meta.block_tables[i], seq_len, meta.block_size)  # [Hkv, S, D]
        v = gather_kv(v_cache, meta.block_tables[i], seq_len, meta.block_size)
        out[a:b] = prefill_attention(q[a:b], k, v, scale, meta.kernels.prefill_scores)
    return out


PREFILL_BLOCK = 128  # query rows per block of `prefill_attention` (fewer after many keys)
SCORES_BUDGET = 8 << 20  # bytes of float32 scores per block (kept in cache): caps the rows


def prefill_block_rows(heads: int, keys: int) -> int:
    """Query rows per block of `prefill_attention` for `heads` query heads after `keys` keys:
    `PREFILL_BLOCK`, fewer where one block's float32 scores would pass `SCORES_BUDGET`, at least
    16 (Qwen2.5-1.5B's 12 heads: 128 rows up to 1365 keys, 37 at 4608, 20 at 8704): scores
    that stay in the caches between the kernel that writes them and the softmax that reads them
    (`benchmarks/profile_prefill.py --depth N` measures it)."""
    return max(16, min(PREFILL_BLOCK, SCORES_BUDGET // (4 * heads * max(keys, 1))))


class _Scratch(threading.local):
    """Buffers kept across calls, one set per thread. Allocating a block's scores (tens of MB
    after thousands of keys) on every call maps fresh pages each time (glibc maps requests above
    its threshold, at most 32 MiB, and unmaps them on free), and faulting those pages in cost
    more than computing the scores (`benchmarks/profile_prefill.py --depth N` shows it). The
    buffers stay allocated:
    `SCORES_BUDGET` of scores and half that of probabilities (more only past the 16-row floor,
    e.g. 25 MB of scores for Qwen2.5-1.5B after 32768 keys)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` (uninitialized) on buffer `name`, grown as needed;
        valid until the next `take` of the same name on this thread."""
        n = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = self.buffers[name] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)


_scratch = _Scratch()


def prefill_attention(q, k, v, scale: float, kernel=None) -> torch.Tensor:
    """Causal attention of one prefill chunk: q ``[T, H, D]`` (positions ``S - T .. S - 1``)
    against k, v ``[Hkv, S, D]``; returns ``[T, H, D]``.

    Blocks of `prefill_block_rows` queries, each against only the keys up to its last position (so
    the masked half of the causal square is skipped, not computed), and only the block's own
    diagonal square is masked. A KV head's `group` query heads are stacked as one
    ``[group * rows, D]`` matrix, so GQA needs no copy of the keys. The scores ``scale (q k^T)``
    are float32 (as fused kernels keep them: bf16 scores would round logits of 10 by 0.02).
    Softmax in float32; the probabilities are rounded to v's dtype for ``p v``, a batched
    matmul on the matrix units in bf16 (in float32, unrounded, on a CPU without bf16 matrix
    instructions: `kernels.bf16_matmul_native`). With `kernel` (the ``prefill_scores`` library the plan
    resolved: CPUs with AVX512-BF16) and bf16 inputs of an even head size, our C kernels
    (``kernels/prefill_scores.c``) compute the scores (exact bf16 products, float32 sums, at the
    bf16 dot-product rate) and the masked softmax straight into bf16 probabilities; otherwise a
    float32 batched matmul and PyTorch's softmax, the reference (with a `kernel` given, a counted
    fallback). `naive_attention` is the reference; ``benchmarks/`` holds the timings.
    """
    t, h, d = q.shape
    hkv, s, _ = k.shape
    group = h // hkv
    start = s - t
    packed = None
    if kernel is not None:
        if q.dtype == k.dtype == v.dtype == torch.bfloat16 and d % 2 == 0:
            packed = _packed_keys(k, kernel)
        else:
            count_fallback("prefill attention scores")
    if packed is not None:
        qg = q.view(t, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, group, T, D], bf16, scaled in the kernel
    else:
        qg = (q.float() * scale).view(t, hkv, group, d).permute(1, 2, 0, 3)
        kf = k.float()
    if v.dtype == torch.bfloat16 and not bf16_matmul_native():  # p v in float32: bf16 bmm is emulated here
        v = v.float()
    out = torch.empty(hkv, group, t, d, dtype=q.dtype)
    block = prefill_block_rows(h, s)
    for r0 in range(0, t, block):
        r1 = min(t, r0 + block)
        n, keys = r1 - r0, start + r1  # the block's last query sees keys 0 .. keys - 1
        rows = qg[:, :, r0:r1].reshape(hkv, group * n, d)
        if packed is not None:
            scores = _native_scores(kernel, rows.contiguous(), packed, s, keys, scale)
            probs = _native_softmax(kernel, scores, group, n)
        else:
            scores = torch.bmm(rows, kf[:, :keys].transpose(1, 2)).view(hkv, group, n, keys)
            scores[..., keys - n :].masked_fill_(~causal_mask(n, n), float("-inf"))  # the diagonal square
            probs = scores.softmax(-1).to(v.dtype).view(hkv, group * n, keys)
        out[:, :, r0:r1] = torch.bmm(probs.to(v.dtype), v[:, :keys]).view(hkv, group, n, d)  # (the kernel's: bf16)
    return out.permute(2, 0, 1, 3).reshape(t, h, d)


def _packed_keys(k: torch.Tensor, lib) -> torch.Tensor:
    """k ``[Hkv, S, D]`` bf16 (D even) as the scores kernel `lib` reads it (``[Hkv, ceil(S / 64),
    D / 2, 64]``: tiles of 64 keys, each word a pair of dims)."""
    k = k.contiguous()
    hkv, s, d = k.shape
    packed = torch.empty(hkv, -(-s // 64), d // 2, 64, dtype=torch.int32)
    lib.prefill_pack_keys(_PTR(k.data_ptr()), _I64(hkv), _I64(s), _I64(d), _PTR(packed.data_ptr()))
    return packed


def _native_scores(lib, rows: torch.Tensor, packed: torch.Tensor, s: int, keys: int, scale: float) -> torch.Tensor:
    """``scale rows k^T`` float32 ``[Hkv, R, keys]`` from bf16 rows ``[Hkv, R, D]`` (contiguous),
    on this thread's scratch buffer (valid until the next call)."""
    hkv, r, d = rows.shape
    out = _scratch.take("scores", (hkv, r, keys), torch.float32)
    rc = lib.prefill_scores(_PTR(rows.data_ptr()), _PTR(packed.data_ptr()), _I64(hkv), _I64(r),
                                               _I64(s), _I64(d), _I64(keys), ctypes.c_float(scale),
                                               _PTR(out.data_ptr()))
    if rc:
        raise RuntimeError(f"prefill scores kernel refused its shapes (rc {rc})")
    return out


def _native_softmax(lib, scores: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """Causal softmax of float32 scores ``[Hkv, group * n, keys]`` (overwritten) of a block of
    `n` queries whose last one sees every key -> bf16 probabilities of the same shape, on this
    thread's scratch buffer (valid until the next call)."""
    hkv, r, keys = scores.shape
    probs = _scratch.take("probs", (hkv, r, keys), torch.bfloat16)
    rc = lib.prefill_softmax(_PTR(scores.data_ptr()), _I64(hkv), _I64(group), _I64(n), _I64(keys),
                                                _PTR(probs.data_ptr()))
    if rc:
        raise RuntimeError(f"prefill softmax kernel refused its shapes (rc {rc})")
    return probs


DECODE_CHUNK = 16  # decodes gathered together; sorted by length so each chunk pads little


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """All single-token sequences, in chunks of similar length. q: ``[B, H, D]`` -> ``[B, H, D]``."""
    nd = q.shape[0]
    lib = meta.kernels.paged_attention
    if meta.backend == "native" and lib is not None:
        native = native_decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                         lib=lib)
        if native is not None:
            return native
        count_fallback("paged decode attention")
    if nd == 1:
        return _lone_decode(q, k_cache, v_cache, meta, scale)
    seq_lens = torch.tensor(meta.seq_lens[:nd])
    if nd <= DECODE_CHUNK:
        return _decode_chunk(q, k_cache, v_cache, meta.block_tables[:nd], seq_lens, meta.block_size, scale)
    order = torch.argsort(seq_lens)
    out = torch.empty_like(q)
    for idx in order.split(DECODE_CHUNK):
        out[idx] = _decode_chunk(q[idx], k_cache, v_cache, meta.block_tables[idx], seq_lens[idx],
                                 meta.block_size, scale)
    return out


_NATIVE_FN = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def _native_window_decodes(q, k_ring, v_ring, meta: AttentionMetadata, scale: float) -> torch.Tensor | None:
    """Sliding-window decodes by our paged decode kernel (as the one-call C decode step reads
    them): each sequence's ring as a block table (`SlidingMetadata.ring_tables`) from its
    window's first key. q ``[nd, H, D]`` -> ``[nd, H, D]``, or None when the plan gave no kernel
    or it does not take these shapes."""
    lib, nd = meta.kernels.paged_attention, q.shape[0]
    if meta.backend != "native" or lib is None:
        return None
    sm = meta.sliding
    return native_decode_attention(q, k_ring, v_ring, sm.ring_tables[:nd], meta.seq_lens[:nd], scale, lib=lib,
                                   starts=sm.key_start[:nd])


def native_decode_supports(dtype: torch.dtype, head_dim: int, group: int, int8_cache: bool = False) -> bool:
    """Whether the C decode attention takes a model of these shapes (the execution plan asks at
    load): float32 or bf16 queries (bf16 with an int8 cache), head_dim <= 256, <= 64 query heads
    per KV head."""
    return dtype in _NATIVE_FN and (not int8_cache or dtype == torch.bfloat16) and head_dim <= 256 and group <= 64


def native_decode_attention(q, k_cache, v_cache, block_tables, seq_lens: list[int], scale: float, *, lib,
                            starts: list[int] | None = None):
    """Decode attention by our C kernel (``nextoken/kernels/paged_attention.c``), reading every
    sequence's keys and values in place through its block table: no gather copy, no padding.
    Same arguments as `_decode_chunk` (seq_lens a list; the caches tensors in q's dtype, or
    `Int8Rows` with bf16 q); returns ``[B, H, D]``, or None when the kernel is unavailable or
    does not cover these shapes (`native_decode_supports`, which the plan checks at load; the
    caller then runs PyTorch). `lib`: the ``paged_attention`` library the plan resolved (tests
    load one themselves: `kernels.load`); None: no kernel, None returned. `starts`: the
    position of each sequence's first key (a sliding window; default 0)."""
    int8 = isinstance(k_cache, Int8Rows)
    caches = (k_cache.codes, v_cache.codes, k_cache.scales, v_cache.scales) if int8 else (k_cache, v_cache)
    if not native_decode_supports(q.dtype, q.shape[2], q.shape[1] // k_cache.shape[0], int8) or \
            (not int8 and k_cache.dtype != q.dtype) or not all(c.is_contiguous() for c in caches):
        return None
    if lib is None:
        return None
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    first = torch.tensor(starts, dtype=torch.int64) if starts is not None else None
    out = torch.empty_like(q)
    hkv, nb, bs, d = k_cache.shape
    head = [_PTR(q.data_ptr()), *(_PTR(c.data_ptr()) for c in caches)]  # q, k, v (, k scales, v scales)
    fn = getattr(lib, "paged_decode_int8" if int8 else _NATIVE_FN[q.dtype])
    failed = fn(*head, _PTR(tables.data_ptr()), _I64(tables.shape[1]), _PTR(lens.data_ptr()),
                _PTR(first.data_ptr() if first is not None else None), _I64(q.shape[0]),
                _I64(q.shape[1]), _I64(hkv), _I64(d), _I64(nb), _I64(bs), ctypes.c_float(scale), _PTR(out.data_ptr()))
    if failed:
        raise MemoryError("paged attention kernel could not allocate its score buffer")
    return out


def _lone_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One single-token sequence (single-stream decode): one fused SDPA call, with the query heads
    that share a KV head laid out as that head's queries (``[1, Hkv, group, D]``), so GQA needs
    neither a copy of the keys nor a mask (the new token sees every key). When the sequence's
    blocks are consecutive (the usual case for one stream) its keys are a view of the cache, not
    a copy; several times faster than the batched path for one sequence."""
    seq_len = meta.seq_lens[0]
    start = meta.first_block[0] if meta.first_block else None
    if start is not None and not isinstance(k_cache, Int8Rows):
        n_blocks = -(-seq_len // meta.block_size)
        k = k_cache[:, start : start + n_blocks].flatten(1, 2)[:, :seq_len]  # [Hkv, S, D], a view
        v = v_cache[:, start : start + n_blocks].flatten(1, 2)[:, :seq_len]
    else:
        k = gather_kv(k_cache, meta.block_tables[0], seq_len, meta.block_size)
        v = gather_kv(v_cache, meta.block_tables[0], seq_len, meta.block_size)
    _, num_heads, head_dim = q.shape
    num_kv = k.shape[0]
    qg = q.view(1, num_kv, num_heads // num_kv, head_dim)
    out = F.scaled_dot_product_attention(qg, k[None], v[None], scale=scale)  # [1, Hkv, G, D]
    return out.reshape(1, num_heads, head_dim)


def _decode_chunk(q, k_cache, v_cache, tables, seq_lens, block_size: int, scale: float) -> torch.Tensor:
    """Single-token sequences as two batched matmuls per KV head.

    One gather copies the chunk's blocks into ``[Hkv, B, S_max, D]`` (S_max: its longest
    sequence; shorter ones are padded and masked), already the layout the matmuls want. The
    query heads that share a KV head are stacked (``[Hkv, B, group, D]``), so GQA needs no copy
    of the keys. Softmax in float32. (PyTorch's fused CPU kernel is several times slower for
    one query token.) q: ``[B, H, D]``; tables ``[B, >= blocks]``; seq_lens ``[B]``.
    """
    nd, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[0]
    n_blocks = -(-int(seq_lens.max()) // block_size)
    tables = tables[:, :n_blocks]  # [B, nb]
    k = gather_blocks(k_cache, tables).flatten(2, 3)  # [Hkv, B, S, D]
    v = gather_blocks(v_cache, tables).flatten(2, 3)
    qg = q.view(nd, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    scores = (qg @ k.transpose(2, 3)).float() * scale  # [Hkv, B, G, S]
    pad = torch.arange(k.shape[2])[None, :] >= seq_lens[:, None]  # [B, S]
    scores.masked_fill_(pad[None, :, None, :], float("-inf"))
    out = scores.softmax(-1).to(v.dtype) @ v  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(nd, num_heads, head_dim)


def attend(q, k, v, kv, layer: int, meta: AttentionMetadata, scale: float, sliding: bool = False,
           stored: bool = False) -> torch.Tensor:
    """One layer's attention step, whatever its kind: q ``[T, H, D]``, k, v ``[T, Hkv, D]`` ->
    output ``[T, H, D]``.

    A full-attention layer writes k, v into the paged cache `kv` (`kv_cache.tensors.PagedKVCache`;
    not when `stored`: the RoPE kernel wrote them, `KVStore`) and attends over each sequence's
    blocks (an int8 cache's keys and the queries rotated first, `PagedKVCache.queries`); a
    `sliding` layer does both over the sequence's ring (`sliding_attention`). The reference path
    (and tracing) use plain float32 attention; while tracing, the probabilities go to the
    metadata's sink (`AttentionMetadata.probs`)."""
    from nextoken.layers.sliding_attention import sliding_window_attention

    if meta.ablation is not None:  # (a traced pass: the plain attention, then the ablated part zeroed)
        ablation, meta.ablation = meta.ablation, None
        try:
            return ablation.attention(attend(q, k, v, kv, layer, meta, scale, sliding), layer)
        finally:
            meta.ablation = ablation
    reference = meta.backend == "reference" or meta.probs is not None
    if not sliding:
        q = kv.queries(q)  # (rotated as an int8 cache's keys are: `PagedKVCache.queries`)
    if meta.backend == "triton" and not reference:
        from nextoken.layers.gpu_attention import attend_triton

        return attend_triton(q, k, v, kv, layer, meta, scale, sliding, stored)
    if sliding:
        i = kv.sliding.layer_index[layer]
        return sliding_window_attention(q, k, v, kv.sliding.k[i], kv.sliding.v[i], meta, scale, reference,
                                        meta.probs, _native_window_decodes)
    i = kv.layer_index[layer]
    kv.write(i, meta.slot_mapping, k, v)
    k_cache, v_cache = kv.layer(i)
    if reference:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, meta.probs)
    return paged_attention(q, k_cache, v_cache, meta, scale)
