"""The paged KV cache's tensors: keys and values of every layer, in blocks.

``k[layer]`` and ``v[layer]`` are ``[num_kv_heads, num_blocks, block_size, head_dim]``
(head-major, so gathering a batch's blocks gives ``[heads, batch, tokens, head_dim]``, the
layout the attention matmuls want, with no further copy); a token whose slot is ``s`` lives at
``[:, s // block_size, s % block_size]``. Which request owns which block is decided by
`nextoken.engine.kv_cache`.
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
        shape = (config.num_layers, config.num_kv_heads, num_blocks, block_size, config.head_dim)
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
        heads = k.shape[1]
        self.k[layer].view(heads, -1, k.shape[2]).index_copy_(1, slot_mapping, k.transpose(0, 1))
        self.v[layer].view(heads, -1, v.shape[2]).index_copy_(1, slot_mapping, v.transpose(0, 1))
