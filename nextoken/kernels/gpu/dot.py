"""The tile product our Triton kernels share: ``a @ b`` with float32 sums, and under Triton's
interpreter a product whose every output is the same function of its row and column.

Compiled, it is ``tl.dot`` in IEEE precision (tensor-core products of bf16 operands, IEEE float32,
never TF32, of float32 ones). Under the interpreter (``TRITON_INTERPRET=1``: the CPU tests),
``tl.dot`` is NumPy's ``matmul``, that is the BLAS that NumPy ships, whose kernels need not give a
row the same bits at another place in the tile: OpenBLAS 0.3.31's Haswell ``sgemm`` (AVX2 CPUs
such as AMD Zen 3) gives a 64 x 64 product's row different last bits when the row moves down
the tile, while its SkylakeX kernel (AVX-512) does not. The batch-invariance tests would then pass
or fail with the CPU. So the interpreter's branch widens both operands to float32 and sums the
broadcast products over K with ``tl.sum`` (NumPy's ``sum`` over the middle axis: the same
additions for every row and column), as a GPU's tile product does for each output.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_f32(a, b, INTERPRET: tl.constexpr):
    """``a [M, K] @ b [K, N]`` as float32 ``[M, N]``: compiled, ``tl.dot`` (IEEE); `INTERPRET`,
    the float32 products of the widened operands (exact for bf16 ones, as the tensor cores')
    summed over K in an order that depends only on the tile's shape."""
    if INTERPRET:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    else:
        return tl.dot(a, b, input_precision="ieee")
