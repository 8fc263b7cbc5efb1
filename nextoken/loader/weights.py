"""Checkpoint tensors into a model's parameters: names, permutations, packing.

    load_weights(model, source, plan)
      for each (checkpoint name -> our parameter) of the architecture's name table:
        CheckpointTensor (type, shape, raw block bytes or dense values, row mapping)
        -> the owning layer's `weight_loader(tensor, plan)` hook (Linear, Embedding), which stores
           it in the form the execution plan picks (codes, int4, dense), or a plain copy
      then the tied LM head (sharing the embedding's codes or table when it can)

The name tables are llama.cpp's GGUF names (``gguf-py/gguf/constants.py``) and the Hugging Face
checkpoint names; the model files describe only the architecture. Under tensor parallelism a
tensor is cut to the rank's shard before its hook sees it (`CheckpointTensor.shard`). A missing
tensor or one of another shape is a `ModelLoadError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nextoken.errors import ModelLoadError
from nextoken.layers.quantization.methods import CodesMethod, DenseMethod
from nextoken.layers.rotary import unpermute_qk
from nextoken.loader.gguf import GGUFFile
from nextoken.loader.gguf_names import GGUF_LAYER_NAMES, GGUF_PERMUTED_QK, GGUF_PROJECTIONS
from nextoken.loader.hf import HFModelDir
from nextoken.loader.prepared import PREPARED_INV_FREQ, PREPARED_INV_FREQ_LOCAL, PreparedWeights


@dataclass
class CheckpointTensor:
    """One tensor of a checkpoint, read on demand.

    type_name: the GGML type (``"Q4_K"``, ``"F32"`` ...; dense safetensors read as ``"F32"``);
    shape: PyTorch order, rows first; `raw` gives the stored block bytes of a row range (GGUF
    only); `dense` the values in a dtype with `transform` applied; `row_head_dim`, when set, is
    the head size by which the rows must be un-permuted (llama.cpp's Q/K permutation): `map_rows`
    applies that to any tensor indexed by these rows (codes, scales). `prepared`: where codes
    packed from it are kept across starts (`loader.prepared`).
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    read_dense: Callable[[torch.dtype], torch.Tensor]
    read_raw: Callable[[int, int | None], torch.Tensor] | None = None
    row_head_dim: int | None = None
    read_mapped: Callable[[torch.dtype], torch.Tensor | None] | None = None  # a view of the file, if stored so
    prepared: PreparedWeights | None = None  # the prepared-weights cache of its file, if used

    @property
    def maps_rows(self) -> bool:
        return self.row_head_dim is not None

    def map_rows(self, t: torch.Tensor) -> torch.Tensor:
        return unpermute_qk(t, t.shape[0] // self.row_head_dim) if self.row_head_dim is not None else t

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.map_rows(self.read_dense(dtype))

    def stored(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor as a view of its file when the file holds it in `dtype` as it is (no
        transform, no row mapping): the caller keeps the view instead of a copy. Else None."""
        return self.read_mapped(dtype) if self.read_mapped is not None and not self.maps_rows else None

    def _mapped_rows(self, start: int, stop: int) -> Callable[[torch.dtype], torch.Tensor | None]:
        """`read_mapped` of rows ``[start, stop)``: a view of the file's view (rows are contiguous)."""
        def read(dtype: torch.dtype) -> torch.Tensor | None:
            view = self.read_mapped(dtype)
            return None if view is None else view[start:stop]
        return read

    def raw(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if self.read_raw is None:
            raise ModelLoadError(f"tensor {self.name} has no block-quantized bytes")
        return self.read_raw(start, stop)

    def shard(self, dim: int, start: int, stop: int) -> CheckpointTensor:
        """Rows (`dim` 0) or columns (`dim` 1) ``[start, stop)`` of this tensor: one tensor-parallel
        rank's part (`nextoken.distributed.sharding`). A row cut must fall on head boundaries
        where the rows are un-permuted (Q/K: the permutation stays inside each head). A column
        cut keeps the block bytes when it falls on block boundaries; one inside a block reads
        dense (type ``F32``: the loader de-quantizes it)."""
        n = self.shape[dim]
        if not 0 <= start < stop <= n:
            raise ModelLoadError(f"tensor {self.name}: shard [{start}, {stop}) is outside its {n} "
                                 f"{'rows' if dim == 0 else 'columns'}")
        shape = list(self.shape)
        shape[dim] = stop - start
        name = f"{self.name}[{'rows' if dim == 0 else 'columns'} {start}:{stop}]"
        cut = (lambda t: t[start:stop]) if dim == 0 else (lambda t: t[:, start:stop])
        read_dense = lambda dtype: cut(self.read_dense(dtype))  # noqa: E731
        if dim == 0:
            read_raw = None if self.read_raw is None else \
                lambda a, b: self.read_raw(start + a, start + (stop - start if b is None else b))
            return CheckpointTensor(name, self.type_name, tuple(shape), read_dense, read_raw, self.row_head_dim,
                                    read_mapped=None if self.read_mapped is None else self._mapped_rows(start, stop))
        block, size = block_geometry(self.type_name)
        if self.read_raw is None or start % block or stop % block:
            return CheckpointTensor(name, "F32", tuple(shape), read_dense, None, self.row_head_dim)
        lo, hi = start // block * size, stop // block * size
        return CheckpointTensor(name, self.type_name, tuple(shape), read_dense,
                                lambda a, b: self.read_raw(a, b)[:, lo:hi].contiguous(), self.row_head_dim)


def block_geometry(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of GGML type `type_name` (1 value for F32/F16/BF16)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


# -- name tables ------------------------------------------------------------------------------
# GGUF blk.N.<name> -> our layers.N.<name>, per layer layout
GPT2_HF_LAYER_NAMES = {"ln_1.weight": "ln_1_weight", "ln_1.bias": "ln_1_bias", "ln_2.weight": "ln_2_weight",
                       "ln_2.bias": "ln_2_bias", "attn.c_attn.weight": "c_attn.weight",
                       "attn.c_attn.bias": "c_attn.bias", "attn.c_proj.weight": "attn_proj.weight",
                       "attn.c_proj.bias": "attn_proj.bias", "mlp.c_fc.weight": "c_fc.weight",
                       "mlp.c_fc.bias": "c_fc.bias", "mlp.c_proj.weight": "mlp_proj.weight",
                       "mlp.c_proj.bias": "mlp_proj.bias"}
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gguf_names(model) -> dict[str, tuple[str, int | None]]:
    """GGUF tensor name -> (our parameter name, the head size to un-permute its rows by, or None)."""
    cfg = model.config
    if cfg.architecture == "gpt2":
        raise ModelLoadError("GPT-2 loads from Hugging Face folders (safetensors), not GGUF")
    layout = "gemma3" if cfg.architecture == "gemma3" else "llama"
    permute = {"attn_q": cfg.head_dim, "attn_k": cfg.head_dim} if cfg.architecture in GGUF_PERMUTED_QK else {}
    m = {"token_embd.weight": ("embed_tokens.weight", None), "output_norm.weight": ("norm", None)}
    if not cfg.tie_word_embeddings:
        m["output.weight"] = ("lm_head.weight", None)
    for i, layer in enumerate(model.layers):
        p, ours = f"blk.{i}.", f"layers.{i}."
        for g, name in GGUF_LAYER_NAMES[layout].items():
            m[p + g] = (ours + name, None)
        for g, name in GGUF_PROJECTIONS.items():
            m[p + g + ".weight"] = (ours + name + ".weight", permute.get(g))
            if cfg.attention_bias and g in ("attn_q", "attn_k", "attn_v"):
                m[p + g + ".bias"] = (ours + name + ".bias", permute.get(g))
        if layer.self_attn.q_norm is not None:  # QK-norm (Qwen 3, Gemma 3)
            m[p + "attn_q_norm.weight"] = (ours + "self_attn.q_norm", None)
            m[p + "attn_k_norm.weight"] = (ours + "self_attn.k_norm", None)
    return m


def hf_names(model, source: HFModelDir) -> dict[str, str]:
    """Hugging Face tensor name -> our parameter name."""
    cfg = model.config
    if cfg.architecture == "gpt2":
        m = {"transformer.wte.weight": "embed_tokens.weight", "transformer.wpe.weight": "position_embeddings",
             "transformer.ln_f.weight": "norm", "transformer.ln_f.bias": "norm_bias"}
        for i in range(cfg.num_layers):
            for hf, ours in GPT2_HF_LAYER_NAMES.items():
                m[f"transformer.h.{i}.{hf}"] = f"layers.{i}.{ours}"
        if not source.has_tensor("transformer.wte.weight"):  # saved from GPT2Model: no prefix
            m = {k.removeprefix("transformer."): v for k, v in m.items()}
        return m
    m = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm"}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = "lm_head.weight"
    for name, _ in model.named_parameters():
        if name.startswith("layers."):  # the layouts agree: our names with the "model." prefix
            m["model." + name + ("" if name.endswith((".weight", ".bias")) else ".weight")] = name
    return m


def hf_transformed(architecture: str, name: str) -> bool:
    """Whether `hf_transform` changes this tensor (then it is never used as a view of the file)."""
    return (architecture == "gpt2" and name.endswith(GPT2_CONV1D)) or \
        (architecture == "gemma3" and name.endswith("norm.weight"))


def hf_transform(architecture: str, name: str, w: torch.Tensor) -> torch.Tensor:
    """A Hugging Face tensor in our layout: GPT-2's ``Conv1D`` weights (``[in, out]``) transposed;
    Gemma's RMSNorm weights stored as ``w - 1`` by `transformers` made ``w`` (as GGUF has them)."""
    if architecture == "gpt2" and name.endswith(GPT2_CONV1D):
        return w.t().contiguous()
    if architecture == "gemma3" and name.endswith("norm.weight"):
        return w + 1
    return w


# -- loading ----------------------------------------------------------------------------------
def load_weights(model, source: GGUFFile | HFModelDir, plan, prepared_cache: bool = False,
                 shards: dict[str, tuple[int, int, int]] | None = None) -> None:
    """Fill every parameter of `model` from `source`, each weight in the form `plan` picks; with
    `prepared_cache` (GGUF weights as codes), codes come from and go to the prepared-weights cache.
    `shards` (tensor parallelism): per parameter, the ``(dim, start, stop)`` slice of its
    checkpoint tensor this rank loads (`CheckpointTensor.shard`)."""
    progress = None
    if isinstance(source, HFModelDir):
        arch = model.config.architecture
        tensors = {ours: _hf_tensor(source, name, arch) for name, ours in hf_names(model, source).items()}
        prepared = None
        if plan.quantization:
            tensors, prepared, progress = _quantized(model, source, tensors, plan, prepared_cache)
    else:
        tensors = {ours: _gguf_tensor(source, name, hd) for name, (ours, hd) in gguf_names(model).items()}
        prepared = PreparedWeights(source.path) if prepared_cache and plan.codes else None
        for t in tensors.values():
            t.prepared = prepared
    for ours, cut in (shards or {}).items():
        tensors[ours] = tensors[ours].shard(*cut)
    params = dict(model.named_parameters(remove_duplicate=False))
    for ours, t in tensors.items():
        owner = model.get_submodule(ours.rsplit(".", 1)[0]) if ours.endswith(".weight") else None
        hook = getattr(owner, "weight_loader", None)
        expected = tuple(params[ours].shape)
        if tuple(t.shape) != expected:
            raise ModelLoadError(f"tensor {t.name} has shape {tuple(t.shape)}, expected {expected}")
        if hook is not None:
            hook(t, plan)
        else:
            params[ours].data.copy_(t.dense(params[ours].dtype))
            if prepared is not None:  # the norms and biases beside the codes: the quick start reads them
                prepared.keep_dense(t.name, params[ours].data)
    if model.config.tie_word_embeddings:
        _tie_head(model, tensors["embed_tokens.weight"], plan)
    if progress is not None:
        progress.close()
    if prepared is not None:
        if getattr(model, "inv_freq", None) is not None:  # RoPE's frequencies, as the model computed them
            prepared.keep_dense(PREPARED_INV_FREQ, model.inv_freq)
        if getattr(model, "inv_freq_local", None) is not None:
            prepared.keep_dense(PREPARED_INV_FREQ_LOCAL, model.inv_freq_local)
        prepared.save()


def _quantized(model, source: HFModelDir, tensors: dict, plan, prepared_cache: bool):
    """``--quantization``: the folder's linear and embedding weights as GGUF blocks of the plan's
    format (`loader.quantize`), with the prepared-weights cache of the folder's content and that
    format (when `prepared_cache` and the codes run on our kernel)."""
    from nextoken.loader.quantize import GGML_TYPES, Progress, at_load, quantizable

    type_name = GGML_TYPES[plan.quantization]
    chosen = [ours for ours, t in tensors.items() if ours.endswith(".weight")
              and quantizable(model.get_submodule(ours.rsplit(".", 1)[0]), t)]
    progress = Progress(len(chosen), plan.quantization)
    prepared = PreparedWeights(source.path, variant=plan.quantization) if prepared_cache and plan.codes else None
    out = dict(tensors)
    for ours in chosen:
        out[ours] = at_load(tensors[ours], type_name, progress)
    for t in out.values():
        t.prepared = prepared
    return out, prepared, progress


def _tie_head(model, table: CheckpointTensor, plan) -> None:
    """The LM head of a tied model reads the embedding table: its codes when both use codes, the
    same dense table when the embedding is dense, else its own form of the table (int4 on the
    PyTorch path, where the embedding keeps Q8_0 rows)."""
    head, emb = model.lm_head, model.embed_tokens
    method = plan.linear_method(table.type_name, *table.shape)
    if emb.qweight is not None and isinstance(method, CodesMethod):
        head.set_qweight(emb.qweight, method)
    elif emb.weight is not None:
        head.weight = emb.weight  # the same table, on our kernel when the plan runs dense weights there
        head.method = method if isinstance(method, DenseMethod) else DenseMethod()
    else:
        head.weight_loader(table, plan)


def _gguf_tensor(f: GGUFFile, name: str, head_dim: int | None) -> CheckpointTensor:
    if not f.has_tensor(name):
        raise ModelLoadError(f"tensor {name} is missing from the GGUF file")
    return CheckpointTensor(name, f.tensor_type(name), f.tensor_shape(name),
                            lambda dtype: f.tensor(name, dtype), lambda a, b: f.raw(name, a, b), head_dim)


def _hf_tensor(d: HFModelDir, name: str, arch: str) -> CheckpointTensor:
    if not d.has_tensor(name):
        raise ModelLoadError(f"{d.path}: tensor {name} is missing from the safetensors weights")
    shape = d.tensor_shape(name)
    if arch == "gpt2" and name.endswith(GPT2_CONV1D):
        shape = tuple(reversed(shape))
    plain = not hf_transformed(arch, name)
    return CheckpointTensor(name, "F32", shape,
                            lambda dtype: hf_transform(arch, name, d.tensor(name, torch.float32)).to(dtype),
                            read_mapped=(lambda dtype: d.mapped(name, dtype)) if plain else None)
