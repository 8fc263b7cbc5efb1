"""Frozen configuration dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """The hyper-parameters of a decoder-only transformer, read from GGUF metadata.

    Sizes are counts (not bytes). `rope_dim` is the number of leading dimensions of each head that
    RoPE rotates (equal to `head_dim` unless the model uses partial rotary embeddings).
    """

    architecture: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    norm_eps: float  # epsilon of the model's normalization (RMSNorm, or LayerNorm for GPT-2)
    rope_theta: float
    rope_dim: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # sliding-window attention (Beltagy et al. 2020; Gemma 3's local layers): layer i attends to
    # the last `sliding_window` keys when ``layer_types[i] == "sliding_attention"``, else to all
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` uses sliding-window attention."""
        return self.sliding_window is not None and (
            self.layer_types is None or self.layer_types[layer] == "sliding_attention")

    @property
    def attention_scale(self) -> float:
        """The attention's scale: ``query_pre_attn_scalar ** -0.5`` (Gemma 3's; by default the
        head size, Vaswani et al.'s ``1 / sqrt(d_k)``)."""
        return float(self.extra.get("query_pre_attn_scalar", self.head_dim)) ** -0.5

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sliding(i)]

    @property
    def full_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_sliding(i)]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of paged KV cache one token takes over the full-attention layers (keys and
        values); sliding-window layers keep only their window (`kv_cache.tensors.SlidingKVCache`)."""
        return 2 * len(self.full_layers) * self.num_kv_heads * self.head_dim * dtype_bytes

    def sliding_kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes one token of the sliding-window layers' ring takes (keys and values)."""
        return 2 * len(self.sliding_layers) * self.num_kv_heads * self.head_dim * dtype_bytes


KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype (`kv_cache.tensors`)
QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # --quantization: formats a folder is quantized to at load


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. `num_blocks` blocks of `block_size` tokens each, for all layers."""

    block_size: int = 16
    num_blocks: int = 0  # 0: derive from memory_bytes
    memory_bytes: int | None = None  # budget for keys and values; None: a share of free memory
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    disk_dir: str | None = None  # the prefix cache's disk tier (`kv_cache.disk`); None: RAM only
    disk_bytes: int | None = None  # its size limit; None: `kv_cache.disk.DEFAULT_DISK_BYTES`


SCHEDULING_POLICIES = ("fcfs", "priority", "fair")  # `engine.request_queue`


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits per step: running sequences and new tokens (prefill chunks + decodes); the order of
    the waiting requests (`engine.request_queue`: "fcfs", "priority" or "fair") and the priority
    policy's starvation guard (seconds of waiting per priority level; 0: none)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # tokens per sequence (prompt + output); None: the model's context
    scheduling_policy: str = "fcfs"
    priority_aging_s: float = 10.0


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a proposer guesses up to
    `num_speculative_tokens` tokens per decode step and the target model checks them in one pass.

    method: ``"draft"`` (a smaller model with the same vocabulary, `model`) or ``"ngram"``
    (prompt lookup: continue the most recent earlier occurrence of the last `ngram_max` ..
    `ngram_min` tokens; no second model). With `adapt_length`, per request, the next draft is one
    token longer than the last verification accepted, and after a verification that accepted
    nothing the request skips drafting for 1, 2, 4, then 8 steps (each drafted token costs a
    verification row, and a draft model's pass); without it every draft is as long as allowed,
    which the engine chooses for n-gram lookup where a few more rows cost about one row's pass
    (`ExecutionPlan.cheap_verification`).
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    adapt_length: bool = True
    # no drafting in steps with more running decodes than this: batched decode already uses the
    # compute that verification would need (vLLM's speculative_disable_by_batch_size)
    disable_by_batch_size: int | None = 4

