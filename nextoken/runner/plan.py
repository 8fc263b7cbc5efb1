"""The execution plan: which code runs each part of the model, decided once, at load.

The model runner builds one `ExecutionPlan` from the engine arguments and what this machine can
run, hands it to the loader (which stores each weight in the form the plan picks, through the
layers' weight-loader hooks) and logs it in one line (``--log-level info``):

- **linears**: per layer, a `LinearMethod` (`layers.quantization.methods`): GGUF codes on our C
  kernel (bf16, kernels on, a block format we map), PyTorch's int4 kernel (bf16 without our
  kernels, 4-bit or Q8_0 blocks), dense bf16 on our kernel for few rows (bf16, kernels on:
  a Hugging Face folder's weights), or dense on PyTorch (everything else, and float32: the
  reference);
- **embedding**: codes (sharing them with a tied head), Q8_0 rows (PyTorch path), or dense;
- **device**: the CPU, or a GPU (``--device``, `runner.device`): on a GPU every weight is dense
  (GGUF blocks de-quantized at load), attention runs our Triton kernel, the sampler's draw our
  Triton one (`kernels.gpu.sampling`), and decode steps replay CUDA graphs
  (`runner.cuda_graphs`) unless ``enforce_eager``;
- **attention**: ``reference`` (plain float32 attention, the oracle), ``native`` (our C decode
  kernel reading the paged cache in place, blocked matmuls for prefill), ``torch`` (the same
  without the C kernel) or ``triton`` (`kernels.gpu.attention`: the GPU's; on the CPU only
  under Triton's interpreter, to test the GPU path); carried to the layers in
  `AttentionMetadata.backend`;
- **native decode**: whether single-token decodes (and the prefill of short prompts) run every
  layer in one C call (`layers.native_decode`), LoRA adapters included: bf16, an architecture
  it implements, every projection on our kernel (codes or dense bf16);
- **activations and norms**: the gated feed-forward's activation and the layers' RMSNorm on our
  C kernels (``kernels/activation.c``; bf16, kernels on), on a GPU with RoPE too on Triton
  (`kernels.gpu.rowwise`: one launch each instead of PyTorch's several small kernels), or
  PyTorch; the library handed to each SwiGLU MLP's ``act_kernel``, each Llama-style layer's
  ``norm_kernel`` (and ``qk_norm_kernel``, ``rope_kernel``) at load;
- **batch invariance** (``--batch-invariant``, the Triton attention's path: a GPU, or the CPU
  under Triton's interpreter with ``enforce_eager``): every linear on the batch-invariant Triton
  matmul and every RMSNorm on its row kernel (`kernels.gpu.batch_invariant`), the decode
  attention in one key split, sliding-window prefill chunks switching from the ring's keys to
  the pass's at a key tile's boundary, weights dense: a request's logits do not depend on what
  else is in its batch.

The plan binds: it resolves the kernel libraries once (`kernels.KernelSet`) and hands each
layer the handle it runs (a `CodesMethod` holds the ``qmatmul`` library, the MLP and norms the
``activation`` one, the attention metadata the attention ones, `NativeDecoder` the ``decode``
one, the sampler the ``sampling`` one). Shape limits of a kernel are checked here, at load, so a
chosen kernel takes every call; a call it still refuses runs PyTorch and is counted
(`kernels.count_fallback`: `LLMEngine.stats`, ``/metrics``, the inspector), never silently.

``enforce_eager`` fixes all of these to PyTorch at load (on a GPU: no CUDA graphs); nothing reads
the environment or a process-wide switch while the model runs. ``NEXTOKEN_NATIVE_KERNELS=0`` in the environment has
the same effect as a machine without a C compiler.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from nextoken.errors import InvalidRequest
from nextoken.kernels import KernelSet
from nextoken.kernels.decode_step import MAX_PREFILL_TOKENS
from nextoken.layers.quantization.methods import (CodesMethod, DenseKernelMethod, DenseMethod, InvariantMethod,
                                                  LinearMethod, TorchInt4Method)
from nextoken.layers.quantization.qweight import qweight_supported
from nextoken.layers.quantization.torch_int4 import int4_supported
from nextoken.runner.device import CPU, Device

log = logging.getLogger("nextoken.plan")
DENSE_TYPES = ("F32", "F16", "BF16")  # dense checkpoint tensors (a safetensors tensor reads as F32)


@dataclass
class ExecutionPlan:
    """What runs where. Build it with `choose`; `native_decode` is settled after loading, when
    every linear's method is known (`settle`)."""

    dtype: torch.dtype
    codes: bool  # block-quantized weights as codes on our C kernel
    torch_int4: bool  # else 4-bit/Q8_0 blocks on PyTorch's int4 kernel
    dense_weights: bool  # with torch_int4: keep a dense copy too
    attention: str  # "reference" | "native" | "torch" | "triton"
    device: Device = CPU
    cuda_graphs: bool = False  # decode steps replay captured CUDA graphs (a GPU, not enforce_eager)
    native_decode: bool = False
    native_activations: bool = False
    quantization: str | None = None  # a folder's weights quantized at load to this format (`loader.quantize`)
    reasons: dict[str, str] = field(default_factory=dict)  # why a fast path is off
    kernels: KernelSet = field(default_factory=KernelSet)  # the libraries resolved once; None where PyTorch runs
    weights: object = None  # the arena the linear weights live in (`runner.huge_pages.WeightsArena`), once placed:
    # its part of the line is read when the plan is described (a read of /proc/self/smaps: 4 ms in a fresh
    # process, far more in one with thousands of mappings, so not on every load)
    batch_invariant: bool = False  # linears and norms on `kernels.gpu.batch_invariant`, one key split per decode
    rowwise: bool = False  # norms, activations and RoPE on `kernels.gpu.rowwise` (a GPU, kernels on)
    fused: bool = False  # q/k/v and gate/up each one matmul (`layers.linear.FusedLinear`; a GPU, kernels on)
    gemv: bool = False  # decode matmuls of few rows on `kernels.gpu.gemv` where it measures faster (a GPU, kernels on)
    gemv_shapes: tuple[int, int] = (0, 0)  # (weight shapes it took, shapes timed), once settled
    gemv_times: dict = field(default_factory=dict)  # {(shape, bias): {launch or "torch": seconds at a row}} as timed
    silu_rows: dict = field(default_factory=dict)  # {down shape: rows with SiLU inside its GEMV}, once settled
    silu_times: dict = field(default_factory=dict)  # {down shape: {"fused" | "apart": seconds at a row}} as timed
    rope_rows: dict = field(default_factory=dict)  # {q/k/v shape: rows with RoPE inside its GEMV}, once settled
    rope_times: dict = field(default_factory=dict)  # {q/k/v shape: {"fused" | "apart": seconds at a row}} as timed
    norm_rows: dict = field(default_factory=dict)  # {o or down shape: rows with the add and norm after it inside its GEMV}
    norm_times: dict = field(default_factory=dict)  # {o or down shape: {"fused" | "apart": seconds at a row}} as timed
    skinny: bool = False  # bf16 decode matmuls of 5-64 rows on `kernels.gpu.skinny` where it measures faster
    skinny_shapes: tuple[int, int] = (0, 0)  # (weight shapes it took at some row count, shapes timed)
    skinny_times: dict = field(default_factory=dict)  # {(shape, bias): {launch or "torch": seconds at 64 rows}}
    triton_sampling: bool = False  # the sampler's draw on `kernels.gpu.sampling` (a GPU, kernels on)
    sampling_rows: int = 1  # from how many rows it takes a draw (0: none), once settled
    sampling_times: dict = field(default_factory=dict)  # {rows: (Triton's, PyTorch's) seconds} as timed at load
    tilings: object | None = None  # the Triton attention's tiles as timed on this GPU (`kernels.gpu.attention.Tilings`)
    tiling_times: dict = field(default_factory=dict)  # {"decode" or "prefill": {tiles: seconds}, "join": ...} at load

    @classmethod
    def choose(cls, dtype: torch.dtype, enforce_eager: bool = False, reference_attention: bool = False,
               keep_quantized: bool = True, dense_weights: bool = False,
               quantization: str | None = None, device: Device = CPU,
               attention_backend: str = "auto", batch_invariant: bool = False) -> ExecutionPlan:
        """The plan for a model in `dtype` on `device`. `keep_quantized`: block-quantized
        weights stay quantized (bf16 on the CPU only; float32 and a GPU de-quantize everything).
        `quantization`: a Hugging Face folder's weights are quantized at load to this format (the
        CPU's kernels). `attention_backend`: ``auto`` or one of ``native``, ``torch``,
        ``triton`` (`EngineArgs.attention_backend`). `batch_invariant`: see the module docstring.
        Raises `InvalidRequest` for a choice the device cannot run."""
        if batch_invariant:
            _check_batch_invariant(device, enforce_eager, reference_attention, attention_backend, quantization)
        if device.is_cuda:
            plan = cls._on_gpu(dtype, enforce_eager, reference_attention, quantization, device, attention_backend)
            plan.batch_invariant = batch_invariant
            return plan
        reasons = {}
        ks = KernelSet.resolve(not enforce_eager)
        native = ks != KernelSet()
        if enforce_eager:
            reasons["kernels"] = "enforce_eager"
        elif not native:
            reasons["kernels"] = "NEXTOKEN_NATIVE_KERNELS=0 or no C compiler"
        quantized = keep_quantized and dtype == torch.bfloat16 and not batch_invariant
        codes = quantized and ks.qmatmul is not None
        if quantized and native and not codes:
            reasons["codes"] = "the qmatmul kernel did not build"
        elif codes and not ks.qmatmul.qmatmul_vectorized():
            loop = ks.qmatmul.qmatmul_loop().decode()
            reasons["VNNI"] = f"no AVX-512 VNNI in this build: the codes run the kernel's {loop} loop"
        attention = _cpu_attention(reference_attention, attention_backend, ks)
        activations = dtype == torch.bfloat16 and ks.activation is not None
        return cls(dtype, codes, quantized and not codes, dense_weights, attention, device,
                   native_activations=activations, quantization=quantization, reasons=reasons, kernels=ks,
                   batch_invariant=batch_invariant)

    @classmethod
    def _on_gpu(cls, dtype, enforce_eager, reference_attention, quantization, device, attention_backend):
        """A GPU's plan: dense weights on PyTorch's matmuls (cuBLAS; our GEMV for 1-4 rows and
        split-K GEMM for 5-64 where they time faster), Triton attention (or the float32
        reference), Triton's norms, activations and RoPE (PyTorch's with the reference or
        `enforce_eager`), the sampler's draw on Triton (PyTorch's with `enforce_eager`), CUDA
        graphs for decode steps unless `enforce_eager`."""
        if quantization is not None:
            raise InvalidRequest(f"--quantization {quantization} packs weights for the CPU's kernels; on a GPU the "
                                 "weights run dense (bf16)", "quantization")
        if attention_backend not in ("auto", "triton"):
            raise InvalidRequest(f"attention_backend {attention_backend} runs on the CPU; a GPU runs triton (or "
                                 "--reference-attention)", "attention_backend")
        attention = "reference" if reference_attention else "triton"
        reasons = {"CUDA graphs": "enforce_eager"} if enforce_eager else {}
        return cls(dtype, False, False, False, attention, device, cuda_graphs=not enforce_eager, reasons=reasons,
                   rowwise=not enforce_eager and not reference_attention, fused=not enforce_eager,
                   gemv=not enforce_eager, skinny=not enforce_eager, triton_sampling=not enforce_eager)

    # -- per layer ------------------------------------------------------------------------
    def linear_method(self, type_name: str, rows: int, cols: int) -> LinearMethod:
        """The method for a linear weight of GGML type `type_name` and shape ``[rows, cols]``."""
        if self.batch_invariant:
            return InvariantMethod()
        if self.codes and qweight_supported(type_name, rows, cols):
            return CodesMethod(self.kernels.qmatmul)
        if self.torch_int4 and int4_supported(type_name, rows, cols, self.dtype):
            return TorchInt4Method(self.dense_weights)
        if self.dense_kernel and type_name in DENSE_TYPES:
            return DenseKernelMethod(self.kernels.qmatmul)
        return DenseMethod()

    @property
    def dense_kernel(self) -> bool:
        """Dense weights on our kernel: bf16 and the ``qmatmul`` library built."""
        return self.dtype == torch.bfloat16 and self.kernels.qmatmul is not None

    def embedding_form(self, type_name: str, rows: int, cols: int) -> str:
        """``"codes"``, ``"q8_0"`` (int8 rows and scales, the PyTorch path) or ``"dense"``."""
        if self.codes and qweight_supported(type_name, rows, cols):
            return "codes"
        if self.torch_int4 and not self.dense_weights and type_name == "Q8_0":
            return "q8_0"
        return "dense"

    def settle(self, model, tensor_parallel: bool = False) -> None:
        """After loading: hand the row-wise kernels (activation, RMSNorm) to every SwiGLU or GeGLU MLP and
        Llama-style layer; check the decode attention kernel against the model's head shapes;
        decide whether the one-call C decode step runs `model` (bf16, an architecture and head
        shapes it implements, every projection as codes, the kernel
        builds, and no tensor parallelism: the ranks all-reduce between layers)."""
        from nextoken.layers.activation import gelu_tanh_and_mul, silu_and_mul
        from nextoken.layers.attention import native_decode_supports
        from nextoken.layers.linear import FusedLinear
        from nextoken.layers.native_decode import NativeDecoder

        act = self.kernels.activation if self.native_activations else None
        invariant = rowwise = None
        if self.batch_invariant:
            from nextoken.kernels.gpu.batch_invariant import InvariantNorms as invariant
        if self.rowwise:
            from nextoken.kernels.gpu.rowwise import Rowwise as rowwise
        for m in model.modules():
            if hasattr(m, "act_kernel"):
                m.act_kernel = (rowwise or act) if m.act in (silu_and_mul, gelu_tanh_and_mul) else None
            if hasattr(m, "norm_kernel"):
                m.norm_kernel = invariant or rowwise or act
            if hasattr(m, "qk_norm_kernel"):
                m.qk_norm_kernel = invariant or rowwise
            if hasattr(m, "rope_kernel"):
                m.rope_kernel = rowwise
            if self.fused and hasattr(m, "qkv"):
                m.qkv = FusedLinear.of([m.q_proj, m.k_proj, m.v_proj])
            if self.fused and hasattr(m, "gate_up"):
                m.gate_up = FusedLinear.of([m.gate_proj, m.up_proj])
            if hasattr(m, "lookup_kernel"):
                m.lookup_kernel = self.kernels.qmatmul if self.codes else None
        if self.gemv and not self.batch_invariant:
            self.gemv_shapes = self._choose_gemv(model)
            self._choose_silu(model)
            self._choose_rope(model)
            self._choose_norm(model)
        if self.skinny and not self.batch_invariant and self.dtype == torch.bfloat16:
            self.skinny_shapes = self._choose_skinny(model)
        if self.triton_sampling:
            self._choose_sampling(model.config.vocab_size)
        cfg = model.config
        if self.attention == "native" and not native_decode_supports(self.dtype, cfg.head_dim, cfg.num_queries_per_kv):
            self.attention = "torch"
            self.reasons["attention"] = f"head_dim {cfg.head_dim} or {cfg.num_queries_per_kv} heads per KV head"
        if self.kernels.prefill_scores is not None and (self.dtype != torch.bfloat16 or cfg.head_dim % 2):
            self.kernels = replace(self.kernels, prefill_scores=None)
        self.native_decode = NativeDecoder.supports(model) and self.kernels.decode is not None
        if tensor_parallel and self.native_decode:
            self.native_decode = False
            self.reasons["native decode"] = "tensor parallel (all-reduces between the layers)"
        elif not self.native_decode and (self.codes or self.dense_kernel):
            self.reasons["native decode"] = NativeDecoder.why_not(model) or "the decode kernel did not build"

    def _choose_gemv(self, model) -> tuple[int, int]:
        """Give each dense matmul (`layers.linear.gemv_targets`) the row counts up to which our GEMV
        measured faster than PyTorch's on its weight shape, and the GEMV's launch that measured
        fastest there (`kernels.gpu.gemv.choose`, timed on this GPU over the model's own weights,
        the times kept in `gemv_times`); on the CPU (the GPU path's tests, under Triton's
        interpreter) every one takes it up to `gemv.MAX_ROWS`, launched as its default. Returns
        (shapes taken, shapes)."""
        from nextoken.kernels.gpu import gemv

        def timed(groups: dict) -> dict:
            chosen = gemv.choose(groups, report=self.gemv_times)
            return {key: {"gemv_rows": rows, "gemv_launch": launch} for key, (rows, launch) in chosen.items()}

        return self._per_shape(model, timed, {"gemv_rows": gemv.MAX_ROWS, "gemv_launch": None},
                               {"gemv_rows": 0, "gemv_launch": None}, "GEMV")

    def _choose_silu(self, model) -> None:
        """Give each SwiGLU down projection on the GEMV (`gemv_rows` > 0) the rows up to which
        SiLU inside the GEMV measured faster than the activation's own launch and then the GEMV
        (`kernels.gpu.gemv.choose_silu`, on this GPU over the model's down weights; the times in
        `silu_times`); on the CPU (the GPU path's tests) all its GEMV rows. A timing that raises
        leaves the two launches, and says why."""
        from nextoken.kernels.gpu import gemv
        from nextoken.layers.activation import silu_and_mul

        groups: dict = {}
        for m in model.modules():
            down = getattr(m, "down_proj", None)
            if getattr(m, "act", None) is silu_and_mul and down is not None and down.gemv_rows:
                groups.setdefault((tuple(down.weight.shape), down.bias is not None), []).append(down)
        self._fused_rows(groups, lambda key, downs: gemv.choose_silu([(d.weight, d.bias) for d in downs],
                                                                     downs[0].gemv_launch, downs[0].gemv_rows),
                         "silu_rows", self.silu_rows, self.silu_times, "SiLU in the GEMV")

    def _choose_rope(self, model) -> None:
        """Give each fused bf16 q/k/v product on the GEMV whose layer takes the Triton RoPE (and no
        norm on its heads) the rows up to which RoPE and the cache's write inside the GEMV
        measured faster than the GEMV and then the RoPE kernel (`kernels.gpu.gemv.choose_rope`, on
        this GPU over the model's q/k/v weights; the times in `rope_times`); on the CPU (the GPU
        path's tests) all its GEMV rows. A timing that raises leaves the two launches, and says
        why."""
        from nextoken.kernels.gpu import gemv

        groups: dict = {}
        for m in model.modules():
            qkv = getattr(m, "qkv", None)
            if qkv is not None and qkv.gemv_rows and qkv.weight.dtype == torch.bfloat16 \
                    and getattr(m, "rope_kernel", None) is not None and getattr(m, "q_norm", 0) is None:
                key = (tuple(qkv.weight.shape), qkv.bias is not None, m.head_dim, m.num_heads * m.head_dim)
                groups.setdefault(key, []).append(qkv)
        rope_dim = model.config.rope_dim

        def timed(key, qkvs):
            (n, _), _, d, q_features = key
            return gemv.choose_rope([(f.weight, f.bias) for f in qkvs], d, q_features, (n - q_features) // 2,
                                    rope_dim, qkvs[0].gemv_launch, qkvs[0].gemv_rows)

        self._fused_rows(groups, timed, "rope_rows", self.rope_rows, self.rope_times, "RoPE in the GEMV")

    def _choose_norm(self, model) -> None:
        """Give each bf16 o and down projection on the GEMV (its launch of
        `rowwise.ADD_NORM_WARPS` warps) whose layer takes the Triton norms the rows up to which the
        residual add and RMSNorm after it, joined inside the GEMV by its last program, measured
        faster than the GEMV and then the add-norm kernel (`kernels.gpu.gemv.choose_norm`, on this
        GPU over the model's weights; the times in `norm_times`); on the CPU (the GPU path's
        tests) all its GEMV rows. A timing that raises leaves the two launches, and says why."""
        from nextoken.kernels.gpu import gemv
        from nextoken.kernels.gpu.rowwise import ADD_NORM_WARPS, Rowwise

        groups: dict = {}
        for layer in model.modules():
            if getattr(layer, "norm_kernel", None) is not Rowwise:
                continue
            for lin in (getattr(getattr(layer, "self_attn", None), "o_proj", None),
                        getattr(getattr(layer, "mlp", None), "down_proj", None)):
                if lin is not None and lin.gemv_rows and lin.weight.dtype == torch.bfloat16 \
                        and (lin.gemv_launch or gemv.DEFAULT).num_warps == ADD_NORM_WARPS:
                    groups.setdefault((tuple(lin.weight.shape), lin.bias is not None), []).append(lin)
        eps = model.config.norm_eps
        self._fused_rows(groups, lambda key, lins: gemv.choose_norm([(m.weight, m.bias) for m in lins], eps,
                                                                    lins[0].gemv_launch, lins[0].gemv_rows),
                         "norm_rows", self.norm_rows, self.norm_times, "the add and norm in the GEMV")

    def _fused_rows(self, groups: dict, timed, attr: str, rows: dict, times: dict, what: str) -> None:
        """Set `attr` of each group's matmuls (``{key: [matmul, ...]}``, key[0] the weight shape) to
        the rows ``timed(key, matmuls) -> (rows, times)`` gives on a GPU (`rows` and `times` get
        them by shape), or off a GPU to their GEMV rows; a timing that raises sets 0 and says why
        under `what` (as one does whose fusion's values differ there from its two launches':
        `kernels.gpu.gemv.same_values`)."""
        for key, ms in groups.items():
            n = ms[0].gemv_rows
            if self.device.is_cuda:
                try:
                    n, times[key[0]] = timed(key, ms)
                except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: two launches
                    self.reasons[what] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    for m in ms:
                        setattr(m, attr, 0)
                    continue
            rows[key[0]] = n
            for m in ms:
                setattr(m, attr, n)

    def _choose_skinny(self, model) -> tuple[int, int]:
        """Give each dense matmul the row counts (8, 16, 32, 64) at which our split-K GEMM measured
        faster than PyTorch's on its weight shape, and its launch that measured fastest there
        (`kernels.gpu.skinny.choose`, as `_choose_gemv`; the times in `skinny_times`); on the CPU
        every one takes all four, launched as its default. Returns (shapes taken at some row
        count, shapes)."""
        from nextoken.kernels.gpu import skinny

        def timed(groups: dict) -> dict:
            chosen = skinny.choose(groups, report=self.skinny_times)
            return {key: {"skinny_rows": rows, "skinny_launch": launch} for key, (rows, launch) in chosen.items()}

        return self._per_shape(model, timed, {"skinny_rows": skinny.BUCKETS, "skinny_launch": None},
                               {"skinny_rows": (), "skinny_launch": None}, "split-K GEMM")

    def _per_shape(self, model, choose, untimed: dict, none: dict, what: str) -> tuple[int, int]:
        """Set the attributes of every dense matmul (`layers.linear.gemv_targets`) to its weight
        shape's entry of ``choose({(shape, has bias): [(weight, bias), ...]})`` (``{key: {attribute:
        value}}``, timed on this GPU), or to `untimed` off a GPU; should the timing raise (a kernel
        that does not build here), to `none` (PyTorch's matmul), with the reason under `what`.
        Returns (shapes whose entry's first value is truthy, shapes)."""
        from nextoken.layers.linear import gemv_targets

        groups: dict = {}
        for t in gemv_targets(model):
            groups.setdefault((tuple(t.weight.shape), t.bias is not None), []).append(t)
        if self.device.is_cuda:
            try:
                chosen = choose({k: [(t.weight, t.bias) for t in ts] for k, ts in groups.items()})
            except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: cuBLAS takes every call
                self.reasons[what] = f"{type(exc).__name__}: {str(exc)[:200]}"
                chosen = dict.fromkeys(groups, none)
        else:
            chosen = dict.fromkeys(groups, untimed)
        for key, targets in groups.items():
            for t in targets:
                for attr, value in chosen[key].items():
                    setattr(t, attr, value)
        return sum(1 for c in chosen.values() if next(iter(c.values()))), len(chosen)

    def _choose_sampling(self, vocab: int) -> None:
        """From how many rows the sampler draws on Triton (`kernels.gpu.sampling.choose_min_rows`:
        timed against PyTorch's draw on this GPU at load; on the CPU, the GPU path's tests under
        Triton's interpreter, from one). A timing that raises leaves PyTorch's draw, and says why."""
        if not self.device.is_cuda:
            return
        from nextoken.kernels.gpu import sampling
        from nextoken.sample.sampler import torch_draw

        try:
            self.sampling_rows, self.sampling_times = sampling.choose_min_rows(vocab, self.device.torch, torch_draw)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: PyTorch draws
            self.reasons["Triton draw"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            self.sampling_rows = 0

    def settle_cache(self, int8_cache: bool) -> None:
        """When the KV cache is made: an int8 cache needs bf16 queries in the C decode attention."""
        if int8_cache and self.attention == "native" and self.dtype != torch.bfloat16:
            self.attention = "torch"
            self.reasons["attention"] = "an int8 KV cache with float32 queries"

    def choose_tilings(self, cfg, block_size: int, default):
        """The Triton attention's decode and prefill tiles for `cfg`'s heads (this rank's) over a
        cache of `block_size` rows a block: on a GPU in bf16 with CUDA graphs (not
        ``enforce_eager``, which keeps the kernels' defaults, as it keeps cuBLAS for every matmul),
        those that time fastest there (`kernels.gpu.attention.choose_tilings`, the times kept in
        `tiling_times`); else, or should the timing raise (a tile that does not build here),
        `default` (with the reason)."""
        if not self.device.is_cuda or self.dtype != torch.bfloat16 or not self.cuda_graphs:
            return default
        from nextoken.kernels.gpu.attention import choose_tilings

        try:
            self.tilings = choose_tilings(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype, block_size,
                                          self.device.torch, report=self.tiling_times)
        except Exception as exc:  # noqa: BLE001 - a tile that does not build here: the defaults, which did
            self.reasons["attention tiles"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            return default
        return self.tilings

    @property
    def cheap_verification(self) -> bool:
        """Whether a pass of a few more rows (a speculative verification's) costs about one row's:
        on a GPU, or with the codes on the AVX-512 VNNI loop, where 2 / 4 / 8 rows cost 0.9-1.1 /
        1.0-1.2 / 1.3-1.6x one row from memory (`benchmarks/qmatmul.py --stream`; the AVX2 loop's
        5 rows 2.5-3x)."""
        if self.device.is_cuda:
            return True
        q = self.kernels.qmatmul
        return self.codes and q is not None and bool(q.qmatmul_vectorized())

    @property
    def attention_kernels(self) -> KernelSet:
        """The libraries the attention layers receive (`AttentionMetadata.kernels`)."""
        if self.attention != "native":
            return KernelSet()
        return KernelSet(paged_attention=self.kernels.paged_attention, prefill_scores=self.kernels.prefill_scores)

    def describe(self, model) -> str:
        """One line: the device and why, the linears by method (and GGML type), the embedding,
        attention, decode."""
        by_method: Counter = Counter()
        for name, m in model.named_modules():
            method = getattr(m, "method", None)
            if isinstance(method, LinearMethod):
                fmt = f"{method.name}" if method.name != "dense" else f"dense {str(m.dtype).removeprefix('torch.')}"
                by_method[fmt] += 1
        emb = model.embed_tokens
        emb_form = "codes" if emb.qweight is not None else "q8_0" if emb.q8 is not None else "dense"
        linears = ", ".join(f"{n} {k}" for k, n in sorted(by_method.items()))
        fused = sum(1 for m in model.modules() for f in (getattr(m, "qkv", None), getattr(m, "gate_up", None)) if f)
        if fused:
            linears += f" (q/k/v and gate/up as {fused} fused matmuls)"
        if self.gemv and not self.batch_invariant:
            taken, shapes = self.gemv_shapes
            how = "as timed on this GPU" if self.device.is_cuda else "untimed off a GPU"
            linears += f" (Triton GEMV for decodes of few rows on {taken} of {shapes} weight shapes, {how})"
            for rows, what, name, inside in ((self.silu_rows, "SiLU inside", "SiLU", "the down projection's GEMV"),
                                             (self.rope_rows, "RoPE and the cache's write inside", "RoPE",
                                              "the q/k/v GEMV"),
                                             (self.norm_rows, "the residual add and RMSNorm after it inside",
                                              "the add and norm", "the o and down projections' GEMV")):
                if any(rows.values()):
                    linears += f" ({what} {inside} up to {'/'.join(map(str, rows.values()))} rows, {how})"
                elif rows:
                    linears += f" ({name} in a launch of its own: it timed slower inside {inside})"
        if self.skinny and not self.batch_invariant and self.dtype == torch.bfloat16:
            taken, shapes = self.skinny_shapes
            how = "as timed on this GPU" if self.device.is_cuda else "untimed off a GPU"
            linears += f" (Triton split-K GEMM for 5-64 rows on {taken} of {shapes} weight shapes, {how})"
        decode = (f"one C call per step (prompts up to {MAX_PREFILL_TOKENS} tokens too; LoRA adapters included)"
                  if self.native_decode else "PyTorch layers")
        act = "C" if self.native_activations else "Triton (with RoPE)" if self.rowwise else "PyTorch"
        if self.batch_invariant:
            act = f"{act} activations, Triton norms (batch-invariant: one key split per decode)"
        off = "; ".join(f"{k} off: {v}" for k, v in self.reasons.items())
        quantized = f" (quantized at load to {self.quantization})" if self.quantization else ""
        graphs = "; CUDA graphs for decode steps" if self.cuda_graphs else ""
        if self.device.is_cuda and self.triton_sampling and self.sampling_rows:
            graphs += f"; sampler: Triton draw from {self.sampling_rows} rows (as timed on this GPU)"
        elif self.device.is_cuda:
            graphs += "; sampler: PyTorch" + (" (the Triton draw timed slower)" if self.triton_sampling else "")
        tiles = (f" (tiles: decodes {self.tilings.decode}, prefill {self.tilings.prefill}, as timed on this GPU"
                 + _join_words(self.tilings) + ")" if self.tilings is not None else "")
        return (f"execution plan: device {self.device.describe()}; {str(self.dtype).removeprefix('torch.')}"
                f"{quantized}; linears: {linears}; "
                f"embedding: {emb_form}; "
                f"attention: {self.attention}{tiles}; activations and norms: {act}; decode step: {decode}{graphs}"
                + (f"; {self.weights.describe()}" if self.weights is not None else "") + (f" ({off})" if off else ""))


def _check_batch_invariant(device: Device, enforce_eager: bool, reference: bool, backend: str,
                           quantization: str | None) -> None:
    """Raises `InvalidRequest` unless a batch-invariant plan can run here: the Triton attention
    (a GPU's; on the CPU only under Triton's interpreter, with `enforce_eager`, as a check of the
    GPU path), no quantization at load (its weights run dense)."""
    why = None
    if reference:
        why = "the reference attention is not part of it (drop --reference-attention)"
    elif quantization is not None:
        why = f"its linears run dense weights, not --quantization {quantization}"
    elif not device.is_cuda and (backend != "triton" or not enforce_eager):
        why = ("it is the GPU path's (Triton kernels); on the CPU it runs only as a slow check of that path, "
               "with --enforce-eager --attention-backend triton under TRITON_INTERPRET=1")
    if why:
        raise InvalidRequest(f"--batch-invariant: {why}", "batch_invariant")


def _cpu_attention(reference: bool, backend: str, ks: KernelSet) -> str:
    """The CPU's attention: the reference when asked, else `backend` (``auto``: our C kernel
    when it built, else PyTorch). Raises `InvalidRequest` for ``native`` without the kernel and
    for ``triton`` outside Triton's interpreter."""
    if reference:
        return "reference"
    if backend == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise InvalidRequest("attention_backend triton runs on the CPU only under Triton's interpreter "
                                 "(TRITON_INTERPRET=1, a slow check of the GPU path); use --device cuda",
                                 "attention_backend")
        return "triton"
    if backend == "native" and ks.paged_attention is None:
        raise InvalidRequest("attention_backend native needs our C kernels (not --enforce-eager, a C compiler)",
                             "attention_backend")
    if backend == "torch" or ks.paged_attention is None:
        return "torch"
    return "native"


def _join_words(tilings) -> str:
    """The plan line's words for where a decode's key splits are joined (`attention.Tilings`)."""
    from nextoken.kernels.gpu.attention import SPLIT_CHOICES

    if not tilings.join:
        return "; key splits joined in a second launch: joined in the attention's own, their values differed here"
    if tilings.join_splits < SPLIT_CHOICES[-1]:
        return (f"; key splits joined in the attention's launch up to {tilings.join_splits}, in a second launch "
                f"past that (as timed)" if tilings.join_splits else
                "; key splits joined in a second launch (as timed: the attention's own was slower)")
    return ""
