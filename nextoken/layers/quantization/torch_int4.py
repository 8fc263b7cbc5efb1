"""Weight-only int4 linears: GGUF 4-bit blocks kept packed, multiplied by PyTorch's CPU kernel.

PyTorch's ``_weight_int4pack_mm_for_cpu`` computes ``x @ W^T`` with
``W[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]`` (group size 32, q in 0..15).
Each GGML 4-bit format maps onto that exactly (ggml-common.h block layouts):

- Q4_0: ``x = d * (q - 8)``            -> scale d, zero 0
- Q4_1: ``x = d * q + m``              -> scale d, zero m + 8 d
- Q4_K: ``x = d sc_j * q - dmin m_j``  -> scale d sc_j, zero 8 d sc_j - dmin m_j (per 32-group j)

Q8_0 (``x = d * q``, q a signed byte) is split into two 4-bit halves, ``q = 16 hi + lo`` with
``lo = q & 15`` and ``hi = q >> 4`` (arithmetic shift), so ``W = W_hi + W_lo`` with
``W_hi``: scale 16 d, zero 0 and ``W_lo``: scale d, zero 8 d; the int8 weights then cost two
int4 matmuls (half the bytes of bf16 in all), with no change to the values.

The mapping is the formula rearranged, so it equals the de-quantized float32 weights
(`nextoken.layers.quantization.ggml`, the reference) up to the rounding of the scales to the activation
dtype; tests compare both.

For many rows (prefill, big batches) the int4 kernel is slower than a bf16 matmul, so
`int4_unpack` expands the 4-bit weight to bf16 just for that call (in PyTorch) instead of keeping
a dense copy in memory (`methods.TorchInt4Method` decides per call). This is the path of
``enforce_eager`` and of machines without a C compiler; our own kernel serves GGUF codes
otherwise (`qweight`).
"""

from __future__ import annotations

import torch

from nextoken.layers.quantization.ggml import f16_field, _nibbles, _q4_k_scales

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
PACK_ROWS = 64  # rows packed at a time by the loader: a multiple of the kernel's block (`packing_block`)


def int4_groups(raw: torch.Tensor, type_name: str, rows: int, cols: int) -> list[tuple]:
    """Raw blocks of a ``[rows, cols]`` tensor -> a list of int4 parts whose weights sum to it:
    each (q int32 ``[rows, cols]`` in 0..15, scale ``[rows, cols // 32]``, zero
    ``[rows, cols // 32]``), float32. One part for the 4-bit formats, two for Q8_0."""
    if type_name == "Q8_0":
        b = raw.reshape(-1, 34)
        d = f16_field(b, 0)
        q = b[:, 2:].contiguous().view(torch.int8).to(torch.int32)
        hi, lo = (q >> 4) + 8, q & 15
        return [_shaped(hi, 16 * d, torch.zeros_like(d), rows, cols), _shaped(lo, d, 8 * d, rows, cols)]
    if type_name == "Q4_0":
        b = raw.reshape(-1, 18)
        d = f16_field(b, 0)
        q = _nibbles(b[:, 2:]).reshape(-1, GROUP)
        scale, zero = d, torch.zeros_like(d)
    elif type_name == "Q4_1":
        b = raw.reshape(-1, 20)
        d, m = f16_field(b, 0), f16_field(b, 2)
        q = _nibbles(b[:, 4:]).reshape(-1, GROUP)
        scale, zero = d, m + 8 * d
    elif type_name == "Q4_K":
        b = raw.reshape(-1, 144)
        n = b.shape[0]
        d, dmin = f16_field(b, 0), f16_field(b, 2)
        sc, mn = _q4_k_scales(b[:, 4:16])
        q = _nibbles(b[:, 16:].reshape(n * 4, 32)).reshape(n * 8, GROUP)
        scale = (d * sc).reshape(-1, 1)
        zero = (8 * d * sc - dmin * mn).reshape(-1, 1)
    else:
        raise ValueError(f"{type_name} is not a 4-bit format")
    return [_shaped(q, scale, zero, rows, cols)]


def _shaped(q, scale, zero, rows: int, cols: int):
    return (q.to(torch.int32).reshape(rows, cols), scale.reshape(rows, cols // GROUP),
            zero.reshape(rows, cols // GROUP))


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
    """The kernel's operands: packed weight and ``scales_and_zeros [cols // 32, rows, 2]``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, sz


def empty_int4(rows: int, cols: int, dtype: torch.dtype):
    """Uninitialised (packed, scales_and_zeros) for a ``[rows, cols]`` weight, to be filled a
    block of 64 rows at a time (the kernel's packing is per 64-row block)."""
    return torch.empty(rows, cols // 2, dtype=torch.uint8), torch.empty(cols // GROUP, rows, 2, dtype=dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x [T, in] -> [T, out]`` with the packed int4 weight."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)


def int4_unpack(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The weight ``W [out, in]`` in the scales' dtype, expanded from the CPU kernel's operands
    (the many-row path of the PyTorch-only mode).

    The kernel's packed layout (read off ``_convert_weight_to_int4pack_for_cpu``; a test checks
    it): rows in blocks of B (`packing_block`: 64 on AVX-512 CPUs, 32 on AVX2 ones); for block
    b, column k and j < B / 2, byte ``[b, k, j]`` holds row ``B b + j`` in its low nibble and row
    ``B b + B / 2 + j`` in its high nibble.
    """
    groups, rows, _ = scales_and_zeros.shape
    cols = groups * GROUP
    block = packing_block()
    p = packed.view(rows // block, cols, block // 2)
    u = torch.stack((p & 0x0F, p >> 4), dim=2)  # [blocks, in, 2, B / 2]: row B b + B / 2 h + j
    u = u.permute(0, 2, 3, 1).reshape(rows, groups, GROUP).to(scales_and_zeros.dtype)
    scale = scales_and_zeros[..., 0].t()[..., None]  # [out, in // 32, 1]
    zero = scales_and_zeros[..., 1].t()[..., None]
    return ((u - 8) * scale + zero).reshape(rows, cols)


_BLOCK: list[int] = []


def packing_block() -> int:
    """The row block of ``_convert_weight_to_int4pack_for_cpu`` on this CPU (it follows the CPU
    kernel PyTorch dispatches to: 64 with AVX-512, 32 with AVX2), read off a probe: row n of
    128 rows of codes n // 16, so byte 0's high nibble is row B / 2's code, B / 32. 0 when the
    layout is not the one `int4_unpack` reads (then no weight is packed for that kernel)."""
    if not _BLOCK:
        q = (torch.arange(128, dtype=torch.int32) // 16)[:, None].expand(128, GROUP).contiguous()
        p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).view(-1)
        block = 32 * int(p[0] >> 4)
        ok = block in (32, 64) and PACK_ROWS % block == 0
        if ok:  # the whole layout, not just one byte
            sz = torch.stack([torch.ones(128, 1), torch.full((128, 1), 8.0)], dim=-1).transpose(0, 1).contiguous()
            _BLOCK.append(block)
            ok = torch.equal(int4_unpack(p.view(128, GROUP // 2), sz.bfloat16()).float(), q.float())
            _BLOCK.clear()
        _BLOCK.append(block if ok else 0)
    return _BLOCK[0]


def int4_supported(type_name: str, rows: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether a tensor can stay packed: a 4-bit format, bf16 activations, whole groups."""
    return type_name in INT4_TYPES and dtype == torch.bfloat16 and cols % GROUP == 0 and rows % PACK_ROWS == 0 \
        and packing_block() > 0
