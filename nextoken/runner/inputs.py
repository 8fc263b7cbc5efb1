"""A forward pass's inputs: every scheduled sequence's new tokens laid out flat, where their keys
and values go, and which blocks each sequence reads (vLLM's input batch).

    sequences -> `layout` (host arrays: ids, positions, slot mapping, block tables, offsets;
                 decodes first)
              -> `model_inputs` (tensors on the model's device and the `AttentionMetadata`;
                 for Triton attention its `DeviceMetadata` too)

`layout` works on NumPy arrays, a few operations per pass rather than per sequence, so a GPU's
step is not held up by the host; a decode step of at most `SMALL_DECODE` sequences is laid out
in plain Python lists instead (after a CPU decode step the NumPy calls ran cold: see
`_small_decode_layout`). On a GPU the arrays go over in two copies (one int64, one
int32) from pinned staging memory (`Staging`); on the CPU the tensors are views of the arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from nextoken.errors import EngineError
from nextoken.layers.attention import AttentionMetadata
from nextoken.layers.gpu_attention import DeviceMetadata
from nextoken.layers.sliding_attention import SlidingMetadata, build_sliding_metadata


@dataclass
class HostBatch:
    """One pass laid out on the host, sequences in batch order (decodes first).

    order: each batch row's index into the caller's sequences; input_ids, positions,
    slot_mapping: int64 ``[T]``; block_tables: int64 ``[S, max_blocks]`` (padded with 0);
    query_start_loc: ``[S + 1]`` offsets of each sequence's tokens; seq_lens ``[S]``: its
    tokens once this pass is written; num_decodes: the leading single-token sequences;
    first_block: each sequence's first block when its blocks are consecutive, else None;
    sliding: the rings' metadata (CPU tensors), for a model with sliding-window layers;
    fed_rows: int64 ``[num_decodes]``, for each decode the row of the previous step's draw its
    token comes from, -1 where the token is in `input_ids` (None: every token is; async
    scheduling, `runner.model_runner.SequenceInput.fed_from`)."""

    order: list[int]
    block_size: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    query_start_loc: list[int]
    seq_lens: list[int]
    num_decodes: int
    first_block: list[int | None]
    sliding: SlidingMetadata | None = None
    fed_rows: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def layout(seqs, block_size: int, sliding=None, fed: bool = False) -> HostBatch:
    """The `HostBatch` of `seqs` (`runner.model_runner.SequenceInput`, one row each) for a cache
    of `block_size`-token blocks (and `sliding`, its `SlidingKVCache`, or None); with `fed` (a
    draw on the device to take tokens from) its `fed_rows`. Raises `EngineError` when a
    sequence's blocks cannot hold its tokens (a scheduler fault)."""
    if len(seqs) <= SMALL_DECODE and all(len(s.token_ids) == 1 for s in seqs):
        return _small_decode_layout(seqs, block_size, sliding, fed)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)
    ss = [seqs[i] for i in order]
    lens = np.array([len(s.token_ids) for s in ss], dtype=np.int64)
    qsl = np.zeros(len(ss) + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    starts = np.array([s.start for s in ss], dtype=np.int64)
    counts = np.array([len(s.block_ids) for s in ss], dtype=np.int64)
    tables = np.zeros((len(ss), max(1, int(counts.max()))), dtype=np.int64)
    for row, s in enumerate(ss):
        if len(s.block_ids) * block_size < s.start + len(s.token_ids):
            raise EngineError(f"a sequence of {s.start + len(s.token_ids)} tokens has {len(s.block_ids)} blocks of "
                              f"{block_size}")
        tables[row, : len(s.block_ids)] = s.block_ids
    rows = np.repeat(np.arange(len(ss)), lens)
    positions = np.arange(int(qsl[-1]), dtype=np.int64) + np.repeat(starts - qsl[:-1], lens)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    ids = np.fromiter(chain.from_iterable(s.token_ids for s in ss), np.int64, int(qsl[-1]))  # (C's iteration: an
    # 8192-token prefill's ids 0.30 ms here against 0.65 through a generator of each id, 256 decodes' 26 us and 40)
    batch = HostBatch(order, block_size, ids, positions, slots, tables, qsl.tolist(), (starts + lens).tolist(),
                      int(np.sum(lens == 1)), first_blocks(tables, counts))
    if fed and any(s.fed_from >= 0 for s in ss):  # (an input fed from the device is a decode: among the first)
        batch.fed_rows = np.fromiter((s.fed_from for s in ss[: batch.num_decodes]), np.int64, batch.num_decodes)
    if sliding is not None:
        batch.sliding = build_sliding_metadata(sliding.window, block_size, sliding.ring_blocks,
                                               [(s.start, len(s.token_ids), s.ring_ids, s.off_ring) for s in ss])
    return batch


SMALL_DECODE = 32  # decode steps of at most this many sequences are laid out in plain Python (warm, it is
# faster up to about 64 sequences of 20 blocks: 48 us against 61 at 32; after a decode step, by more)


def _small_decode_layout(seqs, block_size: int, sliding, fed: bool) -> HostBatch:
    """`layout` of a decode step of a few sequences (one new token each), the same `HostBatch`
    from Python lists: run right after a decode step has streamed the weights through the
    caches, `layout`'s twenty NumPy calls took about 105 us for one sequence against 23 warm
    (each library's code evicted between steps); a test holds the two equal."""
    width = max(1, max(len(s.block_ids) for s in seqs))
    ids, positions, slots, table, first = [], [], [], [], []
    for s in seqs:
        pos, blocks = s.start, s.block_ids
        if len(blocks) * block_size < pos + 1:
            raise EngineError(f"a sequence of {pos + 1} tokens has {len(blocks)} blocks of {block_size}")
        ids.append(s.token_ids[0])
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        table += blocks
        table += [0] * (width - len(blocks))
        first.append(blocks[0] if blocks[-1] - blocks[0] == len(blocks) - 1
                     and blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None)
    n = len(seqs)
    batch = HostBatch(list(range(n)), block_size, np.array(ids, np.int64), np.array(positions, np.int64),
                      np.array(slots, np.int64), np.array(table, np.int64).reshape(n, width), list(range(n + 1)),
                      [p + 1 for p in positions], n, first)
    if fed and any(s.fed_from >= 0 for s in seqs):
        batch.fed_rows = np.array([s.fed_from for s in seqs], np.int64)
    if sliding is not None:
        batch.sliding = build_sliding_metadata(sliding.window, block_size, sliding.ring_blocks,
                                               [(s.start, 1, s.ring_ids, s.off_ring) for s in seqs])
    return batch


def first_blocks(tables: np.ndarray, counts: np.ndarray) -> list[int | None]:
    """Each row's first block when its `counts[row]` blocks in `tables` (``[S, W]``) are
    consecutive (a view of the cache serves that sequence), else None; one pass over the array
    (per sequence in Python it was 0.21 ms a step at 256 sequences of 50 blocks, now 0.05)."""
    cols = np.arange(tables.shape[1])
    ok = ((tables - tables[:, :1] == cols) | (cols >= counts[:, None])).all(axis=1) & (counts > 0)
    return [b if k else None for b, k in zip(tables[:, 0].tolist(), ok.tolist())]


def packed_offsets(sizes: list[int], itemsize: int, align: int = 16) -> tuple[list[int], int]:
    """Where each of arrays of `sizes` elements starts in one buffer of `itemsize`-byte elements,
    each start a multiple of `align` bytes, and the buffer's length (elements). Aligned starts
    keep each array's device pointer 16-byte aligned whatever the sizes before it, so a Triton
    kernel taking it is compiled once: Triton specializes a pointer argument on its 16-byte
    alignment, and with starts packed end to end a prefill's metadata pointers changed alignment
    from one step to the next, each change a compilation while serving."""
    step = max(1, align // itemsize)
    offsets, at = [], 0
    for n in sizes:
        at = -(-at // step) * step
        offsets.append(at)
        at += n
    return offsets, at


class Staging:
    """Pinned host buffers for a GPU's inputs: arrays are packed into one buffer per dtype (each
    at a 16-byte aligned start, `packed_offsets`) and copied over in one asynchronous copy; an
    event makes sure a buffer is not refilled while its last copy is still pending. On the CPU,
    `send` returns views of the arrays."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.done: dict[torch.dtype, object] = {}

    def send(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """`arrays` (any shapes) as tensors of `dtype` on the device, in order."""
        if self.device.type == "cpu":  # (no `to` for an array of the dtype already: see `_same_or_cast`)
            return [_same_or_cast(torch.from_numpy(np.ascontiguousarray(a)), dtype) for a in arrays]
        sizes = [a.size for a in arrays]
        offsets, total = packed_offsets(sizes, dtype.itemsize)
        if dtype in self.done:  # its last copy must be done before the buffer is refilled
            self.done[dtype].synchronize()
        buf = self.host.get(dtype)
        if buf is None or buf.numel() < total:
            buf = self.host[dtype] = torch.empty(max(total, 4096) * 2, dtype=dtype, device="cpu", pin_memory=True)
        flat = buf.numpy()
        for a, at, n in zip(arrays, offsets, sizes):
            flat[at : at + n] = a.reshape(-1)
        dev = buf[:total].to(self.device, non_blocking=True)
        event = self.done[dtype] = torch.cuda.Event()
        event.record()
        return [dev[at : at + n].view(a.shape) for a, at, n in zip(arrays, offsets, sizes)]


def _same_or_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as `dtype`, itself when it is that already: after a CPU decode step each PyTorch call
    runs cold, and even a ``to`` that returns its input took tens of microseconds
    (`benchmarks/cold_ops.py`)."""
    return t if t.dtype == dtype else t.to(dtype)


def model_inputs(batch: HostBatch, staging: Staging, backend: str, kernels, tilings=None,
                 splits: int = 1, aligned: bool = False,
                 fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids ``[T]``, positions ``[T]`` (int64, on the device) and the `AttentionMetadata`
    of `batch` for attention `backend` (the plan's; `kernels`: the attention libraries it
    resolved). For ``triton``: `tilings` the decode and prefill tiles (`kernels.gpu.attention.Tilings`:
    its prefill's block_q queries per prefill tile) and `splits` key splits per decode, `aligned` (a batch-invariant plan) for sliding-window prefill
    chunks, and the `DeviceMetadata` with them. `fed`: the previous step's drawn tokens on the
    device, which the decodes with `batch.fed_rows` take (`take_fed`)."""
    sm = batch.sliding
    ring = [] if sm is None or staging.device.type == "cpu" else \
        [sm.write_rows.numpy(), sm.write_slots.numpy(), *[k.numpy() for k in sm.key_slots]]
    feeding = fed is not None and batch.fed_rows is not None
    sent = staging.send([batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, *ring]
                        + ([batch.fed_rows] if feeding else []), torch.int64)
    ids, positions, slots, tables = sent[:4]
    if feeding:
        ids = take_fed(ids, sent.pop(), fed)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                             block_tables=tables, num_decodes=batch.num_decodes, block_size=batch.block_size,
                             backend=backend, kernels=kernels, first_block=batch.first_block)
    if sm is not None:  # on a GPU: its tensors there (the ring tables stay on the host, for the C step only)
        meta.sliding = SlidingMetadata(sm.window, sent[4], sent[5], sent[6:], sm.key_start, sm.ring_tables) \
            if ring else sm
    if backend == "triton":
        meta.device = device_metadata(batch, staging, tilings, splits, meta.sliding)
        meta.device.aligned = aligned
    return ids, positions, meta


def take_fed(ids: torch.Tensor, rows: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """`ids` ``[T]`` with each of its first ``len(rows)`` entries whose row is >= 0 replaced by
    ``fed[row]`` (a new tensor; device work only, no copy to the host)."""
    n = rows.shape[0]
    head = torch.where(rows >= 0, fed[rows.clamp(min=0)], ids[:n])
    return head if n == ids.shape[0] else torch.cat([head, ids[n:]])


def device_metadata(batch: HostBatch, staging: Staging, tilings, splits: int,
                    sliding: SlidingMetadata | None) -> DeviceMetadata:
    """What the Triton kernel reads of `batch` (`layers.gpu_attention.DeviceMetadata`), in one
    int32 copy: `tilings` (`kernels.gpu.attention.Tilings`) the tiles, whose prefill's block_q
    queries make a prefill tile, `splits` key splits per decode."""
    from nextoken.kernels.gpu.attention import query_tiles

    nd, ns = batch.num_decodes, batch.num_seqs
    parts = [np.asarray(batch.seq_lens, np.int32), np.asarray(batch.query_start_loc, np.int32),
             batch.block_tables.astype(np.int32)]
    if nd < ns:
        parts += [np.asarray(a, np.int32) for a in query_tiles(batch.query_start_loc, tilings.prefill.block_q, first=nd)]
    if sliding is not None:
        parts.append(sliding.ring_tables.numpy().astype(np.int32))
    sent = staging.send(parts, torch.int32)
    seq_lens, qsl, tables = sent[:3]
    tiles = (sent[3], sent[4]) if nd < ns else None
    dm = DeviceMetadata(seq_lens, qsl, tables, nd, ns, tiles, splits if nd else 1, tilings=tilings)
    if sliding is not None:
        dm.ring_tables, dm.ring_rows, dm.ring_slots = sent[-1], sliding.write_rows, sliding.write_slots
    return dm
