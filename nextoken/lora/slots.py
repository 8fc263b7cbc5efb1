"""One linear layer's adapters (`LoRASlots`) and the pass's batch of them (`LoRABatch`): the
stacked A and B of every adapter in the pass, a mask keeping each token to its own columns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatch:
    """The current pass's adapters, set by the runner before each forward pass: `ids`, the
    adapters present (in column order), `ranks` of every loaded adapter, and `mask` ``[T, R]``
    (R: the sum of their ranks), 1 where token t's adapter owns column c, else 0 (base-model
    tokens have a zero row). Empty `ids` when no request of the pass uses an adapter."""

    ids: tuple[int, ...] = ()
    ranks: dict[int, int] = field(default_factory=dict)
    mask: torch.Tensor | None = None


class LoRASlots:
    """One linear layer's adapters: adapter id -> (A ``[r, in]``, scaling * B ``[out, r]``),
    float32, and the pass's `LoRABatch`. For each set of adapters in a pass, their A are stacked
    ``[R, in]`` and B ``[out, R]`` once (zeros for an adapter that does not target this layer)."""

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

    def _stack(self, ids: tuple[int, ...], ranks: dict[int, int], x_in: int, y_out: int):
        got = self._stacked.get(ids)
        if got is None:
            parts = [self.weights.get(i) or (torch.zeros(ranks[i], x_in), torch.zeros(y_out, ranks[i])) for i in ids]
            got = self._stacked[ids] = (torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts], dim=1))
        return got

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus, for each token, its adapter's ``(x A^T) (s B)^T`` (x ``[T, in]``, y
        ``[T, out]``): two matmuls for every adapter of the pass together, the mask keeping each
        token to its own adapter's columns."""
        batch = self.batch
        if not any(i in self.weights for i in batch.ids):
            return y
        a, b = self._stack(batch.ids, batch.ranks, x.shape[1], y.shape[1])
        delta = ((x.float() @ a.T) * batch.mask) @ b.T
        return y + delta.to(y.dtype)
