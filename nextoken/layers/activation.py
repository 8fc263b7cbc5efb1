"""Activations of gated feed-forward layers."""

import torch
import torch.nn.functional as F

from nextoken.kernels import load


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, native: bool = False) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``.

    gate, up: ``[num_tokens, intermediate]``. With `native` (the execution plan's choice) and
    contiguous bf16 inputs of one shape, our C kernel (``kernels/activation.c``: one pass, with
    this PyTorch expression's two roundings to bf16, so its values except where the last bits of
    e^-x move a rounding); otherwise PyTorch, the reference.
    """
    if native and gate.dtype == up.dtype == torch.bfloat16 and gate.shape == up.shape \
            and gate.is_contiguous() and up.is_contiguous():
        lib = load("activation")
        if lib is not None:
            out = torch.empty_like(gate)
            lib.silu_mul_bf16(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
            return out
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor, native: bool = False) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh approximation of GELU (Hendrycks & Gimpel 2016), as
    Gemma uses it: ``gelu_tanh(gate) * up``. gate, up: ``[num_tokens, intermediate]``. PyTorch
    only (`native` is accepted and ignored: no C kernel for it yet)."""
    return F.gelu(gate, approximate="tanh") * up
