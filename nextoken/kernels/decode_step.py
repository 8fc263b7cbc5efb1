"""The one-call C decode step (``kernels/decode.c``'s ``decode_layers``) without PyTorch: which
models it runs, the table of layers it reads, and the call.

Both of its callers use this module: the engine's decode step (`layers.native_decode`, over the
model's tensors and the paged KV cache) and the first token of ``nextoken run``
(`runner.quick_start`, over the prepared-weights cache mapped with NumPy, before PyTorch is
imported). Within one call each row is one token at its position, writing its key and value at
its slot before attending to the keys up to its own position through its block table, so a run
of consecutive positions of one sequence is a causal prefill; with the final norm's weight the
call applies it too, so its rows leave as the final hidden states.
"""

from __future__ import annotations

import ctypes

from nextoken.kernels.structs import QW, DecodeArch, DecodeCall, DecodeLayer, LoRAStep, LoRAWeights

# what decode.c implements: the Llama layer (Qwen 2, Mistral), with QK-norm (Qwen 3), and
# Gemma 3's (its norms, GeGLU, sliding-window layers with their own RoPE base)
ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma3")
# what `runner.quick_start` reads from the prepared file: every layer decode.c implements
QUICK_ARCHITECTURES = ARCHITECTURES
MAX_HEAD_DIM, MAX_GROUP, MAX_ROPE_DIM = 256, 64, 512  # decode.c's guard (it returns 2 beyond these)
# a step with prefill rows runs in one call up to this many new tokens: past ~170 the PyTorch
# layers' batched prefill attention is faster (`benchmarks/native_prefill.py`). The same bound
# makes `runner.quick_start` (prompts up to it) compute the engine's arithmetic exactly.
MAX_PREFILL_TOKENS = 128
ROWS_PER_CALL = 256  # rows per decode_layers call (bounds its buffers: rows x the layer's widths)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def serves(cfg) -> bool:
    """Whether decode.c implements the layers of `cfg` (a `ModelConfig`): the architecture and
    head shapes within its guard."""
    return (cfg.architecture in ARCHITECTURES and cfg.num_heads % cfg.num_kv_heads == 0
            and cfg.num_heads // cfg.num_kv_heads <= MAX_GROUP and cfg.head_dim <= MAX_HEAD_DIM
            and cfg.rope_dim <= min(MAX_ROPE_DIM, cfg.head_dim))


def layer_table(layers: list[tuple]) -> ctypes.Array:
    """The ``layer_t`` array of every decoder layer: each ``(attn_norm, ffn_norm, [q, k, v, o, gate,
    up, down] as `QW`, k_cache, v_cache, k_scale, v_scale)``, norms bf16 ``[hidden]`` and caches
    ``[Hkv, num_blocks, block_size, head_dim]`` (bf16, or int8 with float32 row scales; None
    scales for bf16) as addresses, optionally followed by ``(q_norm, k_norm, post_attn_norm,
    post_ffn_norm, sliding)`` (`DecodeLayer`)."""
    rows = [DecodeLayer(attn, ffn, *projections, k, v, ks, vs, *rest)
            for attn, ffn, projections, k, v, ks, vs, *rest in layers]
    return (DecodeLayer * len(rows))(*rows)


def decode_layers(lib, table: ctypes.Array, cfg, h: int, t: int, inv_freq: int, positions: int, slots: int,
                  block_tables: int, max_blocks: int, num_blocks: int, block_size: int,
                  scale: float | None = None, arch: DecodeArch | None = None, lora: LoRAStep | None = None,
                  final_norm: int | None = None) -> int:
    """Run every layer of `table` over `t` rows (decode.c's ``decode_layers``), row i attending
    to ``positions[i] + 1`` keys. Addresses: h bf16 ``[t, hidden]`` (updated in place: the
    hidden states after the last layer, or with `final_norm` after the model's final norm, its
    weight bf16 ``[hidden]``, the norm of `arch`'s kind), inv_freq float32 ``[rope_dim / 2]``,
    positions, slots int64 ``[t]``, block_tables int64 ``[t, max_blocks]``. `scale`: the
    attention's (default ``head_dim ** -0.5``); `arch`: what a Gemma or sliding-window model adds
    (None: Llama's layer); `lora`: the rows' LoRA adapters (None: none). Returns 0, or 2 when the
    kernel refuses the shapes (`serves` rules that out); raises `MemoryError` when it cannot
    allocate its buffers."""
    call = DecodeCall(h, t, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim, inv_freq,
                      positions, slots, block_tables, max_blocks, num_blocks, block_size, cfg.norm_eps,
                      cfg.head_dim ** -0.5 if scale is None else scale, final_norm)
    rc = lib.decode_layers(table, _i64(cfg.num_layers), ctypes.byref(call),
                           ctypes.byref(arch) if arch is not None else None,
                           ctypes.byref(lora) if lora is not None else None)
    if rc == 1:
        raise MemoryError("native decode: out of memory for its buffers")
    return rc


__all__ = ["ARCHITECTURES", "MAX_PREFILL_TOKENS", "QUICK_ARCHITECTURES", "QW", "ROWS_PER_CALL", "DecodeArch",
           "LoRAStep", "LoRAWeights", "decode_layers", "layer_table", "serves"]
