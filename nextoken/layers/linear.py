"""Linear layers: ``y = x W^T + b``, with W dense or kept packed as int4 (`quant_linear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextoken.layers.quant_linear import int4_linear


class Linear(torch.nn.Module):
    """A linear layer whose weight is set by the loader (no random initialisation).

    weight: ``[out_features, in_features]``; bias: ``[out_features]`` or None.
    forward: ``[num_tokens, in_features] -> [num_tokens, out_features]``. After `set_int4` a
    packed 4-bit copy of the weight serves calls of at most `INT4_MAX_TOKENS` rows (decode steps:
    memory-bound, where reading half the bytes wins) and the dense weight serves larger ones
    (prefill, big batches: compute-bound, where the bf16 matrix units win). Measured on
    SmolLM2 (2 Sapphire Rapids cores): int4 1.8x faster at 1 row, on par near 16, slower from 32.
    """

    INT4_MAX_TOKENS = 16

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.int4: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_int4(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        self.int4 = (packed, scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= self.INT4_MAX_TOKENS:
            y = int4_linear(x, *self.int4)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        dense = self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)
        return dense + (sum(t.nbytes for t in self.int4) if self.int4 is not None else 0)
