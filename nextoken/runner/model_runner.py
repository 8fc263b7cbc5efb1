"""The model runner: loads a model file and runs forward passes (prefill and decode).

Prefill runs the whole prompt (or a chunk of it) in one forward pass; decode runs one new token
against the KV cache. Both are `forward` with a different number of new tokens.
"""

from __future__ import annotations

import time

import torch

from nextoken.config import ModelConfig
from nextoken.layers.attention import AttentionMetadata
from nextoken.loader.gguf import GGUFFile, read_model_config
from nextoken.models.registry import model_class
from nextoken.runner.kv_cache import KVCache

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"``/``"bfloat16"`` (or fp32/bf16) -> torch dtype; `ValueError` naming the choices."""
    from nextoken.errors import InvalidRequest

    if name not in DTYPES:
        raise InvalidRequest(f"dtype {name!r} is not supported; choose from {', '.join(DTYPES)}", "dtype")
    return DTYPES[name]


class ModelRunner:
    """Owns the model weights; runs `forward` over new tokens of one sequence.

    dtype: the weights' and activations' dtype (float32 is the reference; bfloat16 uses this
    CPU's AMX units). reference: use the plain attention instead of the fused kernel.
    """

    def __init__(self, gguf: GGUFFile, dtype: torch.dtype = torch.float32, reference: bool = False):
        self.config: ModelConfig = read_model_config(gguf)
        self.dtype = dtype
        self.reference = reference
        t0 = time.perf_counter()
        self.model = model_class(self.config.architecture)(self.config, dtype)
        self.model.load_gguf(gguf)
        self.model.eval()
        self.load_time = time.perf_counter() - t0

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())

    def new_kv_cache(self, capacity: int) -> KVCache:
        return KVCache(self.config, self.dtype, capacity)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], kv: KVCache, tracer=None, all_logits: bool = False) -> torch.Tensor:
        """Run the new `token_ids` after the `kv.num_tokens` cached ones; returns float32 logits
        of the last position ``[vocab]`` (or of every position ``[T, vocab]`` with all_logits).
        Appends the new keys and values to `kv`."""
        start = kv.num_tokens
        n = len(token_ids)
        kv.reserve(start + n)
        meta = AttentionMetadata(start, n, reference=self.reference, keep_probs=tracer is not None)
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = torch.arange(start, start + n)
        hidden = self.model(ids, positions, kv, meta, tracer)
        kv.num_tokens = start + n
        if all_logits:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[-1:])[0]
