"""Hugging Face model folders: ``config.json`` + ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``) + ``tokenizer.json`` / ``tokenizer_config.json``.

Tensors are read with the `safetensors` library, one at a time, straight into our parameters;
a tensor already in the dtype the model runs in (a bf16 folder served in bf16) is not read at
all: the parameter is a view of the file, memory-mapped copy-on-write (`mapped`), so the pages
are read on first use and the weights take their size once, not once in the page cache and
once more in the process.
Only safetensors are loaded: a pickle checkpoint (``*.bin``, ``*.pt``) can run arbitrary code
when unpickled, so a folder that has only those is refused with a message saying so.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any

import torch

from nextoken.config import ModelConfig
from nextoken.errors import ModelLoadError

# config.json `architectures[0]` -> our architecture name (`models.registry`)
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
    "GPT2LMHeadModel": "gpt2",
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONFIG_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.bfloat16}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def is_hf_dir(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


class HFModelDir:
    """One model folder, opened read-only. Raises `ModelLoadError` when config.json is missing
    or unreadable, or when there are no safetensors weights (naming the pickle files, if any)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelLoadError(f"{self.path}: no config.json; a model folder needs config.json, *.safetensors "
                                 "and tokenizer.json")
        try:
            with open(cfg_path, encoding="utf-8") as fh:
                self.hf_config: dict[str, Any] = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{cfg_path} is not readable JSON: {exc}") from None
        self._files = self._weight_files()
        self._handles: dict[str, Any] = {}
        self._maps: dict[str, tuple[mmap.mmap, int, dict]] = {}
        self._where: dict[str, str] = {}
        for f in self._files:
            for name in self._open(f).keys():
                self._where[name] = f

    def _weight_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as fh:
                shards = sorted(set(json.load(fh)["weight_map"].values()))
            missing = [s for s in shards if not os.path.isfile(os.path.join(self.path, s))]
            if missing:
                raise ModelLoadError(f"{self.path}: shard {missing[0]} listed in model.safetensors.index.json is missing")
            return [os.path.join(self.path, s) for s in shards]
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if files:
            return [os.path.join(self.path, f) for f in files]
        pickles = sorted(f for f in os.listdir(self.path) if f.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise ModelLoadError(
                f"{self.path}: the weights are a pickle checkpoint ({', '.join(pickles)}); nextoken loads only "
                "safetensors and GGUF, because unpickling a file can run arbitrary code. Convert it once with "
                "`transformers` (model.save_pretrained(dir, safe_serialization=True))")
        raise ModelLoadError(f"{self.path}: no *.safetensors weights found")

    def _open(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(file, framework="pt")
            except Exception as exc:  # safetensors raises its own errors on damaged headers
                raise ModelLoadError(f"{file} is not a readable safetensors file ({exc})") from None
        return self._handles[file]

    # -- the same questions a GGUFFile answers ----------------------------------------------
    def has_tensor(self, name: str) -> bool:
        return name in self._where

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor `name` converted to `dtype`; `ModelLoadError` naming it when absent."""
        if name not in self._where:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the safetensors weights")
        return self._open(self._where[name]).get_tensor(name).to(dtype)

    def mapped(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Tensor `name` as a view of its file (copy-on-write: writes stay in this process), when
        the file stores it as `dtype`; None otherwise (another dtype, or a header this reader does
        not follow: the caller reads a copy with `tensor`). The safetensors layout: an 8-byte
        little-endian header size, a JSON header of ``{name: {dtype, shape, data_offsets}}``,
        then the data, offsets relative to its start."""
        file = self._where.get(name)
        if file is None:
            return None
        if file not in self._maps:
            try:
                with open(file, "rb") as fh:
                    size = struct.unpack("<Q", fh.read(8))[0]
                    header = json.loads(fh.read(size))
                    buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):
                return None
            self._maps[file] = (buf, 8 + size, header)
        buf, base, header = self._maps[file]
        entry = header.get(name) or {}
        if SAFETENSORS_DTYPES.get(entry.get("dtype")) != dtype:
            return None
        start, stop = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = stop - start
        if count != dtype.itemsize * int(torch.Size(shape).numel()) or base + stop > len(buf):
            return None
        return torch.frombuffer(buf, dtype=dtype, count=count // dtype.itemsize, offset=base + start).view(shape)

    def release_metadata(self) -> None:
        """Nothing to release (for symmetry with `GGUFFile`)."""

    @property
    def config_dtype(self) -> torch.dtype:
        """The dtype config.json names (``torch_dtype`` or ``dtype``); float16 runs as bfloat16 on
        this CPU path; float32 when unnamed."""
        name = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype") or "float32"
        return CONFIG_DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def read_hf_config(d: HFModelDir) -> ModelConfig:
    """Our `ModelConfig` from config.json. Raises `ModelLoadError` for an unknown architecture
    (naming it and listing the supported ones) or a missing key."""
    c = d.hf_config
    archs = c.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{d.path}: model architecture {archs[0] if archs else c.get('model_type')!r} is not supported; "
            f"supported: {', '.join(HF_ARCHITECTURES)}")
    if arch == "gpt2":
        return _gpt2_config(d, c)

    def need(key):
        if key not in c:
            raise ModelLoadError(f"{d.path}/config.json: key {key!r} is missing")
        return c[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    rope = c.get("rope_parameters") or {}
    extra: dict[str, Any] = {"hf_architecture": archs[0]}
    layer_types = None
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    if arch == "gemma3":
        rope_global = (rope.get("full_attention") or {})
        rope_local = (rope.get("sliding_attention") or {})
        theta = float(rope_global.get("rope_theta") or c.get("rope_theta") or 1_000_000.0)
        extra["rope_local_theta"] = float(rope_local.get("rope_theta") or c.get("rope_local_base_freq") or 10000.0)
        scaling = rope_global if rope_global.get("rope_type") == "linear" else (c.get("rope_scaling") or {})
        if scaling.get("factor") and scaling.get("rope_type", scaling.get("type")) == "linear":
            extra["rope_scaling_factor"] = float(scaling["factor"])
        extra["query_pre_attn_scalar"] = float(c.get("query_pre_attn_scalar") or head_dim)
        extra["final_logit_softcapping"] = c.get("final_logit_softcapping")
        pattern = int(c.get("sliding_window_pattern") or 6)
        layer_types = tuple(c.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(int(need("num_hidden_layers")))])
    else:
        theta = float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0)
        if rope.get("rope_type", "default") != "default" or c.get("rope_scaling"):
            raise ModelLoadError(f"{d.path}: RoPE scaling {rope.get('rope_type') or c.get('rope_scaling')!r} is "
                                 "not supported yet (only the default RoPE)")
        if c.get("layer_types"):
            layer_types = tuple(c["layer_types"])
    return ModelConfig(
        architecture=arch,
        name=str(c.get("_name_or_path") or os.path.basename(os.path.normpath(d.path))),
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        context_length=int(c.get("max_position_embeddings") or 2048),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_dim=head_dim,
        # unset: tied when the folder has no separate head
        tie_word_embeddings=bool(c.get("tie_word_embeddings", not d.has_tensor("lm_head.weight"))),
        attention_bias=bool(c.get("attention_bias", arch == "qwen2")),
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        extra=extra,
    )


def _gpt2_config(d: HFModelDir, c: dict) -> ModelConfig:
    hidden, heads = int(c["n_embd"]), int(c["n_head"])
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ModelLoadError(f"{d.path}: GPT-2 activation {act!r} is not supported (gelu_new, gelu)")
    if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
        raise ModelLoadError(f"{d.path}: GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn "
                             "are not supported")
    return ModelConfig(
        architecture="gpt2", name=str(c.get("_name_or_path") or os.path.basename(os.path.normpath(d.path))),
        vocab_size=int(c["vocab_size"]), hidden_size=hidden, intermediate_size=int(c.get("n_inner") or 4 * hidden),
        num_layers=int(c["n_layer"]), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        context_length=int(c.get("n_positions") or 1024), norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        rope_theta=0.0, rope_dim=0, tie_word_embeddings=True, attention_bias=True,
        extra={"hf_architecture": "GPT2LMHeadModel", "activation": "tanh" if act != "gelu" else "none",
               "scale_attn_weights": bool(c.get("scale_attn_weights", True))})


def generation_eos_ids(d: HFModelDir) -> list[int]:
    """End-of-generation ids from generation_config.json (and config.json), as a list."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(d.path, name)
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as fh:
                value = json.load(fh).get("eos_token_id")
            ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return ids
