"""The paged KV cache's tensors: keys and values of every layer, in blocks.

``k[layer]`` and ``v[layer]`` are ``[num_kv_heads, num_blocks, block_size, head_dim]``
(head-major, so gathering a batch's blocks gives ``[heads, batch, tokens, head_dim]``, the
layout the attention matmuls want, with no further copy); a token whose slot is ``s`` lives at
``[:, s // block_size, s % block_size]``. Which request owns which block is decided by
`nextoken.kv_cache`.

Sliding-window layers (Gemma 3's local layers) attend only to their last `window` keys, so they
keep no more than that: each sequence owns a ring of `ring_blocks` blocks in `SlidingKVCache`,
and position ``p`` lives in ring block ``(p // block_size) % ring_blocks``. The ring is just
large enough that the keys a pass still needs are never overwritten by the keys it writes.
"""

from __future__ import annotations

import torch

from nextoken.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, keys and values."""
    return config.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size


def ring_blocks(window: int, block_size: int, max_decode_rows: int = 1) -> int:
    """Blocks a sliding-window layer's ring needs per sequence: the `window` - 1 keys before a
    pass's first decode row, plus the `max_decode_rows` (1 + drafted tokens) that pass writes,
    spread over at most one more block than they fill. (A prefill chunk reads the keys before
    it first, then writes only its last ``ring_blocks * block_size`` tokens.)"""
    return -(-(window - 1 + max_decode_rows) // block_size) + 1


class SlidingKVCache:
    """Rings of the sliding-window layers: k, v ``[num_sliding_layers, Hkv, num_blocks,
    block_size, head_dim]``; each sequence owns `ring_blocks` of the `num_blocks`."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, ring_blocks: int, dtype: torch.dtype):
        self.window, self.ring_blocks, self.num_blocks, self.block_size = \
            config.sliding_window, ring_blocks, num_blocks, block_size
        shape = (len(config.sliding_layers), config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.layer_index = {layer: i for i, layer in enumerate(config.sliding_layers)}


class PagedKVCache:
    """Keys and values for `num_blocks` blocks of `block_size` tokens in every full-attention
    layer (``k[layer_index[layer]]``), and `sliding` for the sliding-window layers, if any."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 sliding: SlidingKVCache | None = None):
        self.config, self.num_blocks, self.block_size, self.dtype = config, num_blocks, block_size, dtype
        shape = (len(config.full_layers), config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.layer_index = {layer: i for i, layer in enumerate(config.full_layers)}
        self.sliding = sliding

    @property
    def nbytes(self) -> int:
        extra = self.sliding.k.nbytes + self.sliding.v.nbytes if self.sliding is not None else 0
        return self.k.nbytes + self.v.nbytes + extra

    @property
    def bytes_per_token(self) -> int:
        """Bytes of the paged (full-attention) cache per token."""
        return (self.k.nbytes + self.v.nbytes) // (self.num_blocks * self.block_size)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ``[num_tokens, num_kv_heads, head_dim]`` at their slots ``[num_tokens]``."""
        heads = k.shape[1]
        self.k[layer].view(heads, -1, k.shape[2]).index_copy_(1, slot_mapping, k.transpose(0, 1))
        self.v[layer].view(heads, -1, v.shape[2]).index_copy_(1, slot_mapping, v.transpose(0, 1))
