"""The adapters loaded into one model (`LoRAManager`): load and unload, and each pass's batch."""

from __future__ import annotations

import re

import torch

from nextoken.errors import InvalidRequest
from nextoken.lora.readers import SUPPORTED_TARGETS, read_adapter
from nextoken.lora.request import LoRARequest
from nextoken.lora.slots import LoRABatch, LoRASlots


def _linears(model) -> dict[str, torch.nn.Module]:
    """``"layers.N.self_attn.q_proj"`` (and the MLP's) -> our `Linear` module."""
    out = {}
    for name, m in model.named_modules():
        hit = re.search(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)$", name)
        if hit and hit.group(3) in SUPPORTED_TARGETS:
            out[hit.group(0)] = m
    return out


def _even_rank(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[r, in]`` and B ``[out, r]`` of an odd rank r padded with one zero rank (a zero row of A,
    a zero column of B): the same product, and every adapter's columns then start at an even
    column of the stacks with an even width, as the C step's copies interleaved by pairs need
    (so a row's arithmetic does not depend on which adapters share its batch)."""
    if a.shape[0] % 2 == 0:
        return a, b
    return torch.cat([a, a.new_zeros(1, a.shape[1])]), torch.cat([b, b.new_zeros(b.shape[0], 1)], dim=1)


class LoRAManager:
    """The adapters loaded into one model (at most `max_loras`, of rank <= `max_lora_rank`):
    `add` loads a `LoRARequest` once and returns its id; `remove` unloads it."""

    def __init__(self, model, max_loras: int = 8, max_lora_rank: int = 64, device: torch.device | None = None):
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.device = device or torch.device("cpu")  # where the passes run: each row's columns go there
        self.batch = LoRABatch()
        self.loaded: dict[int, LoRARequest] = {}
        self.linears = _linears(model)

    def add(self, req: LoRARequest) -> int:
        """Load `req`'s adapter (once per id); its id. Raises `InvalidRequest` (field ``lora``)
        for a missing or unreadable folder, a rank above the limit, a target we do not
        support, tensors of another base model, or more adapters than `max_loras`."""
        if not isinstance(req.lora_int_id, int) or req.lora_int_id < 1:
            raise InvalidRequest(f"lora_int_id must be an integer >= 1, got {req.lora_int_id!r}", "lora")
        if req.lora_int_id in self.loaded:
            return req.lora_int_id
        weights, scaling = read_adapter(req, self.max_lora_rank, self.model.config)
        for name, (a, b) in weights.items():
            lin = self.linears.get(name)
            if lin is None:
                raise InvalidRequest(f"adapter {req.lora_name!r}: the model has no layer {name}", "lora")
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise InvalidRequest(f"adapter {req.lora_name!r} is for another base model: {name} takes "
                                     f"{lin.in_features} -> {lin.out_features}, the adapter "
                                     f"{a.shape[1]} -> {b.shape[0]}", "lora")
        if len(self.loaded) >= self.max_loras:
            raise InvalidRequest(f"{len(self.loaded)} adapters are loaded, the limit (max_loras); unload one first",
                                 "lora")
        weights = {name: _even_rank(a, b) for name, (a, b) in weights.items()}
        for name, (a, b) in weights.items():
            lin = self.linears[name]
            if lin.lora is None:
                lin.lora = LoRASlots(self.batch)
            lin.lora.set(req.lora_int_id, a, b * scaling)
        self.loaded[req.lora_int_id] = req
        self.batch.ranks[req.lora_int_id] = next(iter(weights.values()))[0].shape[0]
        self.batch.version += 1
        return req.lora_int_id

    def remove(self, lora_id: int) -> bool:
        """Unload adapter `lora_id`; whether it was loaded."""
        if self.loaded.pop(lora_id, None) is None:
            return False
        for lin in self.linears.values():
            if lin.lora is not None:
                lin.lora.set(lora_id, None, None)
        self.batch.ranks.pop(lora_id, None)
        self.batch.version += 1
        return True

    def set_batch(self, adapter_of_row: list[int]) -> None:
        """This pass's adapter per token row (0: the base model): the batch's ids and each row's
        columns of the stacks."""
        ids = tuple(sorted(set(adapter_of_row) - {0}))
        if not ids:
            self.batch.set_rows(ids, None, None)
            return
        starts, at = {0: 0}, 0
        for i in ids:
            starts[i], at = at, at + self.batch.ranks[i]
        self.batch.set_rows(ids, torch.tensor([starts[i] for i in adapter_of_row], dtype=torch.int64, device=self.device),
                            torch.tensor([self.batch.ranks.get(i, 0) for i in adapter_of_row], dtype=torch.int64,
                                         device=self.device))
