"""`DecoderModel`: what every decoder-only model here shares.

    tokens -> embed (token table, scaled or plus learned positions)
           -> rope tables (one per attention kind, or none)
           -> L x layer(h, delta, rope, kv cache, attention metadata) -> (h, delta)
           -> final norm of h + delta            (`forward`: hidden states)
           -> LM head, float32                   (`compute_logits`)

h is the residual stream; a layer may leave its last sublayer's output `delta` for the next
layer to add (None: added already), so that on a GPU plan the add runs inside the next norm's
launch (`layers.norm.add_rms_norm`), and on a GPU plan's decode `delta` may be the down
projection's product itself (`layers.linear.Pending`), computed in that launch too; a tracer
always sees h with delta added (and no product left pending).

An architecture file subclasses it and says what differs: `make_layer` (the decoder layer),
and where needed `embed`, `rope`, `final_norm`, `compute_logits`. Model files describe the
architecture only: how weights are read from a checkpoint is `nextoken.loader.weights`, and
which kernels run is the model runner's execution plan (`nextoken.runner.plan`).
"""

from __future__ import annotations

import torch

from nextoken.config import ModelConfig
from nextoken.layers import weight_param
from nextoken.layers.attention import AttentionMetadata
from nextoken.layers.embedding import Embedding
from nextoken.layers.linear import Linear
from nextoken.layers.norm import add_rms_norm
from nextoken.layers.rotary import inv_frequencies, rope_cos_sin
from nextoken.kv_cache.tensors import PagedKVCache

Rope = dict[bool, tuple[torch.Tensor, torch.Tensor]] | None  # sliding? -> (cos, sin) ``[T, rope_dim]``


class DecoderModel(torch.nn.Module):
    """Embedding, decoder layers, final norm, LM head (tied to the embedding table when the
    config says so). `forward` computes hidden states, `compute_logits` the logits."""

    TP_PLAN: dict | None = None  # how its projections split under tensor parallelism (`distributed.sharding`)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(self.make_layer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = weight_param(cfg.hidden_size, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        self.lm_head.few_rows = True  # one row per sequence
        self.lm_head.float_out = True  # (compute_logits widens them: on codes the kernel writes float32)
        self.norm_kernel = None  # set by the execution plan at load: the final RMSNorm on our C kernel
        if cfg.tie_word_embeddings:  # one table serves both, until the loader says otherwise
            self.lm_head.weight = self.embed_tokens.weight
        if cfg.rope_dim:
            self.register_buffer("inv_freq", inv_frequencies(cfg.rope_dim, cfg.rope_theta), persistent=False)

    def make_layer(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> torch.nn.Module:
        """Decoder layer `layer`: ``layer(h, rope, kv, meta) -> h``."""
        raise NotImplementedError

    # -- the data flow ------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, hidden]`` in the model's dtype."""
        return self.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor) -> Rope:
        """The RoPE tables of this pass, in the model's dtype, once per pass (not per layer):
        ``{sliding: (cos, sin)}`` for full and sliding-window layers (the same table here)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq)  # [T, rope_dim] each, float32
        table = (cos.to(self.dtype), sin.to(self.dtype))
        return {False: table, True: table}

    def final_norm(self, h: torch.Tensor, delta: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
        """The final norm of the residual stream h ``[T, hidden]`` plus the last layer's `delta`
        not yet added to it (None: nothing pending), in one launch on a GPU plan's kernels.
        `in_place`: the C kernel may write it over h (`add_rms_norm`)."""
        return add_rms_norm(h, delta, self.norm, self.config.norm_eps, self.norm_kernel, in_place=in_place)[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache,
                meta: AttentionMetadata, tracer=None) -> torch.Tensor:
        """input_ids, positions: int64 ``[T]`` (the new tokens of every sequence in the batch,
        flattened) -> final hidden states ``[T, hidden]``.

        Writes this pass's keys and values into `kv` at ``meta.slot_mapping``. `tracer`, when
        given, is called with what each stage produced (see `nextoken.trace`).
        """
        h, delta = self.embed(input_ids, positions), None
        rope = self.rope(positions)
        if tracer is not None:
            tracer.on_embedding(h, *(rope[False] if rope else (None, None)))
            meta.ablation = getattr(tracer, "ablation", None)  # (a traced pass: its intervention, if any)
        for i, layer in enumerate(self.layers):
            if meta.probs:  # tracing: each layer's probabilities, one list per layer
                meta.probs = []
            if tracer is not None:
                meta.mid = []
            h, delta = layer(h, delta, rope, kv, meta)
            if tracer is not None:  # (the whole residual stream: its pending sublayer output added)
                h, delta = (h if delta is None else h + delta), None
                if getattr(tracer, "patch", None) is not None:  # (activation patching: another prompt's residual)
                    h = tracer.patched(i, h)
                tracer.on_layer(i, h, meta.probs, meta.mid[0] if meta.mid else None)
        return self.final_norm(h, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, hidden]`` -> float32 logits ``[T, vocab]``."""
        logits = self.lm_head(hidden)
        return logits if logits.dtype == torch.float32 else logits.float()  # (float32 already: no call, see `NativeDecoder`)
