"""CUDA graphs of the decode step: a batch of decodes replays one captured graph instead of
launching every layer's kernels from Python (vLLM and nano-vllm do the same).

A graph runs on fixed addresses, so the step's inputs live in static buffers: token ids,
positions and slots (int64), and what the Triton attention reads (int32: each sequence's
keys, its block table, and for sliding-window layers its ring table and ring slot). One graph
is captured per batch size of `capture_sizes` (1, 2, 4, 8, 16, 24, ... up to the largest
decode batch, at most `MAX_GRAPH_BATCH`, as vLLM's defaults); a batch of B decodes replays the
graph of the first size >= B with padding rows that write their keys into the cache's spare
block (`kv_cache.tensors.PagedKVCache.spare_slot`) and attend to no keys. The buffers are
filled in one copy per dtype from pinned host memory. A step with a prefill chunk, a traced
request or LoRA adapters, or more decodes than were captured, runs eagerly.

With ``capture=False`` (the CPU tests) the same padded buffers run the model eagerly, so every
part but the capture itself is tested without a GPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from nextoken.layers.attention import AttentionMetadata
from nextoken.layers.gpu_attention import DeviceMetadata
from nextoken.runner.inputs import HostBatch, take_fed

log = logging.getLogger("nextoken.runner")


MAX_GRAPH_BATCH = 512  # the largest decode batch captured (vLLM's default largest capture size): larger run eagerly


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds `max_batch` decodes."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + 8)
    return [s for s in sizes if s < max_batch] + [next(s for s in sizes if s >= max_batch)]


class DecodeGraphs:
    """The captured decode steps of `runner` (a `runner.model_runner.ModelRunner` with its KV
    cache, made with a spare block) for up to ``capture_sizes(max_batch)[-1]`` decodes whose
    tables hold at most `max_blocks` blocks. `splits(b)`: the key splits of a b-decode step.
    `capture`: capture CUDA graphs (a GPU), else run the static buffers eagerly."""

    def __init__(self, runner, max_batch: int, max_blocks: int, splits, capture: bool = True):
        self.model, self.kv, self.device = runner.model, runner.kv, runner.kv.device
        self.tilings = runner.tilings
        self.sizes = capture_sizes(max_batch)
        self.max_blocks, self.splits, self.capture = max_blocks, splits, capture
        b = self.sizes[-1]
        sliding = self.kv.sliding is not None
        # int64: ids | positions | slots | ring slots | fed rows;  int32: seq lens | tables | ring tables
        self.n64 = 5 * b
        self.n32 = b + (2 if sliding else 1) * b * max_blocks
        self.dev64 = torch.zeros(self.n64, dtype=torch.int64, device=self.device)
        self.dev32 = torch.zeros(self.n32, dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        self.host64 = torch.zeros(self.n64, dtype=torch.int64, device="cpu", pin_memory=pin)
        self.host32 = torch.zeros(self.n32, dtype=torch.int32, device="cpu", pin_memory=pin)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=self.device)
        self.ring_rows = torch.arange(b, dtype=torch.int64, device=self.device)
        self.sliding = sliding
        self.copied = None  # the event of the last copy into the static buffers
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.pool = None
        t0 = time.perf_counter()
        for size in reversed(self.sizes):
            self._capture(size)
        if capture:
            log.info("CUDA graphs: decode batches of %s captured in %.1f s", ", ".join(map(str, self.sizes)),
                     time.perf_counter() - t0)

    # -- the static buffers -----------------------------------------------------------------
    def _views(self, buf: torch.Tensor, wide: bool) -> dict[str, torch.Tensor]:
        b, m = self.sizes[-1], self.max_blocks
        if wide:
            return {"ids": buf[:b], "positions": buf[b : 2 * b], "slots": buf[2 * b : 3 * b],
                    "ring_slots": buf[3 * b : 4 * b], "fed_rows": buf[4 * b : 5 * b]}
        out = {"seq_lens": buf[:b], "tables": buf[b : b + b * m].view(b, m)}
        if self.sliding:
            out["ring_tables"] = buf[b + b * m : b + 2 * b * m].view(b, m)
        return out

    def _metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a `size`-decode step over the static buffers."""
        v64, v32 = self._views(self.dev64, True), self._views(self.dev32, False)
        dm = DeviceMetadata(v32["seq_lens"][:size], self.query_start_loc[: size + 1], v32["tables"][:size], size,
                            size, None, self.splits(size), tilings=self.tilings)
        if self.sliding:
            dm.ring_tables, dm.ring_rows, dm.ring_slots = \
                v32["ring_tables"][:size], self.ring_rows[:size], v64["ring_slots"][:size]
        return AttentionMetadata(slot_mapping=v64["slots"][:size], query_start_loc=list(range(size + 1)),
                                 seq_lens=[1] * size, block_tables=v32["tables"][:size], num_decodes=size,
                                 block_size=self.kv.block_size, backend="triton", device=dm)

    def _step(self, size: int) -> torch.Tensor:
        v64 = self._views(self.dev64, True)
        return self.model(v64["ids"][:size], v64["positions"][:size], self.kv, self._metadata(size))

    def _capture(self, size: int) -> None:
        self._fill_padding(0, size)
        self._copy()
        out = self._step(size)  # compiles the kernels and sets up the libraries before the capture
        if not self.capture:
            self.graphs[size] = (None, out)
            return
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(size)
        self.pool = graph.pool()
        self.graphs[size] = (graph, out)

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` of the host buffers as padding: token 0 at position 0, its keys
        to the spare block, no keys to attend to."""
        h64, h32 = self._views(self.host64, True), self._views(self.host32, False)
        h64["ids"][start:stop] = 0
        h64["positions"][start:stop] = 0
        h64["slots"][start:stop] = self.kv.spare_slot
        h32["seq_lens"][start:stop] = 0
        if self.sliding:
            h64["ring_slots"][start:stop] = self.kv.sliding.num_blocks * self.kv.block_size

    def _copy(self) -> None:
        """The host buffers into the static device buffers (one copy per dtype)."""
        if self.device.type == "cpu":
            self.dev64.copy_(self.host64)
            self.dev32.copy_(self.host32)
            return
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    # -- a step -----------------------------------------------------------------------------
    def takes(self, batch: HostBatch) -> bool:
        """Whether `batch` is all decodes, few enough, with tables that fit."""
        return (batch.num_decodes == batch.num_seqs <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.max_blocks
                and (batch.sliding is None or batch.sliding.ring_tables.shape[1] <= self.max_blocks))

    def run(self, batch: HostBatch, fed: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states ``[S, hidden]`` of `batch`'s decodes (a view of the graph's
        output, valid until the next step). `fed`: the previous step's drawn tokens on the device,
        which the decodes with `batch.fed_rows` take (written into the static ids before the
        replay, outside the graph)."""
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has left the host buffers
        h64, h32 = self._views(self.host64, True), self._views(self.host32, False)
        h64["ids"][:n] = torch.from_numpy(batch.input_ids)
        h64["positions"][:n] = torch.from_numpy(batch.positions)
        h64["slots"][:n] = torch.from_numpy(batch.slot_mapping)
        h32["seq_lens"][:n] = torch.from_numpy(np.asarray(batch.seq_lens, dtype=np.int32))
        w = batch.block_tables.shape[1]
        h32["tables"][:n, :w] = torch.from_numpy(batch.block_tables.astype(np.int32))
        if self.sliding:
            sm = batch.sliding
            h64["ring_slots"][:n] = sm.write_slots
            h32["ring_tables"][:n, : sm.ring_tables.shape[1]] = sm.ring_tables.to(torch.int32)
        feeding = fed is not None and batch.fed_rows is not None
        if feeding:
            h64["fed_rows"][:n] = torch.from_numpy(batch.fed_rows)
            h64["fed_rows"][n:size] = -1
        self._fill_padding(n, size)
        self._copy()
        if feeding:
            v64 = self._views(self.dev64, True)
            v64["ids"][:size].copy_(take_fed(v64["ids"][:size], v64["fed_rows"][:size], fed))
        graph, out = self.graphs[size]
        if graph is None:
            out = self._step(size)
        else:
            graph.replay()
        return out[:n]
