"""Integer helpers for the host side of our Triton launches (grids, tiles, splits).

Triton's own ``triton.cdiv`` and ``triton.next_power_of_2`` are `ConstexprFunction`s (Triton
3.6-3.9): called from Python each unwraps its arguments first, about 3.5 us a call against 0.04
for the plain expression. A layer's eager pass makes about 45 such calls (its matmuls' splits and
grids, the norms', RoPE's and the activation's blocks): some 160 us of a small model's layer on
the host, while the GPU waits (`benchmarks/gpu_check.py`'s prefill line). Inside a kernel
(``@triton.jit``) Triton's own stay: they fold at compile time.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, n >= 0 (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
