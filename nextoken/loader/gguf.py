"""Reading GGUF files: metadata into a `ModelConfig`, tensors by name.

The header is read in one pass by `gguf_header.read_header` (the `gguf` package's ``GGUFReader``,
the reference, takes seconds on a large vocabulary and serves files ours does not take); we
only interpret it. GGUF key names follow llama.cpp's ``gguf-py/gguf/constants.py``. Tensor bytes are read with plain file
reads, a row range at a time, rather than through the reader's memory map: pages of a map count
in the process's resident memory while it lives, and the loader converts each tensor into its own
layout anyway. `release_metadata` drops the parsed lists (vocabulary, merges) once the tokenizer and config
have been read. PyTorch is imported only to read tensors: the metadata, the config and the
tokenizer come without it (`runner.quick_start` reads them before PyTorch is imported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nextoken.config import ModelConfig
from nextoken.errors import ModelLoadError

if TYPE_CHECKING:
    import numpy
    import torch


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: GGML type name, PyTorch-order shape, file offset, size."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) >= 2 else 1


class GGUFFile:
    """One GGUF file, opened read-only and memory-mapped.

    Raises `ModelLoadError` when the file is missing, truncated or not GGUF, with a message that
    says what to do.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise ModelLoadError(f"model file not found: {self.path}; give a path to a .gguf file or a "
                                 "catalog name (see `nextoken models`)")
        try:
            fields, tensors = _read(self.path)
        except Exception as exc:  # the readers raise ValueError/struct errors/IndexError on damage
            raise ModelLoadError(
                f"{self.path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                "it may be truncated or corrupt: download it again (nextoken pull NAME)"
            ) from None
        self._fields: dict[str, Any] | None = fields  # None after release_metadata
        self._tensors = {t[0]: TensorInfo(*t) for t in tensors}
        self._scalars: dict[str, Any] | None = None  # set by release_metadata
        self._check_complete()

    def _check_complete(self) -> None:
        size = os.path.getsize(self.path)
        for t in self._tensors.values():
            if t.offset + t.nbytes > size:
                raise ModelLoadError(
                    f"{self.path} is truncated (tensor {t.name} ends past the end of the file); "
                    "download it again (nextoken pull NAME)"
                )

    # -- metadata ---------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (str, number, bool or list), or `default` if absent.

        After `release_metadata` only scalar values remain; asking for a list then raises
        `ModelLoadError`."""
        if self._scalars is not None:
            if key in self._scalars:
                value = self._scalars[key]
                if value is _RELEASED:
                    raise ModelLoadError(f"{self.path}: metadata {key!r} was released after loading")
                return value
            return default
        return self._fields.get(key, default)

    def release_metadata(self) -> None:
        """Keep scalar metadata and the tensor table; free the parsed lists (vocabulary, merges)."""
        if self._scalars is not None:
            return
        self._scalars = {key: _RELEASED if isinstance(v, list) else v for key, v in self._fields.items()}
        self._fields = None

    def require(self, key: str) -> Any:
        """Like `get`, but raises `ModelLoadError` naming the key when it is absent."""
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value

    def keys(self) -> list[str]:
        return list(self._scalars) if self._scalars is not None else list(self._fields)

    # -- tensors ----------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        """The GGML type name of tensor `name` (``"Q4_1"``, ``"F32"`` ...)."""
        return self._get(name).type_name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """PyTorch-order shape (rows first) of tensor `name`."""
        return self._get(name).shape

    def tensor_nbytes(self, name: str) -> int:
        """The bytes tensor `name` takes in the file (its codes, for a quantized format)."""
        return self._get(name).nbytes

    def tensor(self, name: str, dtype: torch.dtype | None = None, chunk_rows: int | None = None) -> torch.Tensor:
        """Tensor `name` de-quantized to `dtype` (float32 by default), PyTorch-order shape
        ``[rows, cols]``. Raises `ModelLoadError` naming the tensor for a format nothing here reads.

        Rows are de-quantized `chunk_rows` at a time (by default as many as make
        `host_memory.SCRATCH_ELEMENTS` values) straight into the result, with the pieces'
        temporaries kept in the heap between pieces (`host_memory.scratch_allocations`), so no
        float32 copy of a large tensor is ever held at once and the temporaries' pages are not
        faulted in again for every piece.
        """
        import torch

        from nextoken.layers.quantization.ggml import dequantize
        from nextoken.loader.host_memory import SCRATCH_ELEMENTS, scratch_allocations

        dtype = torch.float32 if dtype is None else dtype
        t = self._get(name)
        if chunk_rows is None:
            chunk_rows = max(1, SCRATCH_ELEMENTS // max(1, math.prod(t.shape[1:])))
        try:
            if len(t.shape) < 2 or t.shape[0] <= chunk_rows:
                return dequantize(self.raw(name), t.type_name, t.shape).to(dtype)
            out = torch.empty(t.shape, dtype=dtype)
            with scratch_allocations(), open(self.path, "rb") as fh:
                for start in range(0, t.shape[0], chunk_rows):
                    part = self.raw(name, start, min(start + chunk_rows, t.shape[0]), fh)
                    out[start : start + part.shape[0]] = dequantize(part, t.type_name, (part.shape[0], *t.shape[1:]))
            return out
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path}: tensor {name}: {e}") from None

    def raw(self, name: str, start: int = 0, stop: int | None = None, fh=None) -> torch.Tensor:
        """Stored bytes of rows ``[start, stop)`` of tensor `name` (quantized blocks), uint8
        ``[rows, bytes_per_row]``, read from the file (`fh`: this file open for reading, else it
        is opened here) into a new buffer."""
        t = self._get(name)
        stop = t.rows if stop is None else stop
        row_bytes = t.nbytes // t.rows
        buf = bytearray(row_bytes * (stop - start))
        with contextlib.nullcontext(fh) if fh is not None else open(self.path, "rb") as f:
            f.seek(t.offset + start * row_bytes)
            if f.readinto(buf) != len(buf):
                raise ModelLoadError(f"{self.path} is truncated inside tensor {name}; download it again")
        import torch

        return torch.frombuffer(buf, dtype=torch.uint8).view(stop - start, row_bytes)

    def array(self, name: str) -> numpy.ndarray:
        """Tensor `name` of type F32, F16 or BF16 as float32 NumPy values in its PyTorch-order
        shape (norm weights, biases), without PyTorch. Raises `ModelLoadError` for another type."""
        import numpy as np

        t = self._get(name)
        kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
        if t.type_name not in kinds:
            raise ModelLoadError(f"{self.path}: tensor {name} is {t.type_name}, not F32, F16 or BF16")
        count = t.nbytes // np.dtype(kinds[t.type_name]).itemsize
        with open(self.path, "rb") as fh:
            fh.seek(t.offset)
            values = np.fromfile(fh, dtype=kinds[t.type_name], count=count)
        if values.size != count:
            raise ModelLoadError(f"{self.path} is truncated inside tensor {name}; download it again")
        if t.type_name == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32).reshape(t.shape)

    def _get(self, name: str):
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        return self._tensors[name]

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds."""
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts


_RELEASED = object()  # marks a list value dropped by `release_metadata`


def _read(path: str) -> tuple[dict[str, Any], list[tuple]]:
    """Metadata and tensor table by our one-pass reader (`gguf_header`), or by the `gguf`
    package's reader (the reference) for a file ours does not take."""
    from nextoken.loader.gguf_header import GGUFHeaderError, read_header

    try:
        return read_header(path)
    except GGUFHeaderError:
        return read_header_reference(path)


def read_header_reference(path: str) -> tuple[dict[str, Any], list[tuple]]:
    """The same as `gguf_header.read_header`, by ``gguf.GGUFReader`` (seconds for a large
    vocabulary: it builds an array view per item)."""
    import gguf  # imported here: it is slow to import and not every command needs it

    reader = gguf.GGUFReader(path, "r")
    fields = {key: field.contents() for key, field in reader.fields.items()}
    tensors = [(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), int(t.data_offset),
                int(t.n_bytes)) for t in reader.tensors]
    return fields, tensors


GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every 6th layer is global (llama-model.cpp, LLM_ARCH_GEMMA3)
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's `rope_freq_base_train_swa` for Gemma 3


def read_model_config(f: GGUFFile) -> ModelConfig:
    """Build the `ModelConfig` from the ``{arch}.*`` metadata keys of a GGUF file, completed
    with what an architecture's GGUF files leave to llama.cpp's code (`_architecture_defaults`)."""
    return _architecture_defaults(f, _read_config(f))


def _architecture_defaults(f: GGUFFile, cfg: ModelConfig) -> ModelConfig:
    """Gemma 3: the local/global layer pattern, the local RoPE base, the attention scale
    (1/sqrt(head_dim) below 27B) and linear RoPE scaling. Other architectures: nothing."""
    if cfg.architecture != "gemma3":
        return cfg
    window = f.get("gemma3.attention.sliding_window")
    types = tuple("full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                  for i in range(cfg.num_layers))
    extra = {"rope_local_theta": GEMMA3_LOCAL_ROPE_BASE, "query_pre_attn_scalar": cfg.head_dim}
    factor = f.get("gemma3.rope.scaling.factor")
    if factor:
        extra["rope_scaling_factor"] = float(factor)
    return dataclasses.replace(cfg, sliding_window=int(window) if window else None,
                               layer_types=types if window else None, extra=extra)


def _read_config(f: GGUFFile) -> ModelConfig:
    arch = f.require("general.architecture")

    def key(name: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{name}", default)

    hidden = int(f.require(f"{arch}.embedding_length"))
    num_heads = int(f.require(f"{arch}.attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    vocab = key("vocab_size")
    if vocab is None:
        vocab = f.tensor_shape("token_embd.weight")[0]
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
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)),
        tie_word_embeddings=not f.has_tensor("output.weight"),
        attention_bias=f.has_tensor("blk.0.attn_q.bias"),
    )
