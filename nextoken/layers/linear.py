"""Linear layers: ``y = x W^T + b``, with W dense, kept as GGUF codes (`qweight`, our C
kernel) or packed as int4 (`quant_linear`, PyTorch's kernel: the path under --enforce-eager)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextoken.layers.quant_linear import int4_linear, int4_unpack
from nextoken.layers.qweight import QuantWeight, dequantize_bf16, qmatmul


class Linear(torch.nn.Module):
    """A linear layer whose weight is set by the loader (no random initialisation).

    weight: ``[out_features, in_features]``; bias: ``[out_features]`` or None.
    forward: ``[num_tokens, in_features] -> [num_tokens, out_features]``.

    After `set_int4` the weight lives as packed 4-bit parts (one per 4-bit GGUF tensor, two for
    Q8_0; their weights add up) and the dense weight is released: PyTorch's path (under
    --enforce-eager, or without a C compiler). Calls of few rows run the int4 kernel; larger
    calls expand the weight to bf16 for that call only (`quant_linear.int4_unpack`).

    After `set_qweight` (the default) the weight lives as GGUF codes (`qweight.QuantWeight`) and
    our C kernel serves every call, prefill chunks included: with two tiles per pass it beats
    expanding the weight to bf16 for one matmul at every row count measured (1 to 512 rows,
    `benchmarks/qmatmul.py`). The expansion stays as the path for a kernel that is unavailable.
    """

    INT4_MAX_TOKENS = 24  # int4 kernel up to this many rows when there is no dense copy
    INT4_MAX_TOKENS_WITH_DENSE = 12  # and with one (crossover measured on SmolLM2's shapes)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.int4: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.qweight: QuantWeight | None = None
        self.bias_f32: torch.Tensor | None = None
        self.int4_only = False  # always the quantized kernel, never expanded (the LM head: few rows)

    def set_qweight(self, qweight: QuantWeight) -> None:
        """Keep the weight as GGUF codes (`qweight.QuantWeight`), multiplied by our C kernel;
        the dense weight is released."""
        self.qweight = qweight
        self._qweight_c = None
        self.weight = None

    def qweight_c(self):
        """The kernel's view of the codes with this layer's bias (float32), built once."""
        if self._qweight_c is None:
            if self.bias is not None:
                self.bias_f32 = self.bias.float()
            self._qweight_c = self.qweight.c_struct(self.bias_f32)
        return self._qweight_c

    def set_int4(self, parts: list[tuple[torch.Tensor, torch.Tensor]], keep_dense: bool = False) -> None:
        """Keep the weight as int4 parts ``(packed, scales_and_zeros)`` (`quant_linear.pack_int4`),
        and with `keep_dense` the dense weight too, which then serves calls of more than
        `INT4_MAX_TOKENS_WITH_DENSE` rows (faster than expanding the weight every call)."""
        self.int4 = list(parts)
        if not keep_dense:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            y = qmatmul(x, self.qweight, c=self.qweight_c())
            if y is not None:
                return y
            # no kernel: expanded into a scratch buffer, used at once
            return F.linear(x, dequantize_bf16(self.qweight, scratch=True).to(self.dtype), self.bias)
        if self.int4 is None:
            return F.linear(x, self.weight, self.bias)
        limit = self.INT4_MAX_TOKENS if self.weight is None else self.INT4_MAX_TOKENS_WITH_DENSE
        if x.shape[0] <= limit or (self.int4_only and self.weight is None):
            y = int4_linear(x, *self.int4[0])
            for part in self.int4[1:]:
                y = y + int4_linear(x, *part)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dense_weight(), self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` as a dense tensor (expanded from int4 when packed)."""
        if self.weight is not None:
            return self.weight
        if self.qweight is not None:
            return dequantize_bf16(self.qweight).to(self.dtype)
        w = int4_unpack(*self.int4[0])
        for part in self.int4[1:]:
            w = w + int4_unpack(*part)
        return w

    @property
    def nbytes(self) -> int:
        dense = self.weight.nbytes if self.weight is not None else 0
        packed = sum(t.nbytes for part in self.int4 for t in part) if self.int4 is not None else 0
        packed += self.qweight.nbytes if self.qweight is not None else 0
        return dense + packed + (self.bias.nbytes if self.bias is not None else 0)
