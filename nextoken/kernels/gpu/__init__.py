"""Our GPU kernels, written in Triton (Tillet et al. 2019) and compiled by Triton on first use.

`attention`: paged attention for prefill chunks and decodes; `batch_invariant`: the matmul and
RMSNorm of the batch-invariant plan (``--batch-invariant``). Importing this package imports
nothing; each module imports Triton, which comes with PyTorch's CUDA builds. On a machine
without a GPU the same source runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported), which is how the tests check it against the float32 reference.
"""
