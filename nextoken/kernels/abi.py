"""The C side's ABI, declared once: each function we call with its result and argument types, as
its ``.c`` file declares it (a test reads the C sources and holds the two equal). `declare` gives
a library's functions these types, so ctypes checks each call's arguments instead of guessing
C ints. The decode step's structs are `kernels.structs`."""

from __future__ import annotations

import ctypes

P = ctypes.c_void_p
_I64, _INT, _F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_PAGED = (_INT, [P, P, P, P, _I64, P, P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, P])
SIGNATURES = {  # C function -> (result type, argument types), as the .c files declare them
    "qmatmul": (_INT, [P, _INT, _I64, P, P, _INT, _I64]),
    "qmatmul_quantize": (_INT, [P, _INT, _I64, _I64, _I64, P, P]),
    "qdequant_bf16_t": (None, [P, P]),
    "qlookup_bf16": (_INT, [P, P, _I64, P]),
    "qmatmul_vectorized": (_INT, []),
    "qmatmul_loop": (ctypes.c_char_p, []),
    "qmatmul_amx": (_INT, [_INT]),
    "qmatmul_amx_takes": (_INT, [P, _I64]),
    "dense_bf16_vectorized": (_INT, []),
    "paged_decode_bf16": _PAGED,
    "paged_decode_f32": _PAGED,
    "paged_decode_int8": (_INT, [P, P, P, P, P, *_PAGED[1][3:]]),
    "paged_decode_max_head_dim": (_INT, []),
    "paged_decode_max_group": (_INT, []),
    "prefill_scores_supported": (_INT, []),
    "prefill_pack_keys": (None, [P, _I64, _I64, _I64, P]),
    "prefill_scores": (_INT, [P, P, _I64, _I64, _I64, _I64, _I64, _F32, P]),
    "prefill_softmax": (_INT, [P, _I64, _I64, _I64, _I64, P]),
    "kv_quantize_rows": (None, [P, _I64, _I64, P, P]),
    "kv_rotate_rows": (None, [P, _I64, _I64]),
    "silu_mul_bf16": (None, [P, P, P, _I64]),
    "activation_vectorized": (_INT, []),
    "rms_norm_rows_bf16": (None, [P, P, _I64, _I64, _F32, P]),
    "rms_norm_rows_gemma": (None, [P, P, _I64, _I64, _F32, P]),
    "gelu_tanh_mul_bf16": (None, [P, P, P, _I64]),
    "sample_rows": (_INT, [P, _I64, _I64, P, P, P, P, P, P, P, P]),
    "rows_finite": (None, [P, _I64, _I64, P]),
    "kept_masks": (_INT, [P, _I64, _I64, P, P, P, P, P]),
    "decode_layers": (_INT, [P, _I64, P, P, P]),  # (layer_t *, L, decode_call_t *, arch_t *, lora_t *)
    "encoder_attention": (_INT, [P, _INT, _I64, _I64, _I64, P, P, _I64, P]),
    "encoder_add_norm": (_INT, [P, P, _INT, P, P, _INT, _I64, _I64, _F32, P]),
    "encoder_gelu": (None, [P, _INT, _I64, P]),
    "encoder_linear_s8": (_INT, [P, _INT, _I64, _I64, P, P, P, P, P, _I64, _INT, P]),
    "encoder_linear_s8_loop": (ctypes.c_char_p, []),
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give every function of `lib` that we call its argument and result types (ctypes then
    checks each call's arguments instead of guessing C ints)."""
    for fn, (restype, argtypes) in SIGNATURES.items():
        if hasattr(lib, fn):
            getattr(lib, fn).restype = restype
            getattr(lib, fn).argtypes = argtypes
    return lib
