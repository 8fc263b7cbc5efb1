"""The Llama architecture (Touvron et al. 2023), as SmolLM2 uses it.

    tokens -> embedding
           -> L x [ RMSNorm -> self-attention (RoPE, GQA, causal, KV cache) -> + residual
                    RMSNorm -> SwiGLU feed-forward                           -> + residual ]
           -> RMSNorm -> lm_head -> logits

`models.base.DecoderModel.forward` is the whole data flow; this file gives the layer. Numbers
match `transformers`' ``LlamaForCausalLM`` in float32 (the tests compare them).
"""

from __future__ import annotations

import torch

from nextoken.config import ModelConfig
from nextoken.layers import weight_param
from nextoken.layers.activation import silu_and_mul
from nextoken.layers.attention import AttentionMetadata, attend, kv_store
from nextoken.layers.linear import Linear, deferred, qkv_rope, silu_mul_down
from nextoken.layers.norm import add_rms_norm, rms_norm
from nextoken.layers.rotary import apply_rope_qk
from nextoken.kv_cache.tensors import PagedKVCache
from nextoken.models.base import DecoderModel


# tensor parallelism (`nextoken.distributed.sharding`): projection -> (split, by what)
TP_PLAN = {"self_attn.q_proj": ("colwise", "heads"), "self_attn.k_proj": ("colwise", "kv_heads"),
           "self_attn.v_proj": ("colwise", "kv_heads"), "self_attn.o_proj": ("rowwise", "heads"),
           "mlp.gate_proj": ("colwise", "ffn"), "mlp.up_proj": ("colwise", "ffn"), "mlp.down_proj": ("rowwise", "ffn")}


class LlamaAttention(torch.nn.Module):
    """q/k/v projections, RoPE, attention over the paged cache (or, on a sliding-window layer,
    over the sequence's ring), output projection. With `qk_norm` (Qwen 3, Gemma 3), an RMSNorm
    over each query and key head before RoPE."""

    QK_NORM = staticmethod(rms_norm)

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, qk_norm: bool = False):
        super().__init__()
        self.layer, self.eps = layer, cfg.norm_eps
        self.sliding = cfg.is_sliding(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias, dtype)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias, dtype)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias, dtype)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, dtype)
        self.scale = cfg.head_dim ** -0.5
        self.q_norm = self.k_norm = None
        self.qk_norm_kernel = None  # set by the execution plan at load (a GPU plan's Triton norms)
        self.rope_kernel = None  # likewise (a GPU plan's Triton RoPE)
        self.qkv = None  # likewise: q, k and v as one matmul (a GPU plan's `layers.linear.FusedLinear`)
        if qk_norm:
            self.q_norm, self.k_norm = weight_param(cfg.head_dim, dtype=dtype), weight_param(cfg.head_dim, dtype=dtype)

    def forward(self, x, cos, sin, kv: PagedKVCache, meta: AttentionMetadata):
        """x: ``[T, hidden]`` -> the o projection's output ``[T, hidden]``, or, where a GPU plan
        puts the add and norm after it in the same launch (and no tracer reads it), that product
        still `layers.linear.Pending`."""
        t = x.shape[0]
        store = kv_store(kv, self.layer, meta, self.sliding, None) if self.rope_kernel is not None else None
        q, k, v, roped = self._project(x, cos, sin, store)
        if not roped:
            if self.q_norm is not None:
                nk = self.qk_norm_kernel
                q, k = self.QK_NORM(q, self.q_norm, self.eps, nk), self.QK_NORM(k, self.k_norm, self.eps, nk)
            if store is not None:
                store.v = v
            q, k = apply_rope_qk(q, k, cos, sin, self.rope_kernel, store)
        out = attend(q, k, v, kv, self.layer, meta, self.scale, self.sliding, store is not None and store.written)
        out = out.reshape(t, -1)
        return deferred(self.o_proj, out, lambda: self.o_proj(out), defer=meta.mid is None)

    def _project(self, x, cos, sin, store):
        """q ``[T, heads, D]``, k, v ``[T, kv heads, D]``, and whether RoPE is applied (and `store`
        written) already: a GPU plan's decode of few rows does both in the q/k/v GEMV's launch
        (`layers.linear.qkv_rope`; not with a norm on the heads, which comes before RoPE)."""
        t, d = x.shape[0], self.head_dim
        y = None
        if self.qkv is not None and self.q_norm is None:
            y = qkv_rope(self.qkv, x, cos, sin, store, d, self.num_heads * d, self.num_kv_heads * d)
        if y is not None:
            q, k, v = y.split(self.qkv.sizes, dim=-1)
        elif self.qkv is not None and self.qkv.usable():
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d),
                y is not None)


class LlamaMLP(torch.nn.Module):
    """Gated feed-forward: ``down(act(gate(x), up(x)))``; `act` SwiGLU (Llama) or GeGLU (Gemma).
    `act_kernel` (set by the execution plan at load: a library handle or None) lets `act` take
    our C kernel."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, act=silu_and_mul):
        super().__init__()
        self.act = act
        self.act_kernel = None
        self.gate_up = None  # set by the execution plan at load: gate and up as one matmul (a GPU plan's)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x, defer: bool = False):
        """x ``[T, hidden]`` -> ``[T, hidden]``; with `defer` (its output goes only to the next
        residual add and norm), where a GPU plan puts them in the down projection's launch, a
        `layers.linear.Pending` for them (`layers.linear.deferred`)."""
        gate, up = self.gate_up(x) if self.gate_up is not None and self.gate_up.usable() else \
            (self.gate_proj(x), self.up_proj(x))
        if self.act is silu_and_mul and 0 < gate.shape[0] <= self.down_proj.silu_rows:  # a GPU plan's decode:
            return deferred(self.down_proj, gate, lambda: self._silu_down(gate, up), up, defer)  # SiLU in the GEMV
        act = self.act(gate, up, kernel=self.act_kernel)
        return deferred(self.down_proj, act, lambda: self.down_proj(act), defer=defer)

    def _silu_down(self, gate, up):
        y = silu_mul_down(self.down_proj, gate, up)  # (one launch for both)
        return y if y is not None else self.down_proj(self.act(gate, up, kernel=self.act_kernel))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, qk_norm: bool = False):
        super().__init__()
        self.eps = cfg.norm_eps
        self.input_layernorm = weight_param(cfg.hidden_size, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, layer, dtype, qk_norm)
        self.post_attention_layernorm = weight_param(cfg.hidden_size, dtype=dtype)
        self.mlp = LlamaMLP(cfg, dtype)
        self.norm_kernel = None  # set by the execution plan at load: RMSNorm on our C kernel

    def forward(self, h, delta, rope, kv, meta):
        """h: the residual stream ``[T, hidden]``, delta: the last layer's feed-forward output not
        yet added to it (or None) -> (h, this layer's feed-forward output, not added), each add
        inside the next norm's launch (`models.base`); on a GPU plan's decode each product may come
        as a `layers.linear.Pending`, computed in that launch too."""
        cos, sin = rope[self.self_attn.sliding]
        nk = self.norm_kernel
        h, x = add_rms_norm(h, delta, self.input_layernorm, self.eps, nk)
        h, x = add_rms_norm(h, self.self_attn(x, cos, sin, kv, meta), self.post_attention_layernorm, self.eps, nk)
        if meta.mid is not None:
            meta.mid.append(h)
        if meta.ablation is not None and meta.ablation.drops_mlp(self.self_attn.layer):
            return h, None
        return h, self.mlp(x, defer=meta.mid is None)


class LlamaForCausalLM(DecoderModel):
    """Decoder-only transformer with Llama's layer."""

    QK_NORM = False  # RMSNorm on each query/key head (Qwen 3)
    TP_PLAN = TP_PLAN

    def make_layer(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, layer, dtype, self.QK_NORM)
