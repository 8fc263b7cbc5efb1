"""How a `Linear` holds its weight and computes ``y = x W^T + b``: one `LinearMethod` object per
layer, chosen at load by the model runner's execution plan (`nextoken.runner.plan`) and fixed
from then on.

- `DenseMethod`: the weight as a dense tensor in the model's dtype; PyTorch's matmul.
- `DenseKernelMethod`: a dense bf16 weight on our C kernel (``kernels/dense_bf16.c``) for calls
  of few rows (decode, the LM head), PyTorch's matmul for larger ones (in float32 where the CPU
  has no bf16 matmul instructions: PyTorch's bf16 matmul there is several times slower).
- `CodesMethod`: GGUF block codes (`qweight.QuantWeight`) on our C kernel (``kernels/qmatmul.c``,
  int8 activations, AVX-512 VNNI), for every call, prefill included.
- `TorchInt4Method`: 4-bit blocks (and Q8_0 as two 4-bit halves) packed for PyTorch's int4 kernel
  (`torch_int4`): the PyTorch-only path (``enforce_eager``, or no C compiler).

Each method's `load` is the layer's weight loader for that form: it reads the checkpoint tensor
(`nextoken.loader.weights.CheckpointTensor`) a chunk of rows at a time, applies the tensor's row
mapping (Q/K un-permutation) and stores the result on the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextoken.errors import ModelLoadError
from nextoken.kernels import bf16_matmul_native, count_fallback
from nextoken.layers.quantization.qweight import QuantWeight, dequantize_bf16, gguf_codes, kernel_matmul, qmatmul
from nextoken.layers.quantization.torch_int4 import empty_int4, int4_groups, int4_linear, int4_unpack, pack_int4

LOAD_CHUNK_ROWS = 4096  # rows converted at a time (a multiple of 64, the int4 packing block)


class LinearMethod:
    """``apply(layer, x)``: ``x [T, in] -> [T, out]``; ``load(layer, t)``: store checkpoint tensor
    `t` on `layer` in this form."""

    name = "?"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load(self, layer, t) -> None:
        raise NotImplementedError


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv_rows: int = 0,
                 skinny_rows: tuple[int, ...] = (), gemv_launch=None, skinny_launch=None) -> torch.Tensor:
    """``x W^T + b`` on PyTorch's matmul, or (a GPU plan's choices per weight shape, timed at load)
    for a call of at most `gemv_rows` rows (`kernels.gpu.gemv.choose`; 0: never) on our Triton
    GEMV launched as `gemv_launch` (`kernels.gpu.gemv.Launch`; None: its default), and for one of
    5-64 rows whose count rounds up to one of `skinny_rows` (`kernels.gpu.skinny.choose`) on our
    split-K GEMM launched as `skinny_launch` (`kernels.gpu.skinny.Launch`; None: its default);
    such a call the kernel does not take (it raises `kernels.gpu.gemv.Refused`) runs PyTorch's, a
    counted fallback."""
    m = x.shape[0]
    if x.dim() == 2 and 0 < m <= gemv_rows:
        from nextoken.kernels.gpu.gemv import Refused, gemv

        try:
            return gemv(x, weight, bias, launch=gemv_launch)
        except Refused:
            count_fallback("gemv")
    elif x.dim() == 2 and skinny_rows:
        from nextoken.kernels.gpu import skinny
        from nextoken.kernels.gpu.gemv import Refused

        if skinny.MIN_ROWS <= m <= skinny.MAX_ROWS and skinny.bucket(m) in skinny_rows:
            try:
                return skinny.skinny(x, weight, bias, launch=skinny_launch)
            except Refused:
                count_fallback("skinny")
    return F.linear(x, weight, bias)


class DenseMethod(LinearMethod):
    name = "dense"

    def apply(self, layer, x):
        return dense_matmul(x, layer.weight, layer.bias, layer.gemv_rows, layer.skinny_rows, layer.gemv_launch,
                            layer.skinny_launch)

    def load(self, layer, t) -> None:
        layer.weight = store_dense(layer.weight, t, layer.dtype)
        layer.method = self


class InvariantMethod(DenseMethod):
    """Dense weights through the batch-invariant Triton matmul (`kernels.gpu.batch_invariant.linear`:
    one tile shape for every number of rows, no split-K), a batch-invariant plan's linears."""

    name = "batch-invariant triton"

    def apply(self, layer, x):
        from nextoken.kernels.gpu.batch_invariant import linear

        return linear(x, layer.weight, layer.bias)


def store_dense(param: torch.nn.Parameter | None, t, dtype: torch.dtype) -> torch.nn.Parameter:
    """Checkpoint tensor `t` as a dense parameter in `dtype`: the file's own pages when it stores
    it so (`CheckpointTensor.stored`: no copy), else `param` (or a fresh one) holding the values:
    the converted tensor itself when it is a whole tensor of its own (`param`'s untouched memory is
    freed, never faulted in), else a copy of them."""
    view = t.stored(dtype)
    if view is not None:
        return torch.nn.Parameter(view, requires_grad=False)
    dense = t.dense(dtype)
    if param is None or param.dtype != dtype:  # released by an earlier form: a fresh one
        param = torch.nn.Parameter(torch.empty(t.shape, dtype=dtype), requires_grad=False)
    if _owns_storage(dense) and dense.shape == param.shape and dense.device == param.device:
        param.data = dense
    else:
        param.data.copy_(dense)
    return param


def _owns_storage(t: torch.Tensor) -> bool:
    """`t` is contiguous and is the whole of its storage (no view of a larger tensor)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _required(lib, method: str):
    """The kernel library a method runs on: the plan binds it, or the model does not load."""
    if lib is None:
        raise ModelLoadError(f"the execution plan chose the {method!r} method without its kernel library")
    return lib


class DenseKernelMethod(DenseMethod):
    """A dense bf16 weight on our kernel (``kernels/dense_bf16.c``, through ``qmatmul`` with a
    ``bits == 16`` weight; `lib`: the library the execution plan resolved) for calls of up to
    `MAX_ROWS` rows and for a layer with ``few_rows`` (the LM head); PyTorch's matmul beyond,
    computed in float32 and rounded once on a CPU without bf16 matmul instructions
    (`kernels.bf16_matmul_native`), which is what PyTorch's bf16 matmul computes, 4x faster there
    at 512 rows. The one-call decode step (`layers.native_decode`) runs the same kernel."""

    name = "dense-kernel"
    MAX_ROWS = 32  # the kernel up to here (a batch of decodes); crossover in benchmarks/dense_bf16.py

    def __init__(self, lib):
        self.lib = _required(lib, self.name)

    def apply(self, layer, x):
        if x.dtype == torch.bfloat16 and (x.shape[0] <= self.MAX_ROWS or layer.few_rows):
            return kernel_matmul(x, layer.qweight_c(), layer.out_features, lib=self.lib)
        if x.dtype != torch.bfloat16 or bf16_matmul_native():
            return F.linear(x, layer.weight.to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))
        y = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        return y.to(x.dtype)


class CodesMethod(LinearMethod):
    """Our kernel on GGUF codes; `lib`: the ``qmatmul`` library the execution plan resolved.
    Should the kernel not take a call (an activation dtype it has no path for), the weight is
    expanded to bf16 for that call only, and the fallback is counted (`kernels.count_fallback`)."""

    name = "codes"

    def __init__(self, lib):
        self.lib = _required(lib, self.name)

    def apply(self, layer, x):
        wide = layer.float_out and x.dtype == torch.bfloat16  # float32 out, rounded as bf16 (the LM head)
        y = qmatmul(x, layer.qweight, c=layer.qweight_c(), lib=self.lib, out_dtype=torch.float32 if wide else None,
                    rounded=wide)
        if y is not None:
            return y
        count_fallback(f"codes matmul on {x.dtype}")
        bias = layer.bias.to(x.dtype) if layer.bias is not None else None
        return F.linear(x, dequantize_bf16(layer.qweight, scratch=True, lib=self.lib).to(x.dtype), bias)

    def load(self, layer, t) -> None:
        layer.set_qweight(load_codes(t), self)


class TorchInt4Method(LinearMethod):
    """PyTorch's int4 kernel for calls of few rows; larger calls use the dense copy when kept
    (`keep_dense`), else expand the weight to bf16 for that call (`torch_int4.int4_unpack`).
    A layer with ``few_rows`` (the LM head: one row per sequence) always runs the int4 kernel."""

    name = "torch-int4"
    MAX_TOKENS = 24  # int4 kernel up to this many rows when there is no dense copy
    MAX_TOKENS_WITH_DENSE = 12  # and with one (crossover measured on SmolLM2's shapes)

    def __init__(self, keep_dense: bool = False):
        self.keep_dense = keep_dense

    def apply(self, layer, x):
        limit = self.MAX_TOKENS if layer.weight is None else self.MAX_TOKENS_WITH_DENSE
        if x.shape[0] <= limit or (layer.few_rows and layer.weight is None):
            y = int4_linear(x, *layer.int4[0])
            for part in layer.int4[1:]:
                y = y + int4_linear(x, *part)
            return y if layer.bias is None else y + layer.bias
        return F.linear(x, layer.dense_weight(), layer.bias)

    def load(self, layer, t) -> None:
        if self.keep_dense:
            DenseMethod().load(layer, t)
        layer.set_int4(load_int4(t, layer.dtype), self.keep_dense)


def load_codes(t) -> QuantWeight:
    """A block-quantized checkpoint tensor as `QuantWeight` codes: from the prepared-weights
    cache when the loader has one (`loader.prepared`), else packed by `pack_codes`."""
    if t.prepared is not None:
        return t.prepared.codes(t.name, *t.shape, lambda: pack_codes(t))
    return pack_codes(t)


def pack_codes(t) -> QuantWeight:
    """A block-quantized checkpoint tensor packed as `QuantWeight` codes, `LOAD_CHUNK_ROWS` rows
    at a time (a tensor with a row mapping, Q/K, in one go: the mapping needs every row)."""
    rows, cols = t.shape
    chunk = rows if t.maps_rows else LOAD_CHUNK_ROWS
    parts = []
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        plain = gguf_codes(t.raw(start, stop), t.type_name, stop - start, cols)
        if t.maps_rows:
            plain = plain.map_rows(t.map_rows)
        parts.append(QuantWeight.pack(plain))
    return parts[0] if len(parts) == 1 else QuantWeight.cat(parts)


def load_int4(t, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A 4-bit (or Q8_0) checkpoint tensor as int4 parts, `LOAD_CHUNK_ROWS` rows at a time so the
    int32 and float32 temporaries stay small (Q/K, with a row mapping, in one go)."""
    rows, cols = t.shape
    chunk = rows if t.maps_rows else LOAD_CHUNK_ROWS
    parts = None
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        groups = int4_groups(t.raw(start, stop), t.type_name, stop - start, cols)
        if parts is None:
            parts = [empty_int4(rows, cols, dtype) for _ in groups]
        for (q, scale, zero), (packed, sz) in zip(groups, parts):
            if t.maps_rows:
                q, scale, zero = (t.map_rows(x) for x in (q, scale, zero))
            packed[start:stop], sz[:, start:stop] = pack_int4(q, scale, zero, dtype)
    return parts


def expand_int4(parts) -> torch.Tensor:
    """The dense weight ``[out, in]`` that int4 parts add up to."""
    w = int4_unpack(*parts[0])
    for part in parts[1:]:
        w = w + int4_unpack(*part)
    return w
