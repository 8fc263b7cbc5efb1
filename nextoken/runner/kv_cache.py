"""A contiguous KV cache for one sequence.

Keys and values of every layer, position by position: ``[num_layers, capacity, num_kv_heads,
head_dim]`` each. Decode appends one position per step, so past tokens are never recomputed. The
capacity grows in chunks as the sequence grows (the paged, shared cache of the batching engine
replaces this in `engine/kv_cache`).
"""

from __future__ import annotations

import torch

from nextoken.config import ModelConfig


class KVCache:
    """Per-sequence KV cache. `num_tokens` positions are filled; `capacity` are allocated."""

    GROW = 256  # positions added at a time

    def __init__(self, config: ModelConfig, dtype: torch.dtype, capacity: int = 0):
        self.config, self.dtype = config, dtype
        shape = (config.num_layers, 0, config.num_kv_heads, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        self.num_tokens = 0
        self.reserve(capacity)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return self.k.nbytes + self.v.nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes holding the `num_tokens` filled positions."""
        return self.config.kv_bytes_per_token(self.k.element_size()) * self.num_tokens

    def reserve(self, n: int) -> None:
        """Make room for at least `n` positions, keeping what is stored."""
        if n <= self.capacity:
            return
        new_cap = -(-n // self.GROW) * self.GROW
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty((old.shape[0], new_cap, *old.shape[2:]), dtype=self.dtype)
            new[:, : self.num_tokens] = old[:, : self.num_tokens]
            setattr(self, name, new)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ``[num_tokens, num_kv_heads, head_dim]`` at positions ``[start, start+T)``
        of `layer`; return the keys and values of positions ``[0, start+T)``."""
        end = start + k.shape[0]
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def truncate(self, n: int) -> None:
        """Forget positions ``[n, num_tokens)`` (e.g. to reuse a prefix)."""
        self.num_tokens = min(self.num_tokens, n)
