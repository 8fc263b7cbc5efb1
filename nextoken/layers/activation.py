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
    out = _on_kernel(kernel, "silu_mul_bf16", "silu_and_mul", gate, up)
    return out if out is not None else F.silu(gate) * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor, kernel=None) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh approximation of GELU (Hendrycks & Gimpel 2016), as
    Gemma uses it: ``gelu_tanh(gate) * up``. gate, up: ``[num_tokens, intermediate]``. With
    `kernel`, our C kernel under the same conditions as `silu_and_mul` (GELU in float32 rounded
    to bf16, then the product; computed as ``x / (1 + e^-2a)``, so a last bit of e^x
    may move a rounding); otherwise this PyTorch expression, the reference."""
    out = _on_kernel(kernel, "gelu_tanh_mul_bf16", "gelu_tanh_and_mul", gate, up)
    return out if out is not None else F.gelu(gate, approximate="tanh") * up


def _on_kernel(kernel, fn: str, name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`fn` of the ``activation`` library on contiguous bf16 gate and up of one shape, or a GPU
    plan's `act_and_mul` (`kernels.gpu.rowwise`: bf16 or float32); None (a fallback counted under
    `name` when `kernel` was given) otherwise."""
    if kernel is None:
        return None
    if hasattr(kernel, "act_and_mul"):  # a GPU plan's Triton kernels (`kernels.gpu.rowwise`)
        out = kernel.act_and_mul(gate, up, gelu=fn.startswith("gelu"))
        if out is None:
            count_fallback(name)
        return out
    if gate.dtype == up.dtype == torch.bfloat16 and gate.shape == up.shape and gate.is_contiguous() \
            and up.is_contiguous():
        out = torch.empty_like(gate)
        getattr(kernel, fn)(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
        return out
    count_fallback(name)
    return None
