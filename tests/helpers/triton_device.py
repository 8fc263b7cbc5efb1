"""Where the Triton kernels' tests run: compiled on a GPU when benchmarks/gpu_check.py runs them
there (``TRITON_INTERPRET=0``), else the kernels' own source under Triton's interpreter on CPU
tensors (``TRITON_INTERPRET=1``, set by tests/conftest.py)."""

from __future__ import annotations

import os

import torch

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def randn(*shape, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values times `scale`, drawn from `seed` on the CPU (the same on any device),
    in `dtype` on `DEV`."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEV)
