"""Weight-only int4 linears: GGUF 4-bit blocks kept packed, multiplied by PyTorch's CPU kernel.

PyTorch's ``_weight_int4pack_mm_for_cpu`` computes ``x @ W^T`` with
``W[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]`` (group size 32, q in 0..15).
Each GGML 4-bit format maps onto that exactly (ggml-common.h block layouts):

- Q4_0: ``x = d * (q - 8)``            -> scale d, zero 0
- Q4_1: ``x = d * q + m``              -> scale d, zero m + 8 d
- Q4_K: ``x = d sc_j * q - dmin m_j``  -> scale d sc_j, zero 8 d sc_j - dmin m_j (per 32-group j)

The mapping is the formula rearranged, so it equals the de-quantized float32 weights
(`nextoken.loader.dequant`, the reference) up to float32 rounding; tests compare both.
"""

from __future__ import annotations

import torch

from nextoken.loader.dequant import _f16, _nibbles, _q4_k_scales

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def int4_groups(raw: torch.Tensor, type_name: str, rows: int, cols: int):
    """Raw blocks of a ``[rows, cols]`` 4-bit tensor -> (q int32 ``[rows, cols]`` in 0..15,
    scale ``[rows, cols // 32]``, zero ``[rows, cols // 32]``), float32."""
    if type_name == "Q4_0":
        b = raw.reshape(-1, 18)
        d = _f16(b, 0)
        q = _nibbles(b[:, 2:]).reshape(-1, GROUP)
        scale, zero = d, torch.zeros_like(d)
    elif type_name == "Q4_1":
        b = raw.reshape(-1, 20)
        d, m = _f16(b, 0), _f16(b, 2)
        q = _nibbles(b[:, 4:]).reshape(-1, GROUP)
        scale, zero = d, m + 8 * d
    elif type_name == "Q4_K":
        b = raw.reshape(-1, 144)
        n = b.shape[0]
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _q4_k_scales(b[:, 4:16])
        q = _nibbles(b[:, 16:].reshape(n * 4, 32)).reshape(n * 8, GROUP)
        scale = (d * sc).reshape(-1, 1)
        zero = (8 * d * sc - dmin * mn).reshape(-1, 1)
    else:
        raise ValueError(f"{type_name} is not a 4-bit format")
    return (q.to(torch.int32).reshape(rows, cols), scale.reshape(rows, cols // GROUP),
            zero.reshape(rows, cols // GROUP))


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
    """The kernel's operands: packed weight and ``scales_and_zeros [cols // 32, rows, 2]``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, sz


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x [T, in] -> [T, out]`` with the packed int4 weight."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)


def int4_supported(type_name: str, rows: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether a tensor can stay packed: a 4-bit format, bf16 activations, whole groups."""
    return type_name in INT4_TYPES and dtype == torch.bfloat16 and cols % GROUP == 0 and rows % 16 == 0
