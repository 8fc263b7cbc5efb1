"""GGUF block-quantized weights kept as integer codes, multiplied with int8 activations.

Every block format we read maps exactly onto one form (ggml-common.h block layouts):

    W[n, k] = scale[n, g] * u[n, k] + min[n, g],    g = k // group,  u an unsigned code

- Q4_0: ``x = d (q - 8)``              -> 4-bit u = q, group 32, scale d, min -8 d
- Q4_1: ``x = d q + m``                -> 4-bit u = q, group 32, scale d, min m
- Q4_K: ``x = d sc_j q - dmin m_j``    -> 4-bit u = q, group 32, scale d sc_j, min -dmin m_j
- Q5_0: ``x = d (q - 16)``             -> 8-bit u = q, group 32, scale d, min -16 d
- Q8_0: ``x = d q`` (q signed)         -> 8-bit u = q + 128, group 32, scale d, min -128 d
- Q6_K: ``x = d sc_j (q - 32)``        -> 8-bit u = q, group 16, scale d sc_j, min -32 d sc_j

(``min = -offset * scale`` is not stored: only the offset.) Scales are float32, so the
values are those of the float32 de-quantization (`nextoken.loader.dequant`, the reference),
exactly; `QuantWeight.dequantize` computes them and the tests compare.

`qmatmul` multiplies on our C kernel (``kernels/qmatmul.c``): activations are quantized to
int8 per 32 columns (``dx = max|x| / 127``, as llama.cpp's Q8_1 blocks), the integer dot
products run on AVX-512 VNNI, and each group's sum is scaled once. `qmatmul_reference` is the
same arithmetic in PyTorch. Reads ~0.6 bytes per weight for 4-bit formats, 1.1 for 8-bit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from nextoken.kernels import load
from nextoken.loader.dequant import QK, QK_K, _f16, _nibbles, _q4_k_scales, codes_q5_0, codes_q6_k

QWEIGHT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K")
TILE = 16  # rows per tile of the kernel's layout


@dataclass
class QuantWeight:
    """A ``[rows, cols]`` weight as unsigned codes in the kernel's tiled layout (16 rows per
    tile; see ``kernels/qmatmul.c``):

    codes: uint8 ``[rows // 16, cols // group, 16 * group * bits // 8]``;
    scales: float32 ``[rows // 16, cols // group, 16]``; mins: the same shape, or None for
    ``min = -offset * scale``. Build it with `pack` from codes in plain row order.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    offset: float
    bits: int
    group: int

    @staticmethod
    def pack(u: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, offset: float, bits: int,
             group: int) -> QuantWeight:
        """From plain codes: u ``[rows, cols]`` (0..15 for 4 bits, 0..255 for 8), scale and
        mins ``[rows, cols // group]``. Rows must be a multiple of 16."""
        rows, cols = u.shape
        ng = cols // group
        u = u.to(torch.uint8)
        if bits == 4:  # byte (j, l, i): column 4j+i low, 16+4j+i high, of row l
            c = u.view(rows // TILE, TILE, ng, 2, 4, 4)
            c = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
        else:  # byte (j, l, i): column 4j+i of row l
            c = u.view(rows // TILE, TILE, ng, group // 4, 4).permute(0, 2, 3, 1, 4)
        tiled = lambda t: None if t is None else (  # noqa: E731
            t.float().reshape(rows // TILE, TILE, ng).transpose(1, 2).contiguous())
        return QuantWeight(c.reshape(rows // TILE, ng, -1).contiguous(), tiled(scale), tiled(mins), offset, bits,
                           group)

    @property
    def shape(self) -> tuple[int, int]:
        tiles, ng, _ = self.scales.shape
        return tiles * TILE, ng * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins) if t is not None)

    def _plain(self, t: torch.Tensor) -> torch.Tensor:
        """``[tiles, ng, 16]`` -> ``[rows, ng]``."""
        return t.transpose(1, 2).reshape(t.shape[0] * TILE, t.shape[1])

    def unsigned_codes(self) -> torch.Tensor:
        """u as int32 ``[rows, cols]`` in plain row order."""
        rows, cols = self.shape
        ng = cols // self.group
        if self.bits == 4:
            c = self.codes.view(rows // TILE, ng, 4, TILE, 4)
            c = torch.stack((c & 0x0F, c >> 4), dim=2)  # [tiles, ng, half, j, l, i]
            c = c.permute(0, 4, 1, 2, 3, 5)
        else:
            c = self.codes.view(rows // TILE, ng, self.group // 4, TILE, 4).permute(0, 3, 1, 2, 4)
        return c.reshape(rows, cols).to(torch.int32)

    def plain_scales(self) -> torch.Tensor:
        return self._plain(self.scales)

    def plain_mins(self) -> torch.Tensor:
        return self._plain(self.mins) if self.mins is not None else -self.offset * self.plain_scales()

    def dequantize(self) -> torch.Tensor:
        """The weight in float32 ``[rows, cols]`` (PyTorch; the reference for the kernel)."""
        rows, cols = self.shape
        u = self.unsigned_codes().float().view(rows, cols // self.group, self.group)
        w = u * self.plain_scales()[..., None] + self.plain_mins()[..., None]
        return w.reshape(rows, cols)

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (int64 ``[T]``) de-quantized to float32 ``[T, cols]`` (an embedding
        lookup: only the rows read are expanded)."""
        rows, cols = self.shape
        ng = cols // self.group
        tile, lane = index // TILE, index % TILE
        if self.bits == 4:
            c = self.codes.view(rows // TILE, ng, 4, TILE, 4)[tile, :, :, lane]  # [T, ng, j, i]
            u = torch.stack((c & 0x0F, c >> 4), dim=2)  # [T, ng, half, j, i]
        else:
            u = self.codes.view(rows // TILE, ng, self.group // 4, TILE, 4)[tile, :, :, lane]
        u = u.reshape(-1, ng, self.group).float()
        scale = self.scales[tile, :, lane]  # [T, ng]
        mins = self.mins[tile, :, lane] if self.mins is not None else -self.offset * scale
        return (u * scale[..., None] + mins[..., None]).reshape(-1, cols)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Row ranges of one weight (each a multiple of 16 rows), stacked."""
        first = parts[0]
        cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return QuantWeight(cat([p.codes for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), first.offset, first.bits, first.group)


def qweight_supported(type_name: str, rows: int, cols: int) -> bool:
    return type_name in QWEIGHT_TYPES and cols % QK == 0 and rows % TILE == 0


def gguf_codes(raw: torch.Tensor, type_name: str, rows: int, cols: int):
    """Raw GGUF blocks (uint8) of a ``[rows, cols]`` tensor -> the arguments of
    `QuantWeight.pack`: (u ``[rows, cols]``, scale, mins or None, offset, bits, group), in plain
    row order (so rows can still be permuted). Raises `ValueError` for another format."""
    if type_name not in QWEIGHT_TYPES:
        raise ValueError(f"{type_name} cannot be kept as codes; supported: {', '.join(QWEIGHT_TYPES)}")
    mins, offset, group = None, 0.0, QK
    if type_name == "Q4_0":
        b = raw.reshape(-1, 18)
        q, scale, offset = _nibbles(b[:, 2:]).reshape(-1, QK), _f16(b, 0), 8.0
    elif type_name == "Q4_1":
        b = raw.reshape(-1, 20)
        q, scale, mins = _nibbles(b[:, 4:]).reshape(-1, QK), _f16(b, 0), _f16(b, 2)
    elif type_name == "Q4_K":
        b = raw.reshape(-1, 144)
        n = b.shape[0]
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _q4_k_scales(b[:, 4:16])
        q = _nibbles(b[:, 16:].reshape(n * 4, 32)).reshape(n * 8, QK)
        scale, mins = d * sc, -(dmin * mn)
    elif type_name == "Q5_0":
        q, scale = codes_q5_0(raw.reshape(-1, 22))
        offset = 16.0
    elif type_name == "Q8_0":
        b = raw.reshape(-1, 34)
        q = b[:, 2:].contiguous().view(torch.int8).to(torch.int32) + 128
        scale, offset = _f16(b, 0), 128.0
    else:  # Q6_K
        q, scale = codes_q6_k(raw.reshape(-1, 210))
        group, offset = 16, 32.0
    bits = 4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8
    u = q.reshape(rows, cols).to(torch.uint8)
    scale = scale.reshape(rows, cols // group)
    mins = None if mins is None else mins.reshape(rows, cols // group)
    return u, scale, mins, offset, bits, group


def from_gguf(raw: torch.Tensor, type_name: str, rows: int, cols: int) -> QuantWeight:
    """Raw GGUF blocks of a ``[rows, cols]`` tensor -> `QuantWeight`."""
    return QuantWeight.pack(*gguf_codes(raw, type_name, rows, cols))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (xq int32 ``[M, K]`` in -127..127, dx float32 ``[M, K // 32]``), per
    block of 32: ``dx = max|x| / 127``, ``xq = round_half_even(x * (1 / dx))``."""
    m, k = x.shape
    xb = x.float().view(m, k // QK, QK)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).to(torch.int32)
    return xq.view(m, k), dx


def qmatmul_reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch: ``x [M, K] -> float32 [M, N]``, with x quantized to
    int8 as in `quantize_activations` and exact integer dot products per group."""
    rows, cols = w.shape
    m = x.shape[0]
    g = w.group
    xq, dx = quantize_activations(x)
    dxg = dx.repeat_interleave(QK // g, dim=1)  # [M, K / g]
    u = w.unsigned_codes().view(rows, cols // g, g).to(torch.float64)
    xg = xq.view(m, cols // g, g).to(torch.float64)
    dots = torch.einsum("ngk,mgk->mng", u, xg)  # exact integers
    xsum = xg.sum(-1)  # [M, K / g]
    y = (dots * (w.plain_scales().double()[None] * dxg.double()[:, None])).sum(-1)
    y = y + ((xsum * dxg.double()) @ w.plain_mins().double().t())
    if bias is not None:
        y = y + bias.double()
    return y.float()


def _ptr(t: torch.Tensor | None):
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def qmatmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, portable: bool = False) -> torch.Tensor | None:
    """``x [M, K]`` (float32 or bf16) -> ``[M, N]`` in `out_dtype` (x's dtype by default), on
    the C kernel; None when the kernel is unavailable (the caller takes the PyTorch path).
    bias: float32 ``[N]`` or None. `portable`: the kernel's plain C loops (tests)."""
    lib = load("qmatmul", portable)
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    out_dtype = out_dtype or x.dtype
    x = x.contiguous()
    rows, cols = w.shape
    y = torch.empty(x.shape[0], rows, dtype=out_dtype)
    rc = lib.qmatmul(_ptr(x), ctypes.c_int(x.dtype == torch.bfloat16), ctypes.c_int64(x.shape[0]),
                     ctypes.c_int64(cols), _ptr(w.codes), ctypes.c_int(w.bits), ctypes.c_int64(w.group),
                     _ptr(w.scales), _ptr(w.mins), ctypes.c_float(w.offset), _ptr(bias), ctypes.c_int64(rows),
                     _ptr(y), ctypes.c_int(out_dtype == torch.bfloat16), ctypes.c_int64(rows))
    if rc == 1:
        raise MemoryError("qmatmul: out of memory for the quantized activations")
    if rc != 0:
        raise ValueError(f"qmatmul: unsupported weight (bits {w.bits}, group {w.group}, {cols} columns)")
    return y


def dequantize_bf16(w: QuantWeight, portable: bool = False) -> torch.Tensor:
    """The weight as bf16 ``[rows, cols]`` for one large matmul: by the C kernel when
    available (a transposed view of a ``[cols, rows]`` tensor), else `QuantWeight.dequantize`."""
    lib = load("qmatmul", portable)
    if lib is None:
        return w.dequantize().to(torch.bfloat16)
    rows, cols = w.shape
    out_t = torch.empty(cols, rows, dtype=torch.bfloat16)
    lib.qdequant_bf16_t(_ptr(w.codes), ctypes.c_int(w.bits), ctypes.c_int64(w.group), _ptr(w.scales),
                        _ptr(w.mins), ctypes.c_float(w.offset), ctypes.c_int64(rows), ctypes.c_int64(cols),
                        _ptr(out_t))
    return out_t.t()
