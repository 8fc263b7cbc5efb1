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
    _as: dict = field(default_factory=dict)  # the mask in each activation dtype, made once per pass

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor:
        got = self._as.get(dtype)
        if got is None or got[0] is not self.mask:
            got = self._as[dtype] = (self.mask, self.mask.to(dtype))
        return got[1]


class LoRASlots:
    """One linear layer's adapters: adapter id -> (A ``[r, in]``, scaling * B ``[out, r]``),
    float32, and the pass's `LoRABatch`. For each set of adapters in a pass and each activation
    dtype, their A are stacked and transposed ``[in, R]`` and B ``[R, out]`` once, in that dtype
    (zeros for an adapter that does not target this layer): the addition is then three PyTorch
    calls, in the model's dtype as vLLM's LoRA kernels compute it (float32 for a float32 model,
    the exact reference against peft)."""

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

    def _stack(self, ids: tuple[int, ...], ranks: dict[int, int], x_in: int, y_out: int, dtype: torch.dtype):
        got = self._stacked.get((ids, dtype))
        if got is None:
            parts = [self.weights.get(i) or (torch.zeros(ranks[i], x_in), torch.zeros(y_out, ranks[i])) for i in ids]
            a = torch.cat([a for a, _ in parts]).t().contiguous().to(dtype)
            b = torch.cat([b for _, b in parts], dim=1).t().contiguous().to(dtype)
            got = self._stacked[(ids, dtype)] = (a, b)
        return got

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus, for each token, its adapter's ``(x A^T) (s B)^T`` (x ``[T, in]``, y
        ``[T, out]``): two matmuls for every adapter of the pass together, the mask keeping each
        token to its own adapter's columns."""
        batch = self.batch
        if not any(i in self.weights for i in batch.ids):
            return y
        dtype = y.dtype
        x = x if x.dtype == dtype else x.to(dtype)
        a_t, b_t = self._stack(batch.ids, batch.ranks, x.shape[1], y.shape[1], dtype)
        return torch.addmm(y, torch.mm(x, a_t).mul_(batch.mask_as(dtype)), b_t)
