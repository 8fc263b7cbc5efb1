"""Activations of gated feed-forward layers."""

import torch
import torch.nn.functional as F

from nextoken.kernels import count_fallback


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, kernel=None) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``.

    gate, up: ``[num_tokens, intermediate]``. With `kernel` (the ``activation`` library the
    execution plan gave the layer) and contiguous bf16 inputs of one shape, our C kernel
    (``kernels/activation.c``: one pass, with
    this PyTorch expression's two roundings to bf16, so its values except where the last bits of
    e^-x move a rounding); otherwise PyTorch, the reference (with a `kernel` given, a counted
    fallback).
    """
    if kernel is not None:
        if gate.dtype == up.dtype == torch.bfloat16 and gate.shape == up.shape and gate.is_contiguous() \
                and up.is_contiguous():
            out = torch.empty_like(gate)
            kernel.silu_mul_bf16(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
            return out
        count_fallback("silu_and_mul")
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor, kernel=None) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh approximation of GELU (Hendrycks & Gimpel 2016), as
    Gemma uses it: ``gelu_tanh(gate) * up``. gate, up: ``[num_tokens, intermediate]``. PyTorch
    only (the plan gives GeGLU layers no `kernel`: there is no C kernel for it yet)."""
    return F.gelu(gate, approximate="tanh") * up
