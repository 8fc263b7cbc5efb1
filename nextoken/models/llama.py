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
from nextoken.layers.embedding import Embedding
from nextoken.layers.attention import AttentionMetadata, attend
from nextoken.layers.linear import Linear
from nextoken.layers.native_decode import NativeDecoder
from nextoken.kernels import enabled as native_enabled, load as load_kernel
from nextoken.layers.quant_linear import empty_int4, int4_groups, int4_supported, pack_int4
from nextoken.layers.qweight import QuantWeight, gguf_codes, qweight_supported
from nextoken.layers.norm import rms_norm
from nextoken.layers.rotary import apply_rope, inv_frequencies, rope_cos_sin, unpermute_qk
from nextoken.runner.kv_cache import PagedKVCache


LOAD_CHUNK_ROWS = 4096  # rows converted at a time when packing int4 (a multiple of 64)


class LlamaAttention(torch.nn.Module):
    """q/k/v projections, RoPE, attention over the paged cache (or, on a sliding-window layer,
    over the sequence's ring), output projection. With `qk_norm` (Qwen 3), an RMSNorm over each
    query and key head before RoPE."""

    QK_NORM = staticmethod(rms_norm)

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, qk_norm: bool = False):
        super().__init__()
        self.layer, self.eps = layer, cfg.rms_norm_eps
        self.sliding = cfg.is_sliding(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias, dtype)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias, dtype)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias, dtype)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, dtype)
        self.scale = cfg.head_dim ** -0.5
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = torch.nn.Parameter(torch.empty(cfg.head_dim, dtype=dtype), requires_grad=False)
            self.k_norm = torch.nn.Parameter(torch.empty(cfg.head_dim, dtype=dtype), requires_grad=False)

    def forward(self, x, cos, sin, kv: PagedKVCache, meta: AttentionMetadata):
        """x: ``[T, hidden]`` -> (``[T, hidden]``, per-sequence probabilities or None)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.QK_NORM(q, self.q_norm, self.eps), self.QK_NORM(k, self.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, probs = attend(q, k, v, kv, self.layer, meta, self.scale, self.sliding)
        return self.o_proj(out.reshape(t, -1)), probs


class LlamaMLP(torch.nn.Module):
    """Gated feed-forward: ``down(act(gate(x), up(x)))``; `act` SwiGLU (Llama) or GeGLU (Gemma)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, act=silu_and_mul):
        super().__init__()
        self.act = act
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, qk_norm: bool = False):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = torch.nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.self_attn = LlamaAttention(cfg, layer, dtype, qk_norm)
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
    NATIVE_DECODE = True  # the C decode step (`layers.native_decode`) implements exactly this layer
    QK_NORM = False  # RMSNorm on each query/key head (Qwen 3)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype, self.QK_NORM) for i in range(cfg.num_layers))
        self.norm = torch.nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        if cfg.tie_word_embeddings:  # one table serves both, unless the loader packs the head as int4
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inv_frequencies(cfg.rope_dim, cfg.rope_theta), persistent=False)
        self.native_decoder: NativeDecoder | None = None  # set after loading, when every linear has codes

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache,
                meta: AttentionMetadata, tracer=None) -> torch.Tensor:
        """input_ids, positions: int64 ``[T]`` (the new tokens of every sequence in the batch,
        flattened) -> final hidden states ``[T, hidden]``.

        Writes this pass's keys and values into `kv` at ``meta.slot_mapping``. `tracer`, when
        given, is called with what each stage produced (see `nextoken.trace`).
        """
        h = self.embed_tokens(input_ids)  # [T, hidden]
        if self.native_decoder is not None and tracer is None and meta.num_decodes == meta.num_seqs and \
                not (meta.reference or meta.keep_probs) and native_enabled():
            out = self.native_decoder(h, positions, kv, meta)  # every layer in one C call
            if out is not None:
                return rms_norm(out, self.norm, self.config.rms_norm_eps)
        cos, sin = rope_cos_sin(positions, self.inv_freq)  # [T, rope_dim] each, float32
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)  # once per pass, not per layer
        if tracer is not None:
            tracer.on_embedding(h, cos, sin)
        for i, layer in enumerate(self.layers):
            h, probs = layer(h, cos, sin, kv, meta)
            if tracer is not None:
                tracer.on_layer(i, h, probs)
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, hidden]`` -> float32 logits ``[T, vocab]``."""
        return self.lm_head(hidden).float()

    # -- weights ----------------------------------------------------------------------------
    @classmethod
    def gguf_config(cls, f, cfg: ModelConfig) -> ModelConfig:
        """`cfg` (read from the GGUF metadata by `loader.gguf.read_model_config`) completed with
        what this architecture's GGUF files leave implicit. Nothing, for Llama."""
        return cfg

    def gguf_weight_map(self) -> dict[str, tuple[str, int | None]]:
        """GGUF tensor name -> (our parameter name, heads to un-permute for or None)."""
        cfg = self.config
        permute = self.GGUF_PERMUTED_QK
        m = {"token_embd.weight": ("embed_tokens.weight", None), "output_norm.weight": ("norm", None)}
        if not cfg.tie_word_embeddings:
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

    def hf_weight_map(self) -> dict[str, str]:
        """Hugging Face tensor name -> our parameter name (the layouts agree: no permutation)."""
        m = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm"}
        if not self.config.tie_word_embeddings:
            m["lm_head.weight"] = "lm_head.weight"
        for name, _ in self.named_parameters():
            if name.startswith("layers."):
                m["model." + name + ("" if name.endswith((".weight", ".bias")) else ".weight")] = name
        return m

    def hf_transform(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """A Hugging Face tensor in our layout (unchanged for Llama)."""
        return w

    def load_hf(self, d) -> None:
        """Copy the tensors of `HFModelDir` d into our parameters (dense, in our dtype). Raises
        `ModelLoadError` naming a tensor that is missing or has the wrong shape."""
        from nextoken.models.hf_weights import load_hf_weights

        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        load_hf_weights(self, d, self.hf_weight_map(), self.hf_transform)

    def load_gguf(self, f, int4: bool = True, keep_dense: bool = False) -> None:
        """Copy every tensor of `GGUFFile` f into our parameters (de-quantized to our dtype).

        With `int4` (and bf16), block-quantized weights stay quantized: as GGUF codes for our C
        kernel (`layers.qweight`: Q4_0/Q4_1/Q4_K/Q5_0/Q8_0/Q6_K linears and embedding tables,
        a tied head sharing the table's codes) when it builds and native kernels are on; else
        (--enforce-eager) Q4_0/Q4_1/Q4_K/Q8_0 linears packed for PyTorch's int4 kernel
        (`layers.quant_linear`) and a Q8_0 embedding as int8. Nothing else keeps a de-quantized
        copy, unless `keep_dense` asks for a bf16 copy of every int4 linear weight too (faster
        for batches of many sequences on PyTorch's path, at several times the memory; codes
        never need one). Raises `ModelLoadError` naming
        a tensor that is missing or has the wrong shape.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        # our C kernel (when it builds) keeps every block format as codes; else PyTorch's int4
        codes = int4 and self.dtype == torch.bfloat16 and load_kernel("qmatmul") is not None
        weight_map = self.gguf_weight_map()
        if self.config.tie_word_embeddings:  # the head reads the embedding table
            weight_map = {**weight_map, "token_embd.weight#head": ("lm_head.weight", None)}
        for key, (ours, heads) in weight_map.items():
            gguf_name = key.split("#")[0]
            target = params[ours]
            if not f.has_tensor(gguf_name):
                raise ModelLoadError(f"tensor {gguf_name} is missing from the GGUF file")
            shape = f.tensor_shape(gguf_name)
            if shape != tuple(target.shape):
                raise ModelLoadError(f"tensor {gguf_name} has shape {shape}, expected {tuple(target.shape)}")
            kind = f.tensor_type(gguf_name)
            module = self.get_submodule(ours.rsplit(".", 1)[0]) if "." in ours else None
            if codes and ours == "lm_head.weight" and self.embed_tokens.qweight is not None and \
                    gguf_name == "token_embd.weight":  # tied: the head reads the embedding's codes
                self.lm_head.set_qweight(self.embed_tokens.qweight)
                continue
            if codes and isinstance(module, (Linear, Embedding)) and ours.endswith(".weight") and \
                    qweight_supported(kind, *target.shape):
                qw = self._load_codes(f, gguf_name, target.shape, heads)
                if isinstance(module, Embedding):
                    module.set_qweight(qw)
                    continue
                module.set_qweight(qw)  # the kernel serves every call: no dense copy
                continue
            elif int4 and isinstance(module, Linear) and ours.endswith(".weight") and \
                    int4_supported(kind, *target.shape, self.dtype):
                self._load_int4(f, gguf_name, module, heads, keep_dense)
                if not keep_dense:
                    continue
            if int4 and not codes and not keep_dense and isinstance(module, Embedding) and kind == "Q8_0" and \
                    self.dtype == torch.bfloat16:
                module.set_q8_0(f.raw(gguf_name))
                continue
            if ours == "lm_head.weight" and self.config.tie_word_embeddings:
                if self.embed_tokens.weight is not None:  # a dense table: share it
                    self.lm_head.weight = self.embed_tokens.weight
                    continue
                self.lm_head.weight = torch.nn.Parameter(torch.empty(shape, dtype=self.dtype), requires_grad=False)
                target = self.lm_head.weight
            w = f.tensor(gguf_name, self.dtype)
            if heads is not None:
                w = unpermute_qk(w, heads)
            target.data.copy_(w)
        self.native_decoder = NativeDecoder(self) if codes and NativeDecoder.available(self) else None

    def _load_codes(self, f, gguf_name: str, shape, heads: int | None) -> QuantWeight:
        """A block-quantized tensor as `QuantWeight` codes, `LOAD_CHUNK_ROWS` rows at a time (Q/K,
        un-permuted by head, in one go)."""
        rows, cols = shape
        kind = f.tensor_type(gguf_name)
        chunk = rows if heads is not None else LOAD_CHUNK_ROWS
        parts = []
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            plain = gguf_codes(f.raw(gguf_name, start, stop), kind, stop - start, cols)
            if heads is not None:
                plain = plain.map_rows(lambda t: unpermute_qk(t, heads))
            parts.append(QuantWeight.pack(plain))
        return parts[0] if len(parts) == 1 else QuantWeight.cat(parts)

    def _load_int4(self, f, gguf_name: str, module: Linear, heads: int | None, keep_dense: bool = False) -> None:
        """Pack a 4-bit (or Q8_0) tensor as int4 parts, `LOAD_CHUNK_ROWS` rows at a time so the
        int32 and float32 temporaries stay small. Q/K (un-permuted by head) are small: in one go.
        The LM head always runs the int4 kernel: its calls have few rows (one per sequence)."""
        rows, cols, kind = module.out_features, module.in_features, f.tensor_type(gguf_name)
        chunk = rows if heads is not None else LOAD_CHUNK_ROWS
        parts = None
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            groups = int4_groups(f.raw(gguf_name, start, stop), kind, stop - start, cols)
            if parts is None:
                parts = [empty_int4(rows, cols, self.dtype) for _ in groups]
            for (q, scale, zero), (packed, sz) in zip(groups, parts):
                if heads is not None:
                    q, scale, zero = (unpermute_qk(t, heads) for t in (q, scale, zero))
                packed[start:stop], sz[:, start:stop] = pack_int4(q, scale, zero, self.dtype)
        module.set_int4(parts, keep_dense)
        module.int4_only = module is self.lm_head
