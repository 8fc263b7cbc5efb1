"""The GPT-2 architecture (Radford et al. 2019), the classic design the textbooks describe.

    tokens -> token embedding + learned absolute position embedding
           -> L x [ LayerNorm -> self-attention (fused qkv projection, causal, KV cache) -> + residual
                    LayerNorm -> GELU (tanh) feed-forward                            -> + residual ]
           -> LayerNorm -> lm_head (tied to the token embedding) -> logits

No RoPE, no GQA (every head has its own keys), biases everywhere. Numbers match
`transformers`' ``GPT2LMHeadModel`` in float32 (the tests compare them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextoken.config import ModelConfig
from nextoken.layers import weight_param
from nextoken.layers.attention import AttentionMetadata, attend
from nextoken.layers.linear import Linear
from nextoken.kv_cache.tensors import PagedKVCache
from nextoken.models.base import DecoderModel


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (Ba et al. 2016): ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last
    dim, statistics in float32, result in x's dtype. x: ``[T, hidden]``."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


class GPT2Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        d = cfg.hidden_size
        self.layer, self.eps, self.num_heads, self.head_dim = layer, cfg.norm_eps, cfg.num_heads, cfg.head_dim
        self.ln_1_weight, self.ln_1_bias = weight_param(d, dtype=dtype), weight_param(d, dtype=dtype)
        self.c_attn = Linear(d, 3 * d, True, dtype)  # q, k, v stacked
        self.attn_proj = Linear(d, d, True, dtype)
        self.ln_2_weight, self.ln_2_bias = weight_param(d, dtype=dtype), weight_param(d, dtype=dtype)
        self.c_fc = Linear(d, cfg.intermediate_size, True, dtype)
        self.mlp_proj = Linear(cfg.intermediate_size, d, True, dtype)
        self.scale = cfg.head_dim ** -0.5 if cfg.extra.get("scale_attn_weights", True) else 1.0
        self.gelu = cfg.extra.get("activation", "tanh")

    def forward(self, h, delta, rope, kv: PagedKVCache, meta: AttentionMetadata):
        """h: the residual stream ``[T, hidden]`` (`delta` is always None: the block adds its
        own, `models.base`) -> (h, None)."""
        t = h.shape[0]
        q, k, v = self.c_attn(layer_norm(h, self.ln_1_weight, self.ln_1_bias, self.eps)).split(
            self.num_heads * self.head_dim, dim=-1)
        q, k, v = (x.reshape(t, self.num_heads, self.head_dim) for x in (q, k, v))
        out = attend(q, k, v, kv, self.layer, meta, self.scale)
        h = h + self.attn_proj(out.reshape(t, -1))
        if meta.mid is not None:
            meta.mid.append(h)
        if meta.ablation is not None and meta.ablation.drops_mlp(self.layer):
            return h, None
        ffn = F.gelu(self.c_fc(layer_norm(h, self.ln_2_weight, self.ln_2_bias, self.eps)), approximate=self.gelu)
        return h + self.mlp_proj(ffn), None


class GPT2LMHeadModel(DecoderModel):
    """GPT-2: learned positions added to the embedding, no RoPE, a LayerNorm (weight and bias)
    at the end; the head is always tied."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(cfg, dtype)
        self.position_embeddings = weight_param(cfg.context_length, cfg.hidden_size, dtype=dtype)
        self.norm_bias = weight_param(cfg.hidden_size, dtype=dtype)
        self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> GPT2Block:
        return GPT2Block(cfg, layer, dtype)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.position_embeddings[positions]

    def rope(self, positions: torch.Tensor):
        return None  # learned absolute positions instead

    def final_norm(self, h: torch.Tensor, delta: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
        return layer_norm(h, self.norm, self.norm_bias, self.config.norm_eps)  # (delta: always None here; a new tensor)
