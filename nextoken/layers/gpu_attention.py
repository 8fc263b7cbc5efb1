"""Attention on our Triton kernel (`kernels.gpu.attention`): the path of the execution plan's
``triton`` attention (a GPU's; on the CPU only under Triton's interpreter, for the tests).

The model runner describes each pass once in `DeviceMetadata` (device tensors: what the kernel
reads), and a layer's `attend_triton` writes its keys and values and runs the kernel:

- a full-attention layer writes the pass's keys and values into the paged cache first, then
  runs the decodes (one query each, split over the keys) and the prefill chunks (tiles of
  queries) as two launches;
- a sliding-window layer runs its prefill chunks first, reading the keys before each chunk from
  the sequence's ring and the chunk's own keys from this pass (the ring cannot hold a long
  chunk), then writes the ring, then runs its decodes over their windows (which can include a
  key written in this very pass: speculative verification's rows of one sequence see each
  other's), the order of `layers.sliding_attention`.

Every tensor here has a fixed address for a fixed batch shape, so a decode step replays as a
CUDA graph (`runner.cuda_graphs`). The reference is `layers.attention.paged_attention_reference`;
the tests hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DeviceMetadata:
    """One pass's layout as the Triton kernel reads it (on the model's device).

    seq_lens int32 ``[S]`` (each sequence's keys once this pass is written); query_start_loc
    int32 ``[S + 1]``; block_tables int32 ``[S, max_blocks]``; the first `num_decodes` sequences
    are single-token decodes; tiles: (sequence, first query) int32 ``[P]`` each, the query tiles
    of the prefill chunks (None without any); splits: key splits per decode (a power of two).
    For a model with sliding-window layers: ring_tables int32 ``[S, logical blocks]`` (logical
    block -> ring block), and ring_rows / ring_slots int64 ``[W]``: rows of the pass whose keys
    go into the rings, and where; aligned: a sliding-window prefill chunk switches from the ring's
    keys to the pass's at a key tile's boundary (`kernels.gpu.attention.paged_attention`'s, a
    batch-invariant plan's); tilings: the decode and prefill tiles the runner chose
    (`kernels.gpu.attention.Tilings`; None: the kernel's defaults)."""

    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    num_seqs: int
    tiles: tuple[torch.Tensor, torch.Tensor] | None
    splits: int = 1
    ring_tables: torch.Tensor | None = None
    ring_rows: torch.Tensor | None = None
    ring_slots: torch.Tensor | None = None
    aligned: bool = False
    tilings: object | None = None


def attend_triton(q, k, v, kv, layer: int, meta, scale: float, sliding: bool, stored: bool = False) -> torch.Tensor:
    """One layer's attention on the Triton kernel: q ``[T, H, D]``, k, v ``[T, Hkv, D]`` ->
    ``[T, H, D]``; writes k, v into `kv` (`kv_cache.tensors.PagedKVCache`: the paged cache, or
    the layer's ring when `sliding`), unless `stored` (the RoPE kernel wrote the paged cache:
    `layers.attention.KVStore`). `meta`: the pass's `AttentionMetadata`, its `device` set."""
    dm: DeviceMetadata = meta.device
    out = torch.empty_like(q)
    if sliding:
        i = kv.sliding.layer_index[layer]
        k_ring, v_ring = kv.sliding.k[i], kv.sliding.v[i]
        window = kv.sliding.window
        if dm.tiles is not None:
            _prefill(q, k_ring, v_ring, dm, dm.ring_tables, scale, out, window=window, k_new=k, v_new=v,
                     aligned=dm.aligned)
        heads, nb, bs, d = k_ring.shape
        k_ring.view(heads, nb * bs, d).index_copy_(1, dm.ring_slots, k[dm.ring_rows].transpose(0, 1))
        v_ring.view(heads, nb * bs, d).index_copy_(1, dm.ring_slots, v[dm.ring_rows].transpose(0, 1))
        if dm.num_decodes:
            _decode(q, k_ring, v_ring, dm, dm.ring_tables, scale, out, kv.tickets, window=window)
        return out
    i = kv.layer_index[layer]
    if not stored:
        kv.write(i, meta.slot_mapping, k, v)
    k_cache, v_cache = kv.layer(i)
    scales = {}
    if kv.quantized:  # int8 rows: codes and their scales (`kv_cache.tensors.Int8Rows`)
        scales = {"k_scales": k_cache.scales, "v_scales": v_cache.scales}
        k_cache, v_cache = k_cache.codes, v_cache.codes
    if dm.num_decodes:
        _decode(q, k_cache, v_cache, dm, dm.block_tables, scale, out, kv.tickets, **scales)
    if dm.tiles is not None:
        _prefill(q, k_cache, v_cache, dm, dm.block_tables, scale, out, **scales)
    return out


def _decode(q, k_cache, v_cache, dm: DeviceMetadata, tables, scale: float, out, tickets, **extra) -> None:
    """The pass's decodes (its first `num_decodes` rows and sequences), `dm.splits` programs each,
    joined in the same launch over the cache's `tickets` (unless the plan found that join unequal
    to two launches on this GPU, or slower at this many splits: `Tilings.joins`)."""
    from nextoken.kernels.gpu.attention import paged_attention

    nd = dm.num_decodes
    partials = None
    if dm.splits > 1:
        partials = torch.empty(nd * q.shape[1] * dm.splits * (q.shape[2] + 2), dtype=torch.float32, device=q.device)
    tilings = dm.tilings
    paged_attention(q, k_cache, v_cache, tables, dm.seq_lens, dm.query_start_loc, scale, out=out, decode=True,
                    num_seqs=nd, splits=dm.splits, partials=partials,
                    tickets=tickets if tilings is None or tilings.joins(dm.splits) else None,
                    launch=tilings.decode if tilings is not None else None, **extra)


def _prefill(q, k_cache, v_cache, dm: DeviceMetadata, tables, scale: float, out, **extra) -> None:
    """The pass's prefill chunks (sequences from `num_decodes` on), one program per query tile."""
    from nextoken.kernels.gpu.attention import paged_attention

    paged_attention(q, k_cache, v_cache, tables, dm.seq_lens, dm.query_start_loc, scale, out=out, decode=False,
                    num_seqs=dm.num_seqs, tiles=dm.tiles, launch=dm.tilings.prefill if dm.tilings is not None else None,
                    **extra)
