"""Quantized weights: how a linear layer holds its weight and multiplies by it.

- `ggml`: GGUF's block formats (Q4_0 .. Q6_K) de-quantized to float (the reference);
- `qweight`: those blocks kept as integer codes for our C kernel (`kernels/qmatmul.c`);
- `torch_int4`: 4-bit blocks packed for PyTorch's int4 kernel (the PyTorch-only path);
- `methods`: the per-layer `LinearMethod` objects the model runner chooses at load.
"""
