"""Linear layers: ``y = x W^T + b``, with W held as its `LinearMethod` says (dense, GGUF codes
for our C kernel, or int4 for PyTorch's kernel; `layers.quantization.methods`)."""

from __future__ import annotations

import torch

from nextoken.layers.quantization.methods import (CodesMethod, DenseKernelMethod, DenseMethod, LinearMethod,
                                                  TorchInt4Method, dense_matmul, expand_int4)
from nextoken.layers.quantization.qweight import QuantWeight, dense_c_struct, dequantize_bf16


class Linear(torch.nn.Module):
    """A linear layer whose weight is set by the loader (no random initialisation).

    weight: ``[out_features, in_features]``; bias: ``[out_features]`` or None.
    forward: ``[num_tokens, in_features] -> [num_tokens, out_features]``, by ``method.apply``.

    `method` is chosen once, at load, by the execution plan (`nextoken.runner.plan`), and the
    loader stores the checkpoint tensor through `weight_loader`, the layer's hook (where tensor
    parallelism will cut its shard). After `set_qweight` the weight lives as GGUF codes
    (`qweight.QuantWeight`) and the dense weight is released; after `set_int4` as packed 4-bit
    parts (one per 4-bit GGUF tensor, two for Q8_0; their weights add up).

    Under tensor parallelism (`nextoken.distributed.sharding`) the layer holds one rank's slice
    of the weight and `combine`, when set, joins the ranks' outputs: an all-reduce (a row-parallel
    projection's partial products) or an all-gather of the columns (the vocabulary-parallel head).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.method: LinearMethod = DenseMethod()
        self.int4: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.qweight: QuantWeight | None = None
        self.bias_f32: torch.Tensor | None = None
        self._qweight_c = None
        self.few_rows = False  # its calls have few rows (the LM head): int4 never expands the weight
        self.float_out = False  # codes: float32 out, rounded as a bf16 output (the LM head's logits, widened anyway)
        self.combine = None  # tensor parallel: [T, out] of this rank -> the joined output
        self.lora = None  # its LoRA adapters (`lora.LoRASlots`), once one targets it
        self.gemv_rows = 0  # a GPU plan's: calls of at most this many rows run our GEMV (`kernels.gpu.gemv`)
        self.gemv_launch = None  # a GPU plan's: how the GEMV launches on this weight shape (None: its default)
        self.silu_rows = 0  # a GPU plan's, for a SwiGLU down projection: up to this many rows, SiLU inside the GEMV
        self.norm_rows = 0  # a GPU plan's, for o and down: up to this many rows, the add and norm after it inside the GEMV
        self.skinny_rows: tuple[int, ...] = ()  # a GPU plan's: row counts (5-64, rounded up) on `kernels.gpu.skinny`
        self.skinny_launch = None  # a GPU plan's: how that GEMM launches on this weight shape (None: its default)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.lora is not None and self.lora.batch.ids:  # the adapters' tokens of this pass
            y = self.lora.add(x, y)
        return y if self.combine is None else self.combine(y)

    def weight_loader(self, t, plan) -> None:
        """The loader's hook: store checkpoint tensor `t` (`loader.weights.CheckpointTensor`,
        ``[out, in]``) in the form `plan` chooses for its type and shape."""
        plan.linear_method(t.type_name, self.out_features, self.in_features).load(self, t)

    def set_qweight(self, qweight: QuantWeight, method: CodesMethod) -> None:
        """Keep the weight as GGUF codes (`qweight.QuantWeight`), multiplied by our C kernel
        (`method`, which holds it); the dense weight is released."""
        self.qweight = qweight
        self._qweight_c = None
        self.weight = None
        self.method = method

    def row_subset(self, ranges: list[tuple[int, int]]) -> Linear | None:
        """A layer of this one's output rows in `ranges` (``[start, stop)`` pairs, multiples of 16
        for codes), stacked in that order, on the same method; None for a weight held as int4
        parts. A single range of codes shares this layer's memory; more are copied."""
        if self.int4 is not None:
            return None
        out = Linear(self.in_features, sum(b - a for a, b in ranges), self.bias is not None, self.dtype)
        out.method, out.few_rows, out.float_out = self.method, self.few_rows, self.float_out
        if self.bias is not None:
            out.bias = torch.nn.Parameter(torch.cat([self.bias[a:b] for a, b in ranges]), requires_grad=False)
        if self.qweight is not None:
            parts = [self.qweight.row_range(a, b) for a, b in ranges]
            out.set_qweight(parts[0] if len(parts) == 1 else QuantWeight.cat(parts), self.method)
        else:
            out.weight = torch.nn.Parameter(torch.cat([self.weight[a:b] for a, b in ranges]).contiguous(),
                                            requires_grad=False)
        return out

    def qweight_c(self):
        """The kernel's view of the weight (its codes, or the dense bf16 weight the dense kernel
        multiplies: `DenseKernelMethod`) with this layer's bias (float32), built once."""
        if self._qweight_c is None:
            if self.bias is not None:
                self.bias_f32 = self.bias.float()
            self._qweight_c = (self.qweight.c_struct(self.bias_f32) if self.qweight is not None
                               else dense_c_struct(self.weight, self.bias_f32))
        return self._qweight_c

    @property
    def on_kernel(self) -> bool:
        """Whether our C kernel holds this weight (codes, or dense bf16): the one-call decode step
        can run it."""
        return isinstance(self.method, (CodesMethod, DenseKernelMethod))

    def set_int4(self, parts: list[tuple[torch.Tensor, torch.Tensor]], keep_dense: bool = False) -> None:
        """Keep the weight as int4 parts ``(packed, scales_and_zeros)`` (`torch_int4.pack_int4`),
        and with `keep_dense` the dense weight too, which then serves calls of many rows."""
        self.int4 = list(parts)
        if not keep_dense:
            self.weight = None
        self.method = TorchInt4Method(keep_dense)

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` as a dense tensor (expanded when quantized)."""
        if self.weight is not None:
            return self.weight
        if self.qweight is not None:
            return dequantize_bf16(self.qweight, lib=self.method.lib).to(self.dtype)
        return expand_int4(self.int4)

    @property
    def nbytes(self) -> int:
        dense = self.weight.nbytes if self.weight is not None else 0
        packed = sum(t.nbytes for part in self.int4 for t in part) if self.int4 is not None else 0
        packed += self.qweight.nbytes if self.qweight is not None else 0
        return dense + packed + (self.bias.nbytes if self.bias is not None else 0)


class FusedLinear:
    """Dense linears over one input run as one matmul (vLLM's ``QKVParallelLinear`` and
    ``MergedColumnParallelLinear``): their weights (and biases) concatenated in one tensor, each
    linear's own weight re-pointed to its rows of it, so no memory is added and each still runs
    alone (a pass whose rows carry LoRA adapters on one of them: `usable`). A GPU plan's
    (`runner.plan.ExecutionPlan.settle`): a decode step's q, k and v (or gate and up) in one
    launch that streams their weights together, instead of three small latency-bound ones.

    ``fused(x)``: x ``[T, in]`` -> one ``[T, out_i]`` column view per linear, of one
    ``[T, sum out_i]`` product."""

    def __init__(self, linears: list[Linear]):
        self.linears, self.sizes = linears, [lin.out_features for lin in linears]
        self.weight = torch.cat([lin.weight.data for lin in linears])
        for lin, part in zip(linears, self.weight.split(self.sizes)):
            lin.weight.data = part
        self.bias = None
        self.gemv_rows, self.gemv_launch = 0, None  # as `Linear.gemv_rows`, `Linear.gemv_launch`
        self.rope_rows = 0  # a GPU plan's, for a fused q/k/v: up to this many rows, RoPE inside the GEMV
        self.skinny_rows: tuple[int, ...] = ()  # as `Linear.skinny_rows`
        self.skinny_launch = None  # as `Linear.skinny_launch`
        if linears[0].bias is not None:
            self.bias = torch.cat([lin.bias.data for lin in linears])
            for lin, part in zip(linears, self.bias.split(self.sizes)):
                lin.bias.data = part

    @classmethod
    def of(cls, linears: list[Linear]) -> FusedLinear | None:
        """The fused form of `linears`, or None unless every one is dense (`DenseMethod`, not a
        subclass) on one input size, dtype and device, unsplit (no tensor parallelism), with a
        bias on all or none."""
        first = linears[0]
        ok = all(type(lin.method) is DenseMethod and lin.combine is None and lin.in_features == first.in_features
                 and lin.weight.dtype == first.weight.dtype and lin.weight.device == first.weight.device
                 and (lin.bias is None) == (first.bias is None) for lin in linears)
        return cls(linears) if ok else None

    def usable(self) -> bool:
        """Whether this pass can take the fused matmul: no adapter of this pass on any part."""
        return not any(lin.lora is not None and lin.lora.batch.ids for lin in self.linears)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return dense_matmul(x, self.weight, self.bias, self.gemv_rows, self.skinny_rows, self.gemv_launch,
                            self.skinny_launch).split_with_sizes(self.sizes, dim=-1)


def silu_mul_down(down: Linear, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``down(silu(gate) * up)`` in one launch of a GPU plan's GEMV (`kernels.gpu.gemv.gemv` with
    its `up`: SwiGLU's product taken as it reads its input, with the roundings of
    `kernels.gpu.rowwise.act_and_mul`, so the values of the two launches), for a pass of at most
    ``down.silu_rows`` rows (the plan's timed choice for the shape, `gemv.choose_silu`; 0 off a
    GPU plan) on a dense down projection with no adapter in this pass. gate, up: ``[T,
    intermediate]``, contiguous rows (the halves of a fused gate/up product are). None otherwise:
    the caller runs both."""
    m = gate.shape[0]
    if gate.dim() != 2 or not 0 < m <= down.silu_rows or type(down.method) is not DenseMethod \
            or down.combine is not None or (down.lora is not None and down.lora.batch.ids):
        return None
    from nextoken.kernels import count_fallback
    from nextoken.kernels.gpu.gemv import Refused, gemv

    try:
        return gemv(gate, down.weight, down.bias, launch=down.gemv_launch, up=up)
    except Refused:
        count_fallback("gemv")
        return None


class Pending:
    """A product whose output only goes into the residual add and RMSNorm after it, left for that
    call (`layers.norm.add_rms_norm`): ``linear(x)`` (with `up`: of ``silu(x) * up``, SwiGLU's
    down projection), which a GPU plan's decode of at most ``linear.norm_rows`` rows computes
    with the add and the norm in one launch (`add_norm`: `kernels.gpu.gemv.gemv_add_norm`, the
    values of the three), and anything else computes as its caller would have (`value`: `plain`)."""

    __slots__ = ("linear", "x", "plain", "up")

    def __init__(self, linear: Linear, x: torch.Tensor, plain, up: torch.Tensor | None = None):
        self.linear, self.x, self.plain, self.up = linear, x, plain, up

    def value(self) -> torch.Tensor:
        """The product ``[T, out]``, as the caller's own code computes it."""
        return self.plain()

    def add_norm(self, h: torch.Tensor, weight: torch.Tensor | None, eps: float, gemma: bool,
                 a_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``add_rms_norm(h, self.value(), weight, eps, gemma=gemma, a_weight=a_weight)`` in one
        launch (s, y), or None where the kernel refuses the call (counted)."""
        from nextoken.kernels import count_fallback
        from nextoken.kernels.gpu.gemv import Refused, gemv_add_norm

        lin = self.linear
        try:
            return gemv_add_norm(self.x, lin.weight, lin.bias, h, weight, eps, gemma, a_weight, launch=lin.gemv_launch,
                                 up=self.up)
        except Refused:
            count_fallback("gemv_add_norm")
            return None


def deferred(linear: Linear, x: torch.Tensor, plain, up: torch.Tensor | None = None,
             defer: bool = True) -> torch.Tensor | Pending:
    """``plain()`` (the caller's computation of ``linear(x)``, or of ``linear(silu(x) * up)``
    with `up`), or, with `defer`, where a GPU plan's decode puts the add and the norm after it in
    the GEMV's launch (at most ``linear.norm_rows`` rows, the plan's timed choice,
    `gemv.choose_norm`; a dense weight with no adapter in this pass and no tensor-parallel
    combine), a `Pending` for the next `layers.norm.add_rms_norm`. `defer`: the output goes to
    that call alone (not to a tracer)."""
    m = x.shape[0]
    if defer and x.dim() == 2 and 0 < m <= linear.norm_rows and type(linear.method) is DenseMethod \
            and linear.combine is None and not (linear.lora is not None and linear.lora.batch.ids):
        return Pending(linear, x, plain, up)
    return plain()


def qkv_rope(qkv: FusedLinear, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store, head_dim: int,
             q_features: int, kv_features: int) -> torch.Tensor | None:
    """The fused q/k/v product ``[T, q + 2 kv features]`` with RoPE on its query and key heads,
    and the keys and values written into `store`'s paged cache (`layers.attention.KVStore`, or
    None), in one launch of a GPU plan's GEMV (`kernels.gpu.gemv.gemv_rope`: the values of the
    product and then `kernels.gpu.rowwise.apply_rope_qk`), for a pass of at most
    ``qkv.rope_rows`` rows (the plan's timed choice; 0 off a GPU plan) with no adapter in it.
    cos, sin: the layer's RoPE tables ``[T, rope_dim]``. None otherwise: the caller runs both."""
    m = x.shape[0]
    if x.dim() != 2 or not 0 < m <= qkv.rope_rows or not qkv.usable():
        return None
    from nextoken.kernels import count_fallback
    from nextoken.kernels.gpu.gemv import Refused, gemv_rope

    try:
        return gemv_rope(x, qkv.weight, qkv.bias, cos, sin, head_dim, q_features, kv_features, store,
                         launch=qkv.gemv_launch)
    except Refused:
        count_fallback("gemv_rope")
        return None


def gemv_targets(model) -> list:
    """The matmuls a GPU plan's GEMV and split-K GEMM may take (`kernels.gpu.gemv`,
    `kernels.gpu.skinny`): every fused projection and every dense linear outside one (o, down, the
    LM head), each with ``weight``, ``bias``, ``gemv_rows``, ``gemv_launch``, ``skinny_rows`` and
    ``skinny_launch``."""
    fused = [f for m in model.modules() for f in (getattr(m, "qkv", None), getattr(m, "gate_up", None)) if f]
    inside = {id(lin) for f in fused for lin in f.linears}
    return fused + [m for m in model.modules() if isinstance(m, Linear) and type(m.method) is DenseMethod
                    and m.weight is not None and m.combine is None and id(m) not in inside]
