"""Activations of gated feed-forward layers."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``.

    gate, up: ``[num_tokens, intermediate]``.
    """
    return F.silu(gate) * up
