"""Activations of gated feed-forward layers."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``.

    gate, up: ``[num_tokens, intermediate]``.
    """
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh approximation of GELU (Hendrycks & Gimpel 2016), as
    Gemma uses it: ``gelu_tanh(gate) * up``. gate, up: ``[num_tokens, intermediate]``."""
    return F.gelu(gate, approximate="tanh") * up
