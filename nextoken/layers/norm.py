"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

import torch

from nextoken.kernels import count_fallback
from nextoken.layers.linear import Pending


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel=None, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2) + eps) * weight``, statistics in float32.

    x: ``[num_tokens, hidden]`` in any float dtype; weight: ``[hidden]``. Returns x's dtype.
    Same order of operations as `transformers`' LlamaRMSNorm (normalise in float32, cast back,
    then scale), so float32 results agree to the last bit.

    With `kernel` (the ``activation`` library the execution plan gave the layer) and a contiguous
    2-D bf16 x and bf16 weight, our C kernel (``kernels/activation.c``: one pass per row, rows over threads; the squares summed in
    float64, so the mean can differ from PyTorch's in its last bit, and then an output by one
    bf16 step); otherwise this PyTorch expression, the reference (with a `kernel` given, a
    counted fallback). A batch-invariant plan's kernel (`kernels.gpu.batch_invariant.InvariantNorms`)
    takes every call: Triton, a fixed number of rows per program for the width. `out`: where
    the C kernel writes (x's shape, dtype and layout; it may be x itself), else a new tensor;
    the other paths always return a new one.
    """
    if kernel is not None:
        if hasattr(kernel, "rms_norm"):
            return kernel.rms_norm(x, weight, eps)
        if x.dtype == weight.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() \
                and weight.is_contiguous() and weight.shape == x.shape[1:]:
            out = torch.empty_like(x) if out is None else out
            kernel.rms_norm_rows_bf16(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
            return out
        count_fallback("rms_norm")
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel=None, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Gemma's RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight`` with the product taken in
    float32 before the cast back (`transformers`' Gemma3RMSNorm; its parameter is ``weight - 1``,
    GGUF stores ``weight`` itself). x: ``[..., dim]``; weight: ``[dim]``. `kernel`: the plan's
    norm kernel: a batch-invariant plan's (`kernels.gpu.batch_invariant.InvariantNorms`), or
    the C library's ``rms_norm_rows_gemma`` for a contiguous 2-D bf16 x and bf16 weight (the
    decode step's norm: the squares summed in float64, so an output can differ from this
    expression's by one bf16 step, as `rms_norm`'s); otherwise this PyTorch expression, the
    reference. `out`: `rms_norm`'s."""
    if hasattr(kernel, "rms_norm"):
        return kernel.rms_norm(x, weight, eps, gemma=True)
    if kernel is not None and x.dtype == weight.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() \
            and weight.is_contiguous() and weight.shape == x.shape[1:] and hasattr(kernel, "rms_norm_rows_gemma"):
        out = torch.empty_like(x) if out is None else out
        kernel.rms_norm_rows_gemma(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
        return out
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor | None, eps: float, kernel=None,
                 gemma: bool = False, a_weight: torch.Tensor | None = None, in_place: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A residual add and the RMSNorm after it: ``s = h + a`` (with `a_weight`, Gemma 3's
    post-norm first: ``s = h + rms_norm(a, a_weight)``; `a` None: s = h, nothing to add; `a` a
    `layers.linear.Pending` product: computed here, on a GPU plan's decode in the same launch), then
    ``y = rms_norm(s, weight)`` (None when `weight` is None). h, a: ``[num_tokens, hidden]`` of
    one dtype; weights ``[hidden]``. `gemma`: `rms_norm_gemma` for every norm. Returns (s, y)
    in h's dtype. `in_place` with `a` None: the C kernel may write y over h (s is then y too: for
    an h that nothing else reads, the one-call decode step's output).

    A GPU plan's kernel (`kernels.gpu.rowwise.Rowwise`) does it in one launch with the same
    roundings (s rounded to the dtype before its norm); otherwise these expressions, the
    reference, each norm on `kernel` as `rms_norm` takes it."""
    norm = rms_norm_gemma if gemma else rms_norm
    if a is None:
        return h, norm(h, weight, eps, kernel, out=h if in_place else None) if weight is not None else None
    if isinstance(a, Pending):  # (a GPU plan's decode: the product in the same launch)
        out = a.add_norm(h, weight, eps, gemma, a_weight)
        if out is not None:
            return out
        a = a.value()
    if hasattr(kernel, "add_rms_norm"):
        out = kernel.add_rms_norm(h, a, weight, eps, gemma=gemma, a_weight=a_weight)
        if out is not None:
            return out
        count_fallback("add_rms_norm")
    if a_weight is not None:
        a = norm(a, a_weight, eps, kernel)
    s = h + a
    return s, norm(s, weight, eps, kernel) if weight is not None else None
