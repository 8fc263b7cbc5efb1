"""Quantization at load (``--quantization``, vLLM's flag): a Hugging Face folder's linear weights
and embedding table turned into GGUF blocks as they are loaded, then kept as codes on our kernel
like a GGUF file's.

The blocks are the `gguf` package's quantizers (`gguf.quants.quantize`: the bytes llama.cpp's
``convert_hf_to_gguf.py --outtype q8_0`` writes), from the float32 values of each tensor. Only
the formats that package can quantize and our kernel maps are offered: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1
(the K-quants need llama.cpp's importance-weighted search, which `gguf` does not implement).
The codes go to the prepared-weights cache (`loader.prepared`) under the folder's content key
and the format, so only the first start quantizes (with a progress bar); later starts map them.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from nextoken.config import QUANTIZATIONS

GGML_TYPES = {q: q.upper() for q in QUANTIZATIONS}  # flag value -> GGML type
BLOCK = 32  # values per block of every offered format


def quantizable(owner, t) -> bool:
    """Whether checkpoint tensor `t`, loaded by module `owner`, is quantized: a linear layer's
    or the embedding's 2-D weight, whole blocks per row. Norms, biases and anything else stay
    dense."""
    from nextoken.layers.embedding import Embedding
    from nextoken.layers.linear import Linear

    return isinstance(owner, (Linear, Embedding)) and len(t.shape) == 2 and t.shape[1] % BLOCK == 0


class Progress:
    """One progress bar over the tensors quantized in this load, shown from the first one (a
    later start that maps every tensor from the prepared-weights cache shows none)."""

    def __init__(self, total: int, fmt: str):
        self.total, self.fmt, self.bar = total, fmt, None

    def step(self, name: str) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="tensor", desc=f"quantizing to {self.fmt}", file=sys.stderr,
                            leave=False)
        self.bar.set_postfix_str(name, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


QUANTIZE_ROWS = 4096  # rows per call of the quantizer: its float32 temporaries stay a few MiB


def quantize_rows(values: torch.Tensor, type_name: str) -> torch.Tensor:
    """``values [rows, cols]`` float32 -> GGUF blocks ``[rows, cols / 32 * bytes_per_block]``
    uint8 of GGML type `type_name` (`gguf.quants.quantize`), `QUANTIZE_ROWS` rows at a time."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    out = torch.empty(rows, cols // block * size, dtype=torch.uint8)
    for start in range(0, rows, QUANTIZE_ROWS):
        part = values[start:start + QUANTIZE_ROWS].contiguous().numpy()
        out[start:start + QUANTIZE_ROWS] = torch.from_numpy(quantize(part, qtype))
    return out


def dequantize_rows(raw: torch.Tensor, type_name: str, cols: int) -> torch.Tensor:
    """GGUF blocks ``[rows, bytes]`` -> float32 ``[rows, cols]`` (`gguf.quants.dequantize`)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[type_name])).reshape(-1, cols)


def at_load(t, type_name: str, progress: Progress):
    """Checkpoint tensor `t` (dense) as a tensor of GGML type `type_name`: its blocks are computed
    on first read (`raw`) and kept until a read reaches the last row (the loader packs a tensor
    in row chunks, in order), so a load holds one tensor's blocks at a time; its dense values are
    those blocks de-quantized, so every path that reads it sees the same weights."""
    blocks: list[torch.Tensor] = []
    rows = t.shape[0]

    def raw_blocks() -> torch.Tensor:
        if not blocks:
            progress.step(t.name)
            blocks.append(quantize_rows(t.dense(torch.float32), type_name))
        return blocks[0]

    def read_raw(start: int, stop: int | None) -> torch.Tensor:
        part = raw_blocks()[start:stop]
        if stop is None or stop >= rows:
            blocks.clear()  # read to the end: the packed codes hold it now
        return part

    def read_dense(dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(raw_blocks(), type_name, t.shape[1]).to(dtype)

    return replace(t, type_name=type_name, read_dense=read_dense, read_raw=read_raw, row_head_dim=None,
                   read_mapped=None)
