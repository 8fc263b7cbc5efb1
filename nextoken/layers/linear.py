"""Linear layers: ``y = x W^T + b``, with W dense or kept packed as int4 (`quant_linear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextoken.layers.compiled import maybe_compiled
from nextoken.layers.quant_linear import int4_linear, int4_unpack

_unpack = maybe_compiled(int4_unpack)


class Linear(torch.nn.Module):
    """A linear layer whose weight is set by the loader (no random initialisation).

    weight: ``[out_features, in_features]``; bias: ``[out_features]`` or None.
    forward: ``[num_tokens, in_features] -> [num_tokens, out_features]``.

    After `set_int4` the weight lives only as packed 4-bit parts (one per 4-bit GGUF tensor, two
    for Q8_0; their weights add up) and the dense weight is released. Calls of at most
    `INT4_MAX_TOKENS` rows (decode steps: memory-bound, where reading a quarter of the bytes wins)
    run the int4 kernel; larger calls (prefill, big batches: compute-bound, where the bf16
    matrix units win) expand the weight to bf16 for that call only. Measured on SmolLM2 (2
    Sapphire Rapids cores), 512 rows x 576 x 1536: int4 kernel 5.5 ms, expand + bf16 matmul
    2.5 ms.
    """

    INT4_MAX_TOKENS = 48  # int4 kernel up to this many rows when there is no dense copy
    INT4_MAX_TOKENS_WITH_DENSE = 12  # and with one (crossover measured on SmolLM2's shapes)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.int4: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def set_int4(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], keep_dense: bool = False) -> None:
        """Keep the weight as int4 parts ``(packed, scales_and_zeros, nibbles)`` only
        (`quant_linear.pack_int4`), or with `keep_dense` also the dense weight, which then serves
        calls of more than `INT4_MAX_TOKENS_WITH_DENSE` rows (the int4 kernel's time grows with
        every row: 25 us per row for 0.9M weights, while a bf16 matmul of 32 rows takes 224 us).
        Parts without nibbles (None) and no dense copy always use the int4 kernel."""
        self.int4 = list(parts)
        if not keep_dense:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is None:
            return F.linear(x, self.weight, self.bias)
        limit = self.INT4_MAX_TOKENS if self.weight is None else self.INT4_MAX_TOKENS_WITH_DENSE
        if x.shape[0] <= limit or (self.weight is None and self.int4[0][2] is None):
            y = int4_linear(x, *self.int4[0][:2])
            for packed, sz, _ in self.int4[1:]:
                y = y + int4_linear(x, packed, sz)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dense_weight(), self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` as a dense tensor (expanded from int4 when packed)."""
        if self.weight is not None:
            return self.weight
        if self.int4[0][2] is None:
            raise ValueError("this int4 weight keeps no nibbles to expand")
        w = _unpack(self.int4[0][2], self.int4[0][1])
        for _, sz, nibbles in self.int4[1:]:
            w = w + _unpack(nibbles, sz)
        return w

    @property
    def nbytes(self) -> int:
        dense = self.weight.nbytes if self.weight is not None else 0
        packed = sum(t.nbytes for part in self.int4 for t in part if t is not None) if self.int4 is not None else 0
        return dense + packed + (self.bias.nbytes if self.bias is not None else 0)
