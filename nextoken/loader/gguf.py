"""Reading GGUF files: metadata into a `ModelConfig`, tensors by name.

The file format is parsed by the `gguf` package (``GGUFReader`` memory-maps the file); we only
interpret it. GGUF key names follow llama.cpp's ``gguf-py/gguf/constants.py``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import torch

from nextoken.config import ModelConfig
from nextoken.errors import ModelLoadError
from nextoken.loader.dequant import dequantize


class GGUFFile:
    """One GGUF file, opened read-only and memory-mapped.

    Raises `ModelLoadError` when the file is missing, truncated or not GGUF, with a message that
    says what to do.
    """

    def __init__(self, path: str | os.PathLike):
        import gguf  # imported here: it is slow to import and not every command needs it

        self.path = str(path)
        if not os.path.isfile(self.path):
            raise ModelLoadError(f"model file not found: {self.path}; give a path to a .gguf file or a "
                                 "catalog name (see `nextoken models`)")
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except Exception as exc:  # the reader raises ValueError/struct errors/IndexError on damage
            raise ModelLoadError(
                f"{self.path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                "it may be truncated or corrupt: download it again (nextoken pull NAME)"
            ) from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_complete()

    def _check_complete(self) -> None:
        size = os.path.getsize(self.path)
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(
                    f"{self.path} is truncated (tensor {t.name} ends past the end of the file); "
                    "download it again (nextoken pull NAME)"
                )

    # -- metadata ---------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (str, number, bool or list), or `default` if absent."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        """Like `get`, but raises `ModelLoadError` naming the key when it is absent."""
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value

    def keys(self) -> list[str]:
        return list(self._reader.fields)

    # -- tensors ----------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        """The GGML type name of tensor `name` (``"Q4_1"``, ``"F32"`` ...)."""
        return self._get(name).tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """PyTorch-order shape (rows first) of tensor `name`."""
        return tuple(int(d) for d in reversed(self._get(name).shape))

    def tensor(self, name: str, dtype: torch.dtype = torch.float32, chunk_rows: int = 4096) -> torch.Tensor:
        """Tensor `name` de-quantized to `dtype`, PyTorch-order shape ``[rows, cols]``.

        Rows are de-quantized `chunk_rows` at a time straight into the result, so no float32 copy
        of a large tensor is ever held at once.
        """
        t = self._get(name)
        shape = self.tensor_shape(name)
        raw = self._view(t)
        type_name = t.tensor_type.name
        if len(shape) < 2 or shape[0] <= chunk_rows:
            return dequantize(raw, type_name, shape).to(dtype)
        rows = raw.reshape(shape[0], -1)  # one row of raw data per tensor row
        out = torch.empty(shape, dtype=dtype)
        for start in range(0, shape[0], chunk_rows):
            part = rows[start : start + chunk_rows]
            out[start : start + part.shape[0]] = dequantize(part, type_name, (part.shape[0], *shape[1:]))
        return out

    def raw(self, name: str) -> torch.Tensor:
        """Tensor `name`'s stored bytes (quantized blocks), uint8 ``[rows, bytes_per_row]``, copied."""
        t = self._get(name)
        return self._view(t).view(torch.uint8).reshape(self.tensor_shape(name)[0], -1).clone()

    @staticmethod
    def _view(t) -> torch.Tensor:
        """The tensor's data as torch, without a copy (a view of the read-only memmap)."""
        with warnings.catch_warnings():  # torch warns that the memmap is not writable; we never write
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.asarray(t.data))

    def _get(self, name: str):
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        return self._tensors[name]

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds."""
        counts: dict[str, int] = {}
        for t in self._reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts


def read_model_config(f: GGUFFile) -> ModelConfig:
    """Build the `ModelConfig` from the ``{arch}.*`` metadata keys of a GGUF file."""
    arch = f.require("general.architecture")

    def key(name: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{name}", default)

    hidden = int(f.require(f"{arch}.embedding_length"))
    num_heads = int(f.require(f"{arch}.attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    vocab = key("vocab_size")
    if vocab is None:
        tokens = f.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else f.tensor_shape("token_embd.weight")[0]
    return ModelConfig(
        architecture=arch,
        name=str(f.get("general.name", os.path.basename(f.path))),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f.require(f"{arch}.feed_forward_length")),
        num_layers=int(f.require(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        context_length=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)),
        tie_word_embeddings=not f.has_tensor("output.weight"),
        attention_bias=f.has_tensor("blk.0.attn_q.bias"),
    )
