"""Opening a model, whatever form it comes in: a GGUF file or a Hugging Face folder.

    open_model(path) -> GGUFFile | HFModelDir   (`catalog.resolve_model` turns --model into a path)
    load_tokenizer(source) -> Tokenizer
    model_dtype(source, "auto") -> torch dtype
"""

from __future__ import annotations

import os

import torch

from nextoken.errors import InvalidRequest, ModelLoadError
from nextoken.loader.gguf import GGUFFile
from nextoken.loader.hf import HFModelDir, generation_eos_ids, is_hf_dir


def open_model(path: str | os.PathLike) -> GGUFFile | HFModelDir:
    """A `GGUFFile` for a file, an `HFModelDir` for a folder with config.json. Raises
    `ModelLoadError` for a folder without config.json."""
    if os.path.isdir(path):
        if not is_hf_dir(path):
            raise ModelLoadError(f"{path} is a folder without config.json; give a .gguf file or a Hugging Face "
                                 "model folder (config.json, *.safetensors, tokenizer.json)")
        return HFModelDir(path)
    return GGUFFile(path)


def load_tokenizer(source, merges_cache: bool = True):
    """The tokenizer of a `GGUFFile` (its metadata) or an `HFModelDir` (tokenizer.json).
    `merges_cache`: a GGUF SentencePiece vocabulary's merges kept in the user's cache
    (`Tokenizer.from_gguf`; off with ``--no-prepared-cache``)."""
    from nextoken.tokenizer import Tokenizer

    if isinstance(source, HFModelDir):
        return Tokenizer.from_hf_dir(source.path, generation_eos_ids(source))
    if not merges_cache:
        return Tokenizer.from_gguf(source)
    from nextoken.loader.prepared import merges_path

    return Tokenizer.from_gguf(source, merges_path(source.path))


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"``/``"bfloat16"`` (or fp32/bf16) -> torch dtype; `InvalidRequest` otherwise."""
    if name not in DTYPES:
        raise InvalidRequest(f"dtype {name!r} is not supported; choose from {', '.join(DTYPES)}", "dtype")
    return DTYPES[name]


def model_dtype(source, name: str) -> torch.dtype:
    """`name` as a dtype; ``"auto"``: bfloat16 for GGUF (our kernels), the folder's config dtype
    for Hugging Face (float16 runs as bfloat16 here)."""
    if name != "auto":
        return parse_dtype(name)
    return source.config_dtype if isinstance(source, HFModelDir) else torch.bfloat16
