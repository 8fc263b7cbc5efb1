"""The Llama architecture (Touvron et al. 2023), as SmolLM2 uses it.

    tokens -> embedding
           -> L x [ RMSNorm -> self-attention (RoPE, GQA, causal, KV cache) -> + residual
                    RMSNorm -> SwiGLU feed-forward                           -> + residual ]
           -> RMSNorm -> lm_head -> logits

Read top to bottom: `LlamaForCausalLM.forward` is the whole data flow. Numbers match
`transformers`' ``LlamaForCausalLM`` in float32 (the tests compare them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextoken.config import ModelConfig
from nextoken.errors import ModelLoadError
from nextoken.layers.activation import silu_and_mul
from nextoken.layers.attention import AttentionMetadata, paged_attention, paged_attention_reference
from nextoken.layers.linear import Linear
from nextoken.layers.quant_linear import int4_groups, int4_supported, pack_int4
from nextoken.layers.norm import rms_norm
from nextoken.layers.rotary import apply_rope, inv_frequencies, rope_cos_sin, unpermute_qk
from nextoken.runner.kv_cache import PagedKVCache


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias, dtype)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias, dtype)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias, dtype)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, dtype)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos, sin, kv: PagedKVCache, meta: AttentionMetadata):
        """x: ``[T, hidden]`` -> (``[T, hidden]``, per-sequence probabilities or None)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(self.layer, meta.slot_mapping, k, v)
        probs = None
        if meta.reference or meta.keep_probs:
            out, probs = paged_attention_reference(q, kv.k[self.layer], kv.v[self.layer], meta, self.scale)
        else:
            out = paged_attention(q, kv.k[self.layer], kv.v[self.layer], meta, self.scale)
        return self.o_proj(out.reshape(t, -1)), probs


class LlamaMLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = torch.nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.self_attn = LlamaAttention(cfg, layer, dtype)
        self.post_attention_layernorm = torch.nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype),
                                                           requires_grad=False)
        self.mlp = LlamaMLP(cfg, dtype)

    def forward(self, h, cos, sin, kv, meta):
        attn, probs = self.self_attn(rms_norm(h, self.input_layernorm, self.eps), cos, sin, kv, meta)
        h = h + attn
        h = h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))
        return h, probs


class LlamaForCausalLM(torch.nn.Module):
    """Decoder-only transformer; `forward` computes hidden states, `compute_logits` the logits."""

    # GGUF files of this architecture store Q and K permuted for interleaved RoPE.
    GGUF_PERMUTED_QK = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.embed_tokens = torch.nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                               requires_grad=False)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = torch.nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        self.register_buffer("inv_freq", inv_frequencies(cfg.rope_dim, cfg.rope_theta), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache,
                meta: AttentionMetadata, tracer=None) -> torch.Tensor:
        """input_ids, positions: int64 ``[T]`` (the new tokens of every sequence in the batch,
        flattened) -> final hidden states ``[T, hidden]``.

        Writes this pass's keys and values into `kv` at ``meta.slot_mapping``. `tracer`, when
        given, is called with what each stage produced (see `nextoken.trace`).
        """
        h = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        cos, sin = rope_cos_sin(positions, self.inv_freq)  # [T, rope_dim] each
        if tracer is not None:
            tracer.on_embedding(h, cos, sin)
        for i, layer in enumerate(self.layers):
            h, probs = layer(h, cos, sin, kv, meta)
            if tracer is not None:
                tracer.on_layer(i, h, probs)
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, hidden]`` -> float32 logits ``[T, vocab]``."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w).float()

    # -- weights ----------------------------------------------------------------------------
    def gguf_weight_map(self) -> dict[str, tuple[str, int | None]]:
        """GGUF tensor name -> (our parameter name, heads to un-permute for or None)."""
        cfg = self.config
        permute = self.GGUF_PERMUTED_QK
        m = {"token_embd.weight": ("embed_tokens", None), "output_norm.weight": ("norm", None)}
        if self.lm_head is not None:
            m["output.weight"] = ("lm_head.weight", None)
        for i in range(cfg.num_layers):
            p, a = f"blk.{i}.", f"layers.{i}.self_attn."
            m[p + "attn_norm.weight"] = (f"layers.{i}.input_layernorm", None)
            m[p + "ffn_norm.weight"] = (f"layers.{i}.post_attention_layernorm", None)
            for g, ours, heads in (("q", "q_proj", cfg.num_heads), ("k", "k_proj", cfg.num_kv_heads),
                                   ("v", "v_proj", None)):
                h = heads if permute else None
                m[p + f"attn_{g}.weight"] = (a + ours + ".weight", h)
                if cfg.attention_bias:
                    m[p + f"attn_{g}.bias"] = (a + ours + ".bias", h)
            m[p + "attn_output.weight"] = (a + "o_proj.weight", None)
            for g in ("gate", "up", "down"):
                m[p + f"ffn_{g}.weight"] = (f"layers.{i}.mlp.{g}_proj.weight", None)
        return m

    def load_gguf(self, f, int4: bool = True) -> None:
        """Copy every tensor of `GGUFFile` f into our parameters (de-quantized to our dtype).

        With `int4` (and bf16), linear weights stored in a 4-bit format also keep a packed copy
        for small batches (`layers.linear.Linear`). Raises `ModelLoadError` naming a tensor that
        is missing or has the wrong shape.
        """
        params = dict(self.named_parameters())
        for gguf_name, (ours, heads) in self.gguf_weight_map().items():
            target = params[ours]
            shape = f.tensor_shape(gguf_name) if f.has_tensor(gguf_name) else None
            if shape is not None and shape != tuple(target.shape):
                raise ModelLoadError(f"tensor {gguf_name} has shape {shape}, expected {tuple(target.shape)}")
            if int4 and ours.endswith(".weight") and int4_supported(f.tensor_type(gguf_name), *target.shape, self.dtype):
                self._load_int4(f, gguf_name, ours, heads)
            w = f.tensor(gguf_name, self.dtype)
            if heads is not None:
                w = unpermute_qk(w, heads)
            target.data.copy_(w)

    def _load_int4(self, f, gguf_name: str, ours: str, heads: int | None) -> None:
        module = self.get_submodule(ours.rsplit(".", 1)[0])
        q, scale, zero = int4_groups(f.raw(gguf_name), f.tensor_type(gguf_name), module.out_features,
                                     module.in_features)
        if heads is not None:
            q, scale, zero = (unpermute_qk(t, heads) for t in (q, scale, zero))
        module.set_int4(*pack_int4(q, scale, zero, self.dtype))
