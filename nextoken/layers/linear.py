"""Linear layers: ``y = x W^T + b``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear(torch.nn.Module):
    """A linear layer whose weight is set by the loader (no random initialisation).

    weight: ``[out_features, in_features]``; bias: ``[out_features]`` or None.
    forward: ``[num_tokens, in_features] -> [num_tokens, out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
