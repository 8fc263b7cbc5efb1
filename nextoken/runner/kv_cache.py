"""The paged KV cache's tensors: keys and values of every layer, in blocks.

``k[layer]`` and ``v[layer]`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token
whose slot is ``s`` lives at ``[s // block_size, s % block_size]``. Which request owns which
block is decided by `nextoken.engine.kv_cache`.
"""

from __future__ import annotations

import torch

from nextoken.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, keys and values."""
    return config.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size


class PagedKVCache:
    """Keys and values for `num_blocks` blocks of `block_size` tokens in every layer."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.config, self.num_blocks, self.block_size, self.dtype = config, num_blocks, block_size, dtype
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // (self.num_blocks * self.block_size)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ``[num_tokens, num_kv_heads, head_dim]`` at their slots ``[num_tokens]``."""
        kl = self.k[layer].view(-1, *k.shape[1:])
        vl = self.v[layer].view(-1, *v.shape[1:])
        kl.index_copy_(0, slot_mapping, k)
        vl.index_copy_(0, slot_mapping, v)
