"""The model files' building blocks: norm, rotary, attention, activation, linear."""

import torch


def weight_param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """An uninitialised, frozen parameter of `shape` that the loader fills (norm weights, biases,
    position tables)."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

