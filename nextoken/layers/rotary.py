"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer", arXiv:2104.09864).

Each pair of dimensions ``(i, i + d/2)`` of a query or key head is rotated by the angle
``position * base^(-2i/d)``: the dot product of a query and a key then depends only on their
distance. This is the "rotate half" (GPT-NeoX) pairing that Hugging Face checkpoints use; GGUF
files of the `llama` architecture store Q and K permuted for the interleaved pairing instead,
and the loader undoes that permutation (`unpermute_qk`) so one RoPE serves every model.
"""

from __future__ import annotations

import torch

from nextoken.kernels import count_fallback


def inv_frequencies(rope_dim: int, base: float) -> torch.Tensor:
    """``base^(-2i/d)`` for ``i in [0, d/2)``, float32 ``[rope_dim // 2]``."""
    return 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each float32 ``[num_tokens, rope_dim]``.

    positions: int ``[num_tokens]`` (absolute positions in the sequence).
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rope_dim`` dims of every head of x.

    x: ``[num_tokens, num_heads, head_dim]``; cos, sin: ``[num_tokens, rope_dim]``.
    """
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kernel=None, store=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` of the queries ``[T, heads, head_dim]`` and the keys ``[T, kv heads,
    head_dim]``; with `kernel` (a GPU plan's row-wise kernels, `kernels.gpu.rowwise`: the same
    roundings) both in one launch, else (or for inputs it does not take, a counted fallback) one
    `apply_rope` each. `store` (`layers.attention.KVStore`): the kernel may also write the keys
    and values into the paged cache, and then sets ``store.written``."""
    if kernel is not None:
        both = kernel.apply_rope_qk(q, k, cos, sin, store)
        if both is not None:
            return both
        count_fallback("apply_rope")
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of a Q or K projection (weight ``[out, in]`` or bias ``[out]``).

    llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows
    of each head from halves ``(x_0..x_{d/2-1}, y_0..)`` to interleaved pairs ``(x_0, y_0, ...)``
    for its interleaved RoPE; this is the inverse.
    """
    out = w.shape[0]
    head_dim = out // num_heads
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
             .transpose(1, 2).reshape(out, *w.shape[1:]))
