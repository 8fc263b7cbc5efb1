"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2) + eps) * weight``, statistics in float32.

    x: ``[num_tokens, hidden]`` in any float dtype; weight: ``[hidden]``. Returns x's dtype.
    Same order of operations as `transformers`' LlamaRMSNorm (normalise in float32, cast back,
    then scale), so float32 results agree to the last bit.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight`` with the product taken in
    float32 before the cast back (`transformers`' Gemma3RMSNorm; its parameter is ``weight - 1``,
    GGUF stores ``weight`` itself). x: ``[..., dim]``; weight: ``[dim]``."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
