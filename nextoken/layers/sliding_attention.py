"""Sliding-window causal attention (Beltagy et al. 2020, "Longformer"; Gemma 3's local layers)
over a per-sequence ring of KV blocks.

New token at position p sees the keys at positions ``max(0, p - window + 1) .. p`` (the rule of
`transformers`' ``sliding_window_overlay``: ``kv_idx > q_idx - window``). Such a layer keeps only
that many keys per sequence: position p lives in ring block ``(p // block_size) % ring_blocks``
(`kv_cache.tensors.SlidingKVCache`), but for the pass's blocks outside the ring
(`kv_cache.manager.Ring`). `SlidingMetadata` (built once per pass by the model runner)
says which slots each sequence reads and which of the pass's new keys are written.

Order within a layer: prefill chunks first read their earlier keys from the ring, then every
written key goes in, then decodes read their window (which may include keys written in this very
pass: speculative decoding's verification rows of one sequence see each other's keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class SlidingMetadata:
    """window: keys a token sees (itself included); write_rows / write_slots: int64 ``[W]``,
    rows of the flat batch whose keys and values go into the ring, and where; key_slots[i]:
    int64 ring slots read by sequence i (a decode: its whole window, after this pass's writes;
    a prefill chunk: the keys before its first new token, before the writes); key_start[i]:
    the position of sequence i's first key read (or of its first new token if none);
    ring_tables: int64 ``[num_seqs, logical blocks]``, logical block b of sequence i -> its ring
    block (what the one-call C decode step reads, `layers.native_decode`)."""

    window: int
    write_rows: torch.Tensor
    write_slots: torch.Tensor
    key_slots: list[torch.Tensor]
    key_start: list[int]
    ring_tables: torch.Tensor


def build_sliding_metadata(window: int, block_size: int, ring_blocks: int,
                           seqs: list[tuple[int, int, list[int], dict[int, int] | None]]) -> SlidingMetadata:
    """seqs: per sequence in batch order, (position of its first new token, number of new
    tokens, its ring block ids: logical block b lives in ``ring[b % ring_blocks]``, but for the
    logical blocks in `off_ring` (logical block -> block id, or None; see
    `kv_cache.manager.Ring`)). A pass writes the keys of its last ``ring_blocks * block_size``
    tokens (older ones would collide in the ring) and those of its blocks in `off_ring`. The
    tensors are on the CPU (computed with NumPy: a few operations per sequence)."""
    write_rows, write_slots, key_slots, key_start, rings = [], [], [], [], []
    row = 0
    logical = np.arange(max(-(-(start + n) // block_size) for start, n, _, _ in seqs), dtype=np.int64)
    for start, n, ring, off_ring in seqs:
        table = np.asarray(ring, dtype=np.int64)[np.minimum(logical % ring_blocks, len(ring) - 1)] \
            if ring else np.zeros_like(logical)
        if off_ring:
            table[list(off_ring)] = list(off_ring.values())
        rings.append(table)

        def slots(pos: np.ndarray) -> np.ndarray:
            return table[pos // block_size] * block_size + pos % block_size

        pos = np.arange(start, start + n, dtype=np.int64)
        written = pos >= start + n - ring_blocks * block_size
        if off_ring:
            written |= np.isin(pos // block_size, list(off_ring))
        write_rows.append(row + np.flatnonzero(written))
        write_slots.append(slots(pos[written]))
        lo = max(0, start - window + 1)
        # a decode: its window, read after the writes; a prefill chunk: the keys before it, read before
        key_slots.append(torch.from_numpy(slots(np.arange(lo, start + 1 if n == 1 else start, dtype=np.int64))))
        key_start.append(lo)
        row += n
    return SlidingMetadata(window, torch.from_numpy(np.concatenate(write_rows)),
                           torch.from_numpy(np.concatenate(write_slots)), key_slots, key_start,
                           torch.from_numpy(np.stack(rings)))


def sliding_mask(q_start: int, q_len: int, k_start: int, k_len: int, window: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """bool ``[q_len, k_len]`` on `device` (default the CPU): query at position q sees key at
    position k iff ``q - window < k <= q``."""
    q = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    k = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    return (k <= q) & (k > q - window)


def sliding_window_attention(q, k, v, k_ring, v_ring, meta, scale: float, reference: bool = False,
                             sink: list | None = None, decode=None):
    """q ``[T, H, D]``, this pass's k, v ``[T, Hkv, D]``; rings ``[Hkv, num_blocks, block_size,
    D]`` (this layer). Writes the new keys and values into the rings. Returns the output
    ``[T, H, D]``; with `reference` (plain float32 attention instead of the fused kernel) and a
    `sink` list, each sequence's probabilities ``[H, q_len, seq_len]`` (zero outside the window)
    go to the sink. `decode(q_decodes, k_ring, v_ring, meta, scale)`: the decodes' windows after
    the writes in one call (``[nd, H, D]``, or None: SDPA runs them), when given."""
    sm: SlidingMetadata = meta.sliding
    heads, nb, bs, d = k_ring.shape
    k_flat, v_flat = k_ring.view(heads, nb * bs, d), v_ring.view(heads, nb * bs, d)
    nd = meta.num_decodes
    past = {i: (k_flat.index_select(1, sm.key_slots[i]), v_flat.index_select(1, sm.key_slots[i]))
            for i in range(nd, meta.num_seqs)}
    k_flat.index_copy_(1, sm.write_slots, k[sm.write_rows].transpose(0, 1))
    v_flat.index_copy_(1, sm.write_slots, v[sm.write_rows].transpose(0, 1))
    out = torch.empty_like(q)
    done = decode(q[:nd], k_ring, v_ring, meta, scale) if decode is not None and nd and not reference else None
    if done is not None:
        out[:nd] = done
    for i in range(nd if done is not None else 0, meta.num_seqs):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        q_start = meta.seq_lens[i] - (b - a)
        if i < nd:
            kk, vv = k_flat.index_select(1, sm.key_slots[i]), v_flat.index_select(1, sm.key_slots[i])
        else:
            kk = torch.cat([past[i][0], k[a:b].transpose(0, 1)], dim=1)  # [Hkv, S, D]
            vv = torch.cat([past[i][1], v[a:b].transpose(0, 1)], dim=1)
        mask = sliding_mask(q_start, b - a, sm.key_start[i], kk.shape[1], sm.window, q.device)
        if reference:
            out[a:b], probs = _naive(q[a:b], kk, vv, mask, scale)
            full = probs.new_zeros(probs.shape[0], b - a, meta.seq_lens[i])
            full[:, :, sm.key_start[i]:sm.key_start[i] + kk.shape[1]] = probs
            if sink is not None:
                sink.append(full)
        else:
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask,
                                               scale=scale, enable_gqa=True)
            out[a:b] = o[0].transpose(0, 1)
    return out


def _naive(q, k, v, mask, scale: float):
    """Plain masked attention in float32: q ``[T, H, D]``, k, v ``[Hkv, S, D]``, mask
    ``[T, S]`` -> output ``[T, H, D]`` and probabilities ``[H, T, S]``."""
    group = q.shape[1] // k.shape[0]
    kf, vf = k.float().repeat_interleave(group, 0), v.float().repeat_interleave(group, 0)
    scores = (q.float().transpose(0, 1) @ kf.transpose(1, 2)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ vf).transpose(0, 1).to(q.dtype), probs
