"""The Gemma 3 architecture (Gemma Team 2025, "Gemma 3 Technical Report"), text only.

    tokens -> embedding * sqrt(hidden)
           -> L x [ RMSNorm -> self-attention -> RMSNorm -> + residual
                    RMSNorm -> GeGLU feed-forward -> RMSNorm -> + residual ]
           -> RMSNorm -> lm_head (tied) -> logits

Differences from `llama.LlamaForCausalLM`:
- query/key RMSNorm over each head (before RoPE), and attention scaled by
  ``query_pre_attn_scalar ** -0.5``;
- an RMSNorm after attention and after the feed-forward too, before each residual add; Gemma's
  RMSNorm multiplies in float32 (`layers.norm.rms_norm_gemma`);
- GeGLU (tanh-approximated GELU) instead of SwiGLU; embeddings scaled by ``sqrt(hidden)``;
- local layers (5 of every 6) attend to a sliding window of the last `sliding_window` keys with
  RoPE base ``rope_local_theta`` (10000), keeping only that window in the cache
  (`layers.sliding_attention`); global layers attend to everything with base `rope_theta`
  (divided by ``rope_scaling_factor``, linear scaling).
Numbers match `transformers`' ``Gemma3ForCausalLM`` in float32 (the tests compare them). Norm
weights are kept as GGUF stores them (``w``; `transformers` stores ``w - 1``).
"""

from __future__ import annotations

import torch

from nextoken.config import ModelConfig
from nextoken.layers import weight_param
from nextoken.layers.activation import gelu_tanh_and_mul
from nextoken.layers.norm import add_rms_norm, rms_norm_gemma
from nextoken.layers.rotary import inv_frequencies, rope_cos_sin
from nextoken.models.base import DecoderModel
from nextoken.models.llama import TP_PLAN, LlamaAttention, LlamaMLP


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma's QK-norm (float32 product) and scale
    ``query_pre_attn_scalar ** -0.5``."""

    QK_NORM = staticmethod(rms_norm_gemma)

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__(cfg, layer, dtype, qk_norm=True)
        self.scale = cfg.attention_scale


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.eps = cfg.norm_eps
        d = cfg.hidden_size
        self.input_layernorm, self.post_attention_layernorm = weight_param(d, dtype=dtype), weight_param(d, dtype=dtype)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = weight_param(d, dtype=dtype), weight_param(d, dtype=dtype)
        self.self_attn = Gemma3Attention(cfg, layer, dtype)
        self.mlp = LlamaMLP(cfg, dtype, act=gelu_tanh_and_mul)
        self.norm_kernel = None  # set by the execution plan at load (our C norm, or a GPU plan's Triton norms)

    def forward(self, h, delta, rope, kv, meta):
        """h: the residual stream ``[T, hidden]`` (`delta` is always None: each add here comes
        with the post-norm of what it adds, `models.base`) -> (h, None)."""
        cos, sin = rope[self.self_attn.sliding]
        nk = self.norm_kernel
        attn = self.self_attn(rms_norm_gemma(h, self.input_layernorm, self.eps, nk), cos, sin, kv, meta)
        h, x = add_rms_norm(h, attn, self.pre_feedforward_layernorm, self.eps, nk, gemma=True,
                            a_weight=self.post_attention_layernorm)
        if meta.mid is not None:
            meta.mid.append(h)
        if meta.ablation is not None and meta.ablation.drops_mlp(self.self_attn.layer):
            return h, None
        h, _ = add_rms_norm(h, self.mlp(x, defer=meta.mid is None), None, self.eps, nk, gemma=True,
                            a_weight=self.post_feedforward_layernorm)
        return h, None


class Gemma3ForCausalLM(DecoderModel):
    """Gemma 3 text decoder."""

    TP_PLAN = TP_PLAN  # Llama's projections, by the same names

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(cfg, dtype)
        scaling = float(cfg.extra.get("rope_scaling_factor", 1.0))  # linear scaling of the global layers
        self.inv_freq = self.inv_freq / scaling
        self.register_buffer("inv_freq_local", inv_frequencies(cfg.rope_dim, cfg.extra.get("rope_local_theta", 10000.0)),
                             persistent=False)
        # sqrt(hidden) rounded to the activations' dtype, as transformers' Gemma3TextScaledWordEmbedding
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype)

    def make_layer(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(cfg, layer, dtype)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def rope(self, positions: torch.Tensor):
        """Two tables: global layers (`rope_theta`) and sliding-window layers (the local base)."""
        tables = {}
        for sliding, inv in ((False, self.inv_freq), (True, self.inv_freq_local)):
            cos, sin = rope_cos_sin(positions, inv)
            tables[sliding] = (cos.to(self.dtype), sin.to(self.dtype))
        return tables

    def final_norm(self, h: torch.Tensor, delta: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
        return add_rms_norm(h, delta, self.norm, self.config.norm_eps, self.norm_kernel, gemma=True,
                            in_place=in_place)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.extra.get("final_logit_softcapping")
        return logits if not cap else torch.tanh(logits / cap) * cap
