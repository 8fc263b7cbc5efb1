"""The GPT-2 architecture (Radford et al. 2019), the classic design the textbooks describe.

    tokens -> token embedding + learned absolute position embedding
           -> L x [ LayerNorm -> self-attention (fused qkv projection, causal, KV cache) -> + residual
                    LayerNorm -> GELU (tanh) feed-forward                            -> + residual ]
           -> LayerNorm -> lm_head (tied to the token embedding) -> logits

No RoPE, no GQA (every head has its own keys), biases everywhere. Hugging Face stores the
projections as ``Conv1D`` (``y = x W + b``, W ``[in, out]``); we keep ``[out, in]`` like every
other `Linear`, so the loader transposes them. Numbers match `transformers`' ``GPT2LMHeadModel``
in float32 (the tests compare them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextoken.config import ModelConfig
from nextoken.layers import weight_param
from nextoken.layers.attention import AttentionMetadata, attend
from nextoken.layers.embedding import Embedding
from nextoken.layers.linear import Linear
from nextoken.runner.kv_cache import PagedKVCache

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")



def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (Ba et al. 2016): ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last
    dim, statistics in float32, result in x's dtype. x: ``[T, hidden]``."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


class GPT2Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        d = cfg.hidden_size
        self.layer, self.eps, self.num_heads, self.head_dim = layer, cfg.rms_norm_eps, cfg.num_heads, cfg.head_dim
        self.ln_1_weight, self.ln_1_bias = weight_param(d, dtype=dtype), weight_param(d, dtype=dtype)
        self.c_attn = Linear(d, 3 * d, True, dtype)  # q, k, v stacked
        self.attn_proj = Linear(d, d, True, dtype)
        self.ln_2_weight, self.ln_2_bias = weight_param(d, dtype=dtype), weight_param(d, dtype=dtype)
        self.c_fc = Linear(d, cfg.intermediate_size, True, dtype)
        self.mlp_proj = Linear(cfg.intermediate_size, d, True, dtype)
        self.scale = cfg.head_dim ** -0.5 if cfg.extra.get("scale_attn_weights", True) else 1.0
        self.gelu = cfg.extra.get("activation", "tanh")

    def forward(self, h, kv: PagedKVCache, meta: AttentionMetadata):
        t = h.shape[0]
        q, k, v = self.c_attn(layer_norm(h, self.ln_1_weight, self.ln_1_bias, self.eps)).split(
            self.num_heads * self.head_dim, dim=-1)
        q, k, v = (x.reshape(t, self.num_heads, self.head_dim) for x in (q, k, v))
        out, probs = attend(q, k, v, kv, self.layer, meta, self.scale)
        h = h + self.attn_proj(out.reshape(t, -1))
        ffn = F.gelu(self.c_fc(layer_norm(h, self.ln_2_weight, self.ln_2_bias, self.eps)), approximate=self.gelu)
        return h + self.mlp_proj(ffn), probs


class GPT2LMHeadModel(torch.nn.Module):
    """GPT-2; `forward` computes hidden states, `compute_logits` the logits."""

    NATIVE_DECODE = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.position_embeddings = weight_param(cfg.context_length, cfg.hidden_size, dtype=dtype)
        self.layers = torch.nn.ModuleList(GPT2Block(cfg, i, dtype) for i in range(cfg.num_layers))
        self.ln_f_weight, self.ln_f_bias = weight_param(cfg.hidden_size, dtype=dtype), weight_param(cfg.hidden_size, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        self.lm_head.weight = self.embed_tokens.weight
        self.native_decoder = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache,
                meta: AttentionMetadata, tracer=None) -> torch.Tensor:
        """input_ids, positions: int64 ``[T]`` -> final hidden states ``[T, hidden]``."""
        h = self.embed_tokens(input_ids) + self.position_embeddings[positions]
        if tracer is not None:
            tracer.on_embedding(h, None, None)
        for i, layer in enumerate(self.layers):
            h, probs = layer(h, kv, meta)
            if tracer is not None:
                tracer.on_layer(i, h, probs)
        return layer_norm(h, self.ln_f_weight, self.ln_f_bias, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, hidden]`` -> float32 logits ``[T, vocab]``."""
        return self.lm_head(hidden).float()

    @classmethod
    def gguf_config(cls, f, cfg: ModelConfig) -> ModelConfig:
        return cfg

    def load_gguf(self, f, int4: bool = True, keep_dense: bool = False) -> None:
        from nextoken.errors import ModelLoadError

        raise ModelLoadError(f"{f.path}: GPT-2 loads from Hugging Face folders (safetensors), not GGUF")

    def hf_weight_map(self) -> dict[str, str]:
        m = {"transformer.wte.weight": "embed_tokens.weight", "transformer.wpe.weight": "position_embeddings",
             "transformer.ln_f.weight": "ln_f_weight", "transformer.ln_f.bias": "ln_f_bias"}
        ours = {"ln_1.weight": "ln_1_weight", "ln_1.bias": "ln_1_bias", "ln_2.weight": "ln_2_weight",
                "ln_2.bias": "ln_2_bias", "attn.c_attn.weight": "c_attn.weight", "attn.c_attn.bias": "c_attn.bias",
                "attn.c_proj.weight": "attn_proj.weight", "attn.c_proj.bias": "attn_proj.bias",
                "mlp.c_fc.weight": "c_fc.weight", "mlp.c_fc.bias": "c_fc.bias",
                "mlp.c_proj.weight": "mlp_proj.weight", "mlp.c_proj.bias": "mlp_proj.bias"}
        for i in range(self.config.num_layers):
            for hf, our in ours.items():
                m[f"transformer.h.{i}.{hf}"] = f"layers.{i}.{our}"
        return m

    @staticmethod
    def hf_transform(name: str, w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous() if name.endswith(CONV1D) else w

    def load_hf(self, d) -> None:
        """Copy the tensors of `HFModelDir` d (names with or without the ``transformer.`` prefix)."""
        from nextoken.models.hf_weights import load_hf_weights

        m = self.hf_weight_map()
        if not d.has_tensor("transformer.wte.weight"):  # saved from GPT2Model: no prefix
            m = {k.removeprefix("transformer."): v for k, v in m.items()}
        load_hf_weights(self, d, m, self.hf_transform)
