"""Causal self-attention over a KV cache, with grouped-query heads.

``softmax(q k^T / sqrt(d) + causal_mask) v`` (Vaswani et al. 2017), where query heads are split
into groups that share one key/value head (GQA; Ainslie et al. 2023). Two backends compute the
same function: `attention_reference` (plain matmuls, returns the attention probabilities, used
by the tests and by `nextoken explain`) and `attention_sdpa` (PyTorch's fused
``scaled_dot_product_attention``, the default). The tests hold them equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs to know about the tokens of one forward pass of one sequence.

    start_pos: how many tokens of the sequence are already in the KV cache (0 for a prefill);
    num_tokens: how many new tokens this pass computes (the prompt for a prefill, 1 for a decode).
    The new tokens occupy positions ``[start_pos, start_pos + num_tokens)``.
    """

    start_pos: int
    num_tokens: int
    reference: bool = False  # use `attention_reference` instead of the fused kernel
    keep_probs: bool = False  # keep attention probabilities for tracing (forces the reference)

    @property
    def seq_len(self) -> int:
        """Tokens the new queries can see: everything cached plus themselves."""
        return self.start_pos + self.num_tokens


def causal_mask(meta: AttentionMetadata, device=None) -> torch.Tensor:
    """Boolean ``[num_tokens, seq_len]``: True where query i (absolute position start_pos + i)
    may attend key j, i.e. ``j <= start_pos + i``."""
    q_pos = torch.arange(meta.start_pos, meta.seq_len, device=device)[:, None]
    k_pos = torch.arange(meta.seq_len, device=device)[None, :]
    return k_pos <= q_pos


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive masked attention in float32.

    q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[seq_len, num_kv_heads, head_dim]``.
    Returns the output ``[num_tokens, num_heads, head_dim]`` (q's dtype) and the probabilities
    ``[num_heads, num_tokens, seq_len]`` (float32).
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    qf = q.float().transpose(0, 1)  # [H, T, D]
    scores = qf @ kf.transpose(1, 2) * scale  # [H, T, S]
    scores = scores.masked_fill(~causal_mask(meta, q.device), float("-inf"))
    probs = scores.softmax(dim=-1)
    out = (probs @ vf).transpose(0, 1)  # [T, H, D]
    return out.to(q.dtype), probs


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                   scale: float) -> torch.Tensor:
    """Fused attention (``torch.nn.functional.scaled_dot_product_attention``); shapes as in
    `attention_reference`, output only."""
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T|S, D]
    if meta.num_tokens == 1:  # a decode sees every cached token: no mask
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    elif meta.start_pos == 0:  # a whole prompt: the plain causal mask
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:  # a chunk after cached tokens: causal with an offset
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_mask(meta, q.device),
                                             scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
