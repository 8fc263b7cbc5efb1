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
  (`layers.sliding_attention`); global layers attend to everything with base `rope_theta`.
Numbers match `transformers`' ``Gemma3ForCausalLM`` in float32 (the tests compare them).
"""

from __future__ import annotations

import dataclasses

import torch

from nextoken.config import ModelConfig
from nextoken.layers import weight_param
from nextoken.layers.activation import gelu_tanh_and_mul
from nextoken.layers.attention import AttentionMetadata
from nextoken.layers.embedding import Embedding
from nextoken.layers.linear import Linear
from nextoken.layers.norm import rms_norm_gemma
from nextoken.layers.rotary import inv_frequencies, rope_cos_sin
from nextoken.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from nextoken.runner.kv_cache import PagedKVCache

GGUF_SLIDING_PATTERN = 6  # llama.cpp: every 6th layer is global (llama-model.cpp, LLM_ARCH_GEMMA3)
GGUF_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's `rope_freq_base_train_swa` for Gemma 3



class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma's QK-norm (float32 product) and scale
    ``query_pre_attn_scalar ** -0.5``."""

    QK_NORM = staticmethod(rms_norm_gemma)

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__(cfg, layer, dtype, qk_norm=True)
        self.scale = float(cfg.extra.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        d = cfg.hidden_size
        self.input_layernorm, self.post_attention_layernorm = weight_param(d, dtype=dtype), weight_param(d, dtype=dtype)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = weight_param(d, dtype=dtype), weight_param(d, dtype=dtype)
        self.self_attn = Gemma3Attention(cfg, layer, dtype)
        self.mlp = LlamaMLP(cfg, dtype, act=gelu_tanh_and_mul)

    def forward(self, h, rope, kv, meta):
        cos, sin = rope[self.self_attn.sliding]
        attn, probs = self.self_attn(rms_norm_gemma(h, self.input_layernorm, self.eps), cos, sin, kv, meta)
        h = h + rms_norm_gemma(attn, self.post_attention_layernorm, self.eps)
        ffn = self.mlp(rms_norm_gemma(h, self.pre_feedforward_layernorm, self.eps))
        h = h + rms_norm_gemma(ffn, self.post_feedforward_layernorm, self.eps)
        return h, probs


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder. Loading (GGUF codes, tied head) is `LlamaForCausalLM`'s, with this
    architecture's tensor names; norm weights are stored as GGUF has them (``1 + w``)."""

    GGUF_PERMUTED_QK = False
    NATIVE_DECODE = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        torch.nn.Module.__init__(self)
        self.config, self.dtype = cfg, dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(Gemma3DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = weight_param(cfg.hidden_size, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        scaling = float(cfg.extra.get("rope_scaling_factor", 1.0))  # linear scaling of the global layers
        self.register_buffer("inv_freq", inv_frequencies(cfg.rope_dim, cfg.rope_theta) / scaling, persistent=False)
        self.register_buffer("inv_freq_local", inv_frequencies(cfg.rope_dim, cfg.extra.get("rope_local_theta", 10000.0)),
                             persistent=False)
        # sqrt(hidden) rounded to the activations' dtype, as transformers' Gemma3TextScaledWordEmbedding
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype)
        self.native_decoder = None

    @classmethod
    def gguf_config(cls, f, cfg: ModelConfig) -> ModelConfig:
        """Gemma 3 settings that GGUF leaves to llama.cpp's code: the local/global layer pattern,
        the local RoPE base, the attention scale (1/sqrt(head_dim) below 27B)."""
        window = f.get("gemma3.attention.sliding_window")
        types = tuple("full_attention" if (i + 1) % GGUF_SLIDING_PATTERN == 0 else "sliding_attention"
                      for i in range(cfg.num_layers))
        extra = {"rope_local_theta": GGUF_LOCAL_ROPE_BASE, "query_pre_attn_scalar": cfg.head_dim}
        factor = f.get("gemma3.rope.scaling.factor")
        if factor:
            extra["rope_scaling_factor"] = float(factor)
        return dataclasses.replace(cfg, sliding_window=int(window) if window else None,
                                   layer_types=types if window else None, extra=extra)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache,
                meta: AttentionMetadata, tracer=None) -> torch.Tensor:
        """input_ids, positions: int64 ``[T]`` -> final hidden states ``[T, hidden]`` (see
        `LlamaForCausalLM.forward`)."""
        h = self.embed_tokens(input_ids) * self.embed_scale
        rope = {}
        for sliding, inv in ((False, self.inv_freq), (True, self.inv_freq_local)):
            cos, sin = rope_cos_sin(positions, inv)
            rope[sliding] = (cos.to(self.dtype), sin.to(self.dtype))
        if tracer is not None:
            tracer.on_embedding(h, *rope[False])
        for i, layer in enumerate(self.layers):
            h, probs = layer(h, rope, kv, meta)
            if tracer is not None:
                tracer.on_layer(i, h, probs)
        return rms_norm_gemma(h, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.extra.get("final_logit_softcapping")
        return logits if not cap else torch.tanh(logits / cap) * cap

    def hf_transform(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """transformers' Gemma3RMSNorm stores ``w - 1``; we keep ``w`` (as GGUF does)."""
        return w + 1 if name.endswith("norm.weight") else w

    def gguf_weight_map(self) -> dict[str, tuple[str, int | None]]:
        m = {"token_embd.weight": ("embed_tokens.weight", None), "output_norm.weight": ("norm", None)}
        if not self.config.tie_word_embeddings:
            m["output.weight"] = ("lm_head.weight", None)
        names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                 "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                 "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                 "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                 "ffn_down.weight": "mlp.down_proj.weight"}
        for i in range(self.config.num_layers):
            for g, ours in names.items():
                key = f"blk.{i}.{g}" if g.endswith(".weight") else f"blk.{i}.{g}.weight"
                m[key] = (f"layers.{i}.{ours}", None)
        return m
