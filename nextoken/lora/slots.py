"""One linear layer's adapters (`LoRASlots`) and the pass's batch of them (`LoRABatch`): the
stacked A and B of every adapter in the pass, a mask keeping each token to its own columns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatch:
    """The current pass's adapters, set by the runner before each forward pass: `ids`, the
    adapters present (in column order), `ranks` of every loaded adapter, and per token row
    `row_start` (its adapter's first column of the stacks) and `row_rank` (0: the base model),
    int64 ``[T]``. Empty `ids` when no request of the pass uses an adapter. `version` changes
    whenever an adapter is loaded or unloaded."""

    ids: tuple[int, ...] = ()
    ranks: dict[int, int] = field(default_factory=dict)
    row_start: torch.Tensor | None = None
    row_rank: torch.Tensor | None = None
    version: int = 0
    _masks: dict = field(default_factory=dict)  # the pass's mask per dtype (the PyTorch path's; made on first use)

    def set_rows(self, ids: tuple[int, ...], row_start: torch.Tensor | None, row_rank: torch.Tensor | None) -> None:
        self.ids, self.row_start, self.row_rank = ids, row_start, row_rank
        self._masks = {}

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor:
        """``[T, R]`` (R: the sum of the pass's ranks) in `dtype`, on the rows' device: 1 where
        row t's adapter owns column c, else 0 (base-model rows are zero)."""
        got = self._masks.get(dtype)
        if got is None:
            cols = torch.arange(sum(self.ranks[i] for i in self.ids), device=self.row_start.device)
            start, end = self.row_start[:, None], (self.row_start + self.row_rank)[:, None]
            got = self._masks[dtype] = ((cols >= start) & (cols < end)).to(dtype)
        return got


class LoRASlots:
    """One linear layer's adapters: adapter id -> (A ``[r, in]``, scaling * B ``[out, r]``),
    float32, and the pass's `LoRABatch`. For each set of adapters in a pass and each activation
    dtype, their A are stacked ``[R, in]`` and their B transposed and stacked ``[R, out]`` once,
    in that dtype (zeros for an adapter that does not target this layer): the addition is then
    three PyTorch calls, in the model's dtype as vLLM's LoRA kernels compute it (float32 for a
    float32 model, the exact reference against peft), or a step of the C decode
    (`layers.native_decode`), which reads the same stacks."""

    def __init__(self, batch: LoRABatch):
        self.batch = batch
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def set(self, adapter: int, a: torch.Tensor, b: torch.Tensor | None) -> None:
        """Hold adapter `adapter`'s A and scaled B (None: drop it)."""
        if b is None:
            self.weights.pop(adapter, None)
        else:
            self.weights[adapter] = (a, b)
        self._stacked.clear()

    def stacks(self, dtype: torch.dtype, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pass's adapters stacked in `dtype` on `device` (default the CPU, where the adapters
        are held): A ``[R, in]`` and the scaled B transposed ``[R, out]`` (contiguous, rows in the
        pass's column order); None when none of them targets this layer."""
        batch = self.batch
        if not any(i in self.weights for i in batch.ids):
            return None
        device = device or torch.device("cpu")
        got = self._stacked.get((batch.ids, dtype, device))
        if got is None:
            a0, b0 = next(iter(self.weights.values()))
            x_in, y_out = a0.shape[1], b0.shape[0]
            parts = [self.weights.get(i) or (torch.zeros(batch.ranks[i], x_in, device="cpu"),
                                             torch.zeros(y_out, batch.ranks[i], device="cpu")) for i in batch.ids]
            a = torch.cat([a for a, _ in parts]).to(dtype).contiguous().to(device)
            b = torch.cat([b for _, b in parts], dim=1).t().contiguous().to(dtype).to(device)
            got = self._stacked[(batch.ids, dtype, device)] = (a, b)
        return got

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus, for each token, its adapter's ``(x A^T) (s B)^T`` (x ``[T, in]``, y
        ``[T, out]``): two matmuls for every adapter of the pass together, the mask keeping each
        token to its own adapter's columns."""
        stacks = self.stacks(y.dtype, y.device)
        if stacks is None:
            return y
        a, b_t = stacks
        x = x if x.dtype == y.dtype else x.to(y.dtype)
        return torch.addmm(y, torch.mm(x, a.t()).mul_(self.batch.mask_as(y.dtype)), b_t)
