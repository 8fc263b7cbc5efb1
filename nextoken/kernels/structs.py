"""The C kernels' structures as ctypes types, without PyTorch (shared by the PyTorch layers and
`runner.quick_start`, which runs before PyTorch is imported)."""

from __future__ import annotations

import ctypes


# The signed values the 4-bit indices of a lut weight select, by its `lut` id (ggml-common.h's grids):
# 1: IQ4_NL and IQ4_XS (kvalues_iq4nl); 2: IQ2_XXS, IQ2_XS, IQ2_S (their grids' 0x08, 0x19, 0x2b, signed);
# 3: IQ3_XXS (iq3xxs_grid's eight values, signed); 4: IQ1_S, 8 (g + delta) for iq1s_grid's g in
# -1..1 and delta +-1/8. A table of n values lies at entries 8 - n / 2 .. 7 + n / 2 of the 16 (so
# that in the symmetric ones the place of -v is that of v xor 15); the kernel reads the codes v + 128
# (`lut_codes`), and the entries no value takes are 0 (code 128).
LUT_VALUES = {
    1: (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
    2: (-43, -25, -8, 8, 25, 43),
    3: (-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62),
    4: (-9, -7, -1, 1, 7, 9),
}


def lut_table(lut: int) -> list[int]:
    """Lut id `lut`'s 16 entries: its `LUT_VALUES` centred, 0 where no value lies."""
    vals = LUT_VALUES[lut]
    start = 8 - len(vals) // 2
    return [0] * start + list(vals) + [0] * (16 - start - len(vals))


_LUT_CODES = {k: (ctypes.c_uint8 * 16)(*[v + 128 for v in lut_table(k)]) for k in LUT_VALUES}


def lut_codes(lut: int) -> int | None:
    """The address of lut id `lut`'s 16 unsigned codes (`LUT_VALUES` + 128, uint8), for `QW.lut`;
    None for 0 (no lut). Raises `KeyError` for an unknown id."""
    return ctypes.addressof(_LUT_CODES[lut]) if lut else None


class QW(ctypes.Structure):
    """``qw_t`` of ``kernels/qmatmul.c``: a weight's codes in the tiled layout (pointers), its
    bias (float32 ``[N]`` or NULL), the format's integers, the shape ``[N, K]`` and `lut` (NULL, or
    the 16 codes a lut weight's 4-bit indices stand for: `lut_codes`)."""

    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("scale_sup", ctypes.c_void_p), ("min_sup", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("offset", ctypes.c_double), ("bits", ctypes.c_int64), ("group", ctypes.c_int64),
                ("gps", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("lut", ctypes.c_void_p)]


class DecodeLayer(ctypes.Structure):
    """``layer_t`` of ``kernels/decode.c``: one decoder layer's norms (bf16), projections and
    KV cache (bf16, or int8 codes with float32 row scales; NULL scales for bf16); the QK-norm
    weights and Gemma's post-norms (NULL where the architecture has none); `sliding` 1 for a
    sliding-window layer (its caches are its ring)."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                *[(n, QW) for n in ("q", "k", "v", "o", "gate", "up", "down")],
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("post_attn_norm", ctypes.c_void_p), ("post_ffn_norm", ctypes.c_void_p),
                ("sliding", ctypes.c_int64)]


class DecodeCall(ctypes.Structure):
    """``decode_call_t`` of ``kernels/decode.c``: one ``decode_layers`` call's rows (`h` bf16
    ``[T, hidden]``, updated in place; positions and slots int64 ``[T]``; block tables int64
    ``[T, max_blocks]``; addresses) and shapes (heads, head dim, RoPE's dimensions and
    frequencies float32 ``[rope_dim / 2]``, the cache's blocks and their size, the norms'
    epsilon, the attention's scale), and the final norm's weight (bf16 ``[hidden]``, or None:
    the rows are left before it)."""

    _fields_ = [("h", ctypes.c_void_p), ("T", ctypes.c_int64), ("hidden", ctypes.c_int64), ("H", ctypes.c_int64),
                ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64), ("rope_dim", ctypes.c_int64),
                ("inv_freq", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int64), ("NB", ctypes.c_int64),
                ("BS", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("final_norm", ctypes.c_void_p)]


class DecodeArch(ctypes.Structure):
    """``arch_t`` of ``kernels/decode.c``: `gemma` (Gemma's norms and GeGLU), the sliding-window
    layers' RoPE frequencies (float32 ``[rope_dim / 2]``) and, per row of the call, its ring's
    block table (int64 ``[T, ring_max_blocks]``) and write slot (``[T]``); `window`: the sliding
    window (row i reads keys from ``max(0, position - window + 1)``)."""

    _fields_ = [("gemma", ctypes.c_int64), ("inv_freq_local", ctypes.c_void_p), ("ring_tables", ctypes.c_void_p),
                ("ring_max_blocks", ctypes.c_int64), ("ring_NB", ctypes.c_int64), ("ring_slots", ctypes.c_void_p),
                ("window", ctypes.c_int64)]


class LoRAWeights(ctypes.Structure):
    """``lora_w_t`` of ``kernels/decode.c``: one projection's adapters in a step, every adapter's A
    stacked (bf16 ``[R, K]``) and its scaled B transposed and stacked (bf16 ``[R, N]``; `b2` the
    same with each pair of ranks interleaved, ``[R / 2, N, 2]``, or None when R is odd; `a2` A
    with each pair of columns interleaved, ``[K / 2, R, 2]``, or None when K is odd; `R` the
    stacks' rows); a None `a`: no adapter of the step targets the projection."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("b2", ctypes.c_void_p), ("a2", ctypes.c_void_p),
                ("R", ctypes.c_int64)]


class LoRAStep(ctypes.Structure):
    """``lora_t`` of ``kernels/decode.c``: `w`, a `LoRAWeights` array ``[layers * 7]`` (q, k, v, o,
    gate, up, down of each layer); per row of the call (int64 ``[T]``) the first row of its
    adapter in the stacks and its rank (0: the base model)."""

    _fields_ = [("w", ctypes.c_void_p), ("row_start", ctypes.c_void_p), ("row_rank", ctypes.c_void_p)]
