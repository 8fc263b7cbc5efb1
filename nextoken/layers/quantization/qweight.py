"""GGUF block-quantized weights kept as integer codes, multiplied with int8 activations.

Every block format we read maps exactly onto one form (ggml-common.h block layouts):

    W[n, k] = scale[n, g] * u[n, k] + min[n, g],    g = k // group,  u an unsigned code

- Q4_0: ``x = d (q - 8)``              -> 4-bit u = q, group 32, scale d, min -8 d
- Q4_1: ``x = d q + m``                -> 4-bit u = q, group 32, scale d, min m
- Q4_K: ``x = d sc_j q - dmin m_j``    -> 4-bit u = q, group 32, scale sc_j * d, min m_j * (-dmin)
- Q5_0: ``x = d (q - 16)``             -> 5-bit u = q, group 32, scale d, min -16 d
- Q5_1: ``x = d q + m``                -> 5-bit u = q, group 32, scale d, min m
- Q5_K: ``x = d sc_j q - dmin m_j``    -> 5-bit u = q, group 32, scale sc_j * d, min m_j * (-dmin)
- Q8_0: ``x = d q`` (q signed)         -> 8-bit u = q + 128, group 32, scale d, min -128 d
- Q6_K: ``x = d sc_j (q - 32)``        -> 6-bit u = q, group 16, scale sc_j * d, min -32 scale
- Q3_K: ``x = d (sc_j - 32) (q - 4)``  -> 3-bit u = q, 4-bit layout, group 16, scale (sc_j - 32) * d, min -4 scale
- Q2_K: ``x = d sc_j q - dmin m_j``    -> 2-bit u = q, 4-bit layout, group 16, scale sc_j * d, min m_j * (-dmin)
- IQ3_S: ``x = d (1 + 2 s_j) q``        -> 5-bit u = q + 16 (q odd, -15..15), group 32, scale (1 + 2 s_j) * d, min -16 scale
- IQ4_NL: ``x = d v[q]``               -> 4-bit u = q, looked up: v[u] + 128, group 32, scale d, min -128 d
- IQ4_XS: ``x = d (ls_j - 32) v[q]``   -> the same, scale (ls_j - 32) * d, min -128 scale
- IQ3_XXS, IQ2_XXS, IQ1_S: ``x = d f (1 + 2 ls_j) v`` (v: a grid entry's value with its sign; f 1/4
  or 1/8) -> 4-bit u = v's index in the format's table, looked up: v + 128, group 32,
  scale (1 + 2 ls_j) * d f, min -128 scale
- IQ2_XS, IQ2_S: the same with groups of 16 -> the indices in the 4-bit layout of groups of 16 (Q6_K's low plane)
- IQ1_M: ``x = d / 8 (1 + 2 ls_j) v`` (v = 8 g +- 1, IQ1_S's values) -> as IQ2_XS, with IQ1_S's table

(v for IQ4: the 16 values of its non-uniform grid, -127..113, `ggml.IQ4_VALUES`; for the lattice
formats `ggml.codes_iq2_xxs` and its neighbours. ``lut``: the kernel keeps 4-bit indices into a
table of 16 values (`nextoken.kernels.structs.LUT_VALUES`), for IQ4 as the file, and looks them up
as it unpacks them; the arithmetic is then Q8_0's, on 8-bit codes ``v + 128``. The lattice
formats' files are smaller than their codes here: 1.56-3.06 bits a weight against 4.5 with a lut
(4.6 in groups of 16).)

Scales and mins are kept as GGUF has them, so the weight takes no more bytes than in the file
(decode reads every weight once per step: bytes are time): one float16 per block for the
legacy formats; for the k-quants an int8 per group times one float32 per super-block of 256
columns (``scale_sup``, ``min_sup``). ``min = -offset * scale`` is not stored at all, only the
offset. The products are those of the float32 de-quantization (`nextoken.layers.quantization.ggml`, the
reference), exactly; `QuantWeight.dequantize` computes them and the tests compare.

`qmatmul` multiplies on our C kernel (``kernels/qmatmul.c``): activations are quantized to
int8 per block of columns (``dx = max|x| / 127``), 32 for the legacy formats (as llama.cpp's
Q8_1 blocks) and one super-block of 256 for the k-quants (as llama.cpp's Q8_K: a super-block's
scaled integer sums then add up in integers), the integer dot products run on AVX-512 VNNI, and
each sum is scaled once. `qmatmul_reference` is the same arithmetic in PyTorch.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field, replace

import torch

from nextoken.kernels.structs import LUT_VALUES, QW, lut_codes, lut_table
from nextoken.layers.quantization.ggml import BLOCK_FORMATS, LUT_OF, QK, QK_K, f16_field, _nibbles, _q4_k_scales, codes_iq1_m, \
    codes_iq1_s, codes_iq2_s, codes_iq2_xs, codes_iq2_xxs, codes_iq3_s, codes_iq3_xxs, codes_iq4_nl, codes_iq4_xs, \
    codes_q2_k, codes_q3_k, codes_q5_0, codes_q5_1, codes_q5_k, codes_q6_k

# each format kept as codes -> the bits of the kernel layout its codes take
CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q8_0": 8, "Q6_K": 6, "Q3_K": 4,
             "Q2_K": 4, "IQ3_S": 5, "IQ4_NL": 4, "IQ4_XS": 4, "IQ3_XXS": 4, "IQ2_XXS": 4, "IQ1_S": 4, "IQ2_XS": 4,
             "IQ2_S": 4, "IQ1_M": 4}
QWEIGHT_TYPES = tuple(CODE_BITS)
TILE = 16  # rows per tile of the kernel's layout
# the lattice formats' codes functions (with index=True: their values' places in their `LUT_OF` table)
LATTICE = {"IQ3_XXS": codes_iq3_xxs, "IQ2_XXS": codes_iq2_xxs, "IQ1_S": codes_iq1_s, "IQ2_XS": codes_iq2_xs,
           "IQ2_S": codes_iq2_s, "IQ1_M": codes_iq1_m}
# lut id -> the 8-bit codes its indices stand for (int32 [16])
LUT_CODES = {k: torch.tensor(lut_table(k), dtype=torch.int32) + 128 for k in LUT_VALUES}


@dataclass
class PlainCodes:
    """A weight's codes and scales in plain row order (rows can still be permuted).

    u: ``[rows, cols]`` (0..15 for 4 bits, 0..31 for 5, 0..63 for 6, 0..255 for 8); scale, mins: ``[rows, cols // group]``
    float32, each either an exact float16 value (``*_sup`` None) or an int8 value to multiply by
    ``*_sup [rows, cols // group // gps]``; mins None means ``-offset * scale``; lut k > 0: u holds
    4-bit indices whose codes are ``LUT_CODES[k][u]``.
    """

    u: torch.Tensor
    scale: torch.Tensor
    scale_sup: torch.Tensor | None
    mins: torch.Tensor | None
    min_sup: torch.Tensor | None
    offset: float
    bits: int
    group: int
    gps: int = 1  # groups per super-block
    lut: int = 0  # k > 0: u is a 4-bit index into table k (`LUT_VALUES`), the code is LUT_CODES[k][u]

    def map_rows(self, fn) -> PlainCodes:
        """Apply `fn` (a row permutation, say) to every tensor indexed by row."""
        f = lambda t: None if t is None else fn(t)  # noqa: E731
        return replace(self, u=fn(self.u), scale=fn(self.scale), scale_sup=f(self.scale_sup), mins=f(self.mins),
                       min_sup=f(self.min_sup))


def _tiled(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``[rows, n]`` -> ``[rows // 16, n, 16]``: lane l of tile t is row 16 t + l."""
    if t is None:
        return None
    rows, n = t.shape
    return t.to(dtype).reshape(rows // TILE, TILE, n).transpose(1, 2).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


@dataclass
class QuantWeight:
    """A ``[rows, cols]`` weight as unsigned codes in the kernel's tiled layout (16 rows per
    tile; see ``kernels/qmatmul.c``):

    codes: uint8 ``[rows // 16, cols // group, 16 * group * bits // 8]`` (bits 4, 5, 6 or 8);
    scales, mins: ``[rows // 16, cols // group, 16]``, float16, or int8 with ``scale_sup``,
    ``min_sup``: float32 ``[rows // 16, cols // group // gps, 16]``; mins None means
    ``min = -offset * scale``. Build it with `pack`.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    scale_sup: torch.Tensor | None
    min_sup: torch.Tensor | None
    offset: float
    bits: int
    group: int
    gps: int
    lut: int = 0  # k > 0: 4-bit indices into table k (`PlainCodes.lut`)
    _c: QW | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def pack(p: PlainCodes) -> QuantWeight:
        """From plain codes (rows a multiple of 16)."""
        rows, cols = p.u.shape
        ng = cols // p.group
        u = p.u.to(torch.uint8)
        if p.bits in (4, 5) and p.group == 32:  # byte (j, l, i): column 4j+i low, 16+4j+i high, of row l
            c = u.view(rows // TILE, TILE, ng, 2, 4, 4)  # [tiles, l, ng, half, j, i]
            lo = c & 0x0F
            c = (lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
            if p.bits == 5:  # then byte (l, i): bit j = column 4j+i, bit 4+j = column 16+4j+i
                hi = (u.view(rows // TILE, TILE, ng, 2, 4, 4) >> 4).permute(0, 2, 1, 5, 3, 4)  # [t, ng, l, i, half, j]
                shift = torch.arange(8, dtype=torch.uint8).view(2, 4)
                fifth = (hi << shift).sum(dim=(-2, -1), dtype=torch.uint8)  # [tiles, ng, l, i]
                c = torch.cat((c.reshape(rows // TILE, ng, -1), fifth.reshape(rows // TILE, ng, -1)), dim=-1)
        elif p.group == 16:  # 4-bit plane (a, l, i): columns 4a+i, 8+4a+i; 6 bits: then a 2-bit plane (l, i)
            c = u.view(rows // TILE, TILE, ng, 4, 4).permute(0, 2, 3, 1, 4)  # [tiles, ng, j, l, i]
            lo, hi = c & 0x0F, c >> 4
            c = (lo[:, :, :2] | (lo[:, :, 2:] << 4)).reshape(rows // TILE, ng, -1)
            if p.bits == 6:
                high = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
                c = torch.cat((c, high.reshape(rows // TILE, ng, -1)), dim=-1)
        else:  # byte (j, l, i): column 4j+i of row l
            c = u.view(rows // TILE, TILE, ng, p.group // 4, 4).permute(0, 2, 3, 1, 4)
        sdt = torch.float16 if p.scale_sup is None else torch.int8
        mdt = torch.float16 if p.min_sup is None else torch.int8
        return QuantWeight(c.reshape(rows // TILE, ng, -1).contiguous(), _tiled(p.scale, sdt), _tiled(p.mins, mdt),
                           _tiled(p.scale_sup, torch.float32), _tiled(p.min_sup, torch.float32), p.offset, p.bits,
                           p.group, p.gps, p.lut)

    @property
    def shape(self) -> tuple[int, int]:
        tiles, ng, _ = self.scales.shape
        return tiles * TILE, ng * self.group

    @property
    def act_block(self) -> int:
        """Columns per activation scale this weight is multiplied with (``qw_act_block`` in the
        kernel): the 256-column super-block for the k-quants, 32 for the others."""
        sb = self.group * self.gps
        sup = self.scale_sup is not None and (self.mins is None or self.min_sup is not None)
        return sb if sup and sb % QK == 0 and sb & (sb - 1) == 0 and self.shape[1] % sb == 0 else QK

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins, self.scale_sup, self.min_sup)
                   if t is not None)

    def c_struct(self, bias: torch.Tensor | None = None) -> QW:
        """The kernel's view of this weight (pointers into its tensors; bias float32 ``[rows]``)."""
        if bias is None and self._c is not None:
            return self._c
        rows, cols = self.shape
        c = QW(_ptr(self.codes), _ptr(self.scales), _ptr(self.mins), _ptr(self.scale_sup), _ptr(self.min_sup),
                _ptr(bias), self.offset, self.bits, self.group, self.gps, rows, cols, lut_codes(self.lut))
        if bias is None:
            self._c = c
        return c

    def _values(self, v: torch.Tensor, sup: torch.Tensor | None, tile, lane) -> torch.Tensor:
        """Scales (or mins) of the rows ``16 tile + lane`` as float32 ``[T, cols // group]``."""
        x = v[tile, :, lane].float()
        return x if sup is None else x * sup[tile, :, lane].repeat_interleave(self.gps, dim=1)

    def _row_scales(self, tile, lane) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self._values(self.scales, self.scale_sup, tile, lane)
        mins = self._values(self.mins, self.min_sup, tile, lane) if self.mins is not None else -self.offset * scale
        return scale, mins

    def _codes(self, tile, lane) -> torch.Tensor:
        """Codes of the rows ``16 tile + lane`` as float32 ``[T, cols // group, group]``."""
        rows, cols = self.shape
        ng = cols // self.group
        if self.bits in (4, 5) and self.group == 32:
            low = self.codes[:, :, :256] if self.bits == 5 else self.codes
            c = low.reshape(rows // TILE, ng, 4, TILE, 4)[tile, :, :, lane]  # [T, ng, j, i]
            c = torch.stack((c & 0x0F, c >> 4), dim=2)  # [T, ng, half, j, i]
            if self.bits == 5:
                fifth = self.codes[:, :, 256:].reshape(rows // TILE, ng, TILE, 4)[tile, :, lane]  # [T, ng, i]
                bits = torch.stack([(fifth >> b) & 1 for b in range(8)], dim=2).view(-1, ng, 2, 4, 4)  # half, j, i
                c = c | (bits << 4)
        elif self.group == 16 and self.bits in (4, 6):  # a plane of low 4 bits; 6 bits: then the high 2
            low = self.codes[:, :, :128].view(rows // TILE, ng, 2, TILE, 4)[tile, :, :, lane]  # [T, ng, a, i]
            c = torch.cat((low & 0x0F, low >> 4), dim=2)  # [T, ng, j, i]
            if self.bits == 6:
                high = self.codes[:, :, 128:].view(rows // TILE, ng, TILE, 4)[tile, :, lane]  # [T, ng, i]
                c = c | (torch.stack([(high >> (2 * j)) & 3 for j in range(4)], dim=2) << 4)
        else:
            c = self.codes.view(rows // TILE, ng, self.group // 4, TILE, 4)[tile, :, :, lane]
        c = c.reshape(-1, ng, self.group)
        return LUT_CODES[self.lut][c.long()].float() if self.lut else c.float()

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (int64 ``[T]``) de-quantized to float32 ``[T, cols]`` (an embedding
        lookup: only the rows read are expanded)."""
        tile, lane = index // TILE, index % TILE
        scale, mins = self._row_scales(tile, lane)
        return (self._codes(tile, lane) * scale[..., None] + mins[..., None]).reshape(len(index), -1)

    def plain(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u float32 ``[rows, cols // group, group]``, scale, min ``[rows, cols // group]``)."""
        rows = torch.arange(self.shape[0])
        tile, lane = rows // TILE, rows % TILE
        return (self._codes(tile, lane), *self._row_scales(tile, lane))

    def dequantize(self) -> torch.Tensor:
        """The weight in float32 ``[rows, cols]`` (PyTorch; the reference for the kernel)."""
        return self.lookup(torch.arange(self.shape[0]))

    def row_range(self, start: int, stop: int) -> QuantWeight:
        """Rows ``[start, stop)`` (multiples of 16): views of this weight's tiles, no copy."""
        if start % TILE or stop % TILE:
            raise ValueError(f"row range [{start}, {stop}) is not in whole tiles of {TILE} rows")
        cut = lambda t: None if t is None else t[start // TILE : stop // TILE]  # noqa: E731
        return QuantWeight(cut(self.codes), cut(self.scales), cut(self.mins), cut(self.scale_sup), cut(self.min_sup),
                           self.offset, self.bits, self.group, self.gps, self.lut)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Row ranges of one weight (each a multiple of 16 rows), stacked."""
        first = parts[0]
        cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return QuantWeight(cat([p.codes for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), cat([p.scale_sup for p in parts]),
                           cat([p.min_sup for p in parts]), first.offset, first.bits, first.group, first.gps,
                           first.lut)


def qweight_supported(type_name: str, rows: int, cols: int) -> bool:
    """Whether a tensor can be kept as codes: a format we map, whole tiles of rows."""
    return type_name in QWEIGHT_TYPES and rows % TILE == 0 and cols % QK == 0


def gguf_codes(raw: torch.Tensor, type_name: str, rows: int, cols: int) -> PlainCodes:
    """Raw GGUF blocks (uint8) of a ``[rows, cols]`` tensor -> `PlainCodes`. Raises
    `ValueError` for a format not in `QWEIGHT_TYPES`."""
    if type_name not in QWEIGHT_TYPES:
        raise ValueError(f"{type_name} cannot be kept as codes; supported: {', '.join(QWEIGHT_TYPES)}")
    b = raw.reshape(-1, BLOCK_FORMATS[type_name][1])
    scale_sup = mins = min_sup = None
    offset, group, gps, lut = 0.0, QK, 1, LUT_OF.get(type_name, 0)  # (a lut's codes: v + 128)
    if type_name == "Q4_0":
        q, scale, offset = _nibbles(b[:, 2:]).reshape(-1, QK), f16_field(b, 0), 8.0
    elif type_name == "Q4_1":
        q, scale, mins = _nibbles(b[:, 4:]).reshape(-1, QK), f16_field(b, 0), f16_field(b, 2)
    elif type_name in ("Q4_K", "Q5_K"):  # the same scales and mins; Q5_K's codes have a fifth bit
        n = b.shape[0]
        sc, mn = _q4_k_scales(b[:, 4:16])  # [n, 8] each, 0..63
        q = _nibbles(b[:, 16:].reshape(n * 4, 32)).reshape(n * 8, QK) if type_name == "Q4_K" else codes_q5_k(b)
        scale, scale_sup, mins, min_sup, gps = sc, f16_field(b, 0), mn, -f16_field(b, 2), 8
    elif type_name == "Q5_0":
        q, scale = codes_q5_0(b)
        offset = 16.0
    elif type_name == "Q5_1":
        q, scale, mins = codes_q5_1(b)
    elif type_name == "Q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).to(torch.int32) + 128
        scale, offset = f16_field(b, 0), 128.0
    elif type_name == "Q3_K":  # Q6_K's form (group 16), 3-bit codes in the 4-bit layout
        q, scale, scale_sup = codes_q3_k(b)
        group, gps, offset = 16, 16, 4.0
    elif type_name == "Q2_K":  # the same with Q4_K's mins
        q, scale, mins, scale_sup, min_sup = codes_q2_k(b)
        min_sup, group, gps = -min_sup, 16, 16
    elif type_name == "IQ3_S":  # Q5_0's codes with the K-quants' int8 x super-block scales
        q, scale, scale_sup = codes_iq3_s(b)
        q, offset, gps = q + 16, 16.0, 8
    elif type_name == "IQ4_NL":  # 4-bit indices, looked up
        q, scale = codes_iq4_nl(b)
        offset = 128.0
    elif type_name == "IQ4_XS":
        q, scale, scale_sup = codes_iq4_xs(b)
        offset, gps = 128.0, 8
    elif type_name in LATTICE:  # x = d f mult v, q: v's place in its table
        q, scale, scale_sup = LATTICE[type_name](b, index=True)
        offset, group = 128.0, QK_K // scale.shape[1]
        gps = QK_K // group
    else:  # Q6_K
        q, _ = codes_q6_k(b)
        scale = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
        scale_sup, group, gps, offset = f16_field(b, 208), 16, 16, 32.0
    ng = cols // group
    shaped = lambda t, n: None if t is None else t.reshape(rows, n).float()  # noqa: E731
    return PlainCodes(q.reshape(rows, cols).to(torch.uint8), shaped(scale, ng), shaped(scale_sup, ng // gps),
                      shaped(mins, ng), shaped(min_sup, ng // gps), offset, CODE_BITS[type_name], group, gps, lut)


def from_gguf(raw: torch.Tensor, type_name: str, rows: int, cols: int) -> QuantWeight:
    """Raw GGUF blocks of a ``[rows, cols]`` tensor -> `QuantWeight`."""
    return QuantWeight.pack(gguf_codes(raw, type_name, rows, cols))


def quantize_activations(x: torch.Tensor, block: int = QK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (xq int32 ``[M, K]`` in -127..127, dx float32 ``[M, K // block]``), per
    block of `block` (32 or 256) columns: ``dx = max|x| / 127``, ``xq = round_half_even(x * (1 / dx))``."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).to(torch.int32)
    return xq.view(m, k), dx


def quantize_activations_native(x: torch.Tensor, block: int = QK, *, lib) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`quantize_activations` as the C kernel (``qmatmul`` library `lib`) computes it (for the
    tests that hold the two equal): ``x [M, K]`` float32 or bf16 -> (xq int32, dx float32), or
    None without the kernel."""
    if lib is None:
        return None
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    dx = torch.empty(m, k // block, dtype=torch.float32)
    rc = lib.qmatmul_quantize(ctypes.c_void_p(x.data_ptr()), ctypes.c_int(x.dtype == torch.bfloat16),
                              ctypes.c_int64(m), ctypes.c_int64(k), ctypes.c_int64(block), ctypes.c_void_p(q.data_ptr()),
                              ctypes.c_void_p(dx.data_ptr()))
    if rc != 0:
        raise ValueError(f"qmatmul_quantize: {'out of memory' if rc == 1 else f'{k} columns in blocks of {block}'}")
    return q.to(torch.int32), dx


def qmatmul_reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch: ``x [M, K] -> float32 [M, N]``, with x quantized to
    int8 as in `quantize_activations` (per `w.act_block` columns) and exact integer dot products
    per group."""
    m = x.shape[0]
    g = w.group
    xq, dx = quantize_activations(x, w.act_block)
    dxg = dx.repeat_interleave(w.act_block // g, dim=1).double()  # [M, K / g]
    u, scale, mins = w.plain()
    xg = xq.view(m, -1, g).double()
    dots = torch.einsum("ngk,mgk->mng", u.double(), xg)  # exact integers
    y = (dots * (scale.double()[None] * dxg[:, None])).sum(-1)
    y = y + (xg.sum(-1) * dxg) @ mins.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.float()


def dense_c_struct(weight: torch.Tensor, bias: torch.Tensor | None = None) -> QW:
    """The kernel's view of a dense bf16 weight ``[N, K]`` (contiguous; ``bits`` 16, no scales):
    ``kernels/dense_bf16.c``. bias: float32 ``[N]`` or None. The tensors must outlive the view."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"dense kernel weight: a contiguous 2-D bf16 tensor, not {weight.dtype} {tuple(weight.shape)}")
    rows, cols = weight.shape
    return QW(weight.data_ptr(), None, None, None, None, _ptr(bias), 0.0, 16, 0, 0, rows, cols)


def kernel_matmul(x: torch.Tensor, c: QW, rows: int, out_dtype: torch.dtype | None = None, *,
                  lib, rounded: bool = False) -> torch.Tensor | None:
    """``x [M, K]`` (float32 or bf16) times the weight `c` describes (codes, or dense bf16:
    `dense_c_struct`) -> ``[M, rows]`` in `out_dtype` (x's dtype by default), on the C kernel
    (``qmatmul``); None when the kernel is unavailable or x's dtype has no path. `rounded` with a
    float32 `out_dtype`: the outputs rounded to bf16 as a bf16 output would be, stored as float32
    (the LM head's logits: ``y.float()`` of the bf16 output without its pass). `lib`: the library
    the plan resolved, else loaded here (`portable`: its plain C loops). Raises `MemoryError`
    when it cannot allocate, `ValueError` for a weight it does not take."""
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out_dtype = out_dtype or x.dtype
    y = torch.empty(x.shape[0], rows, dtype=out_dtype)
    mode = 1 if out_dtype == torch.bfloat16 else 2 if rounded else 0  # qmatmul.c's Y_F32, Y_BF16, Y_F32_RB
    rc = lib.qmatmul(ctypes.c_void_p(x.data_ptr()), ctypes.c_int(x.dtype == torch.bfloat16),
                     ctypes.c_int64(x.shape[0]), ctypes.byref(c), ctypes.c_void_p(y.data_ptr()),
                     ctypes.c_int(mode), ctypes.c_int64(rows))
    if rc == 1:
        raise MemoryError("qmatmul: out of memory for its buffers")
    if rc != 0:
        raise ValueError(f"qmatmul: unsupported weight (bits {c.bits}, group {c.group}, shape [{c.N}, {c.K}])")
    return y


def qmatmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, c: QW | None = None, *, lib,
            rounded: bool = False) -> torch.Tensor | None:
    """``x [M, K]`` (float32 or bf16) -> ``[M, N]`` in `out_dtype` (x's dtype by default), on
    the C kernel; None when the kernel is unavailable (the caller takes the PyTorch path).
    bias: float32 ``[N]`` or None (or `c`, a prepared `QuantWeight.c_struct`). `portable`: the
    kernel's plain C loops (tests). `lib`: the library the execution plan resolved (the model's
    layers pass it; without it the kernel is loaded here). Raises `ValueError` for a shape the
    kernel does not take. `rounded`: `kernel_matmul`'s."""
    return kernel_matmul(x, c if c is not None else w.c_struct(bias), w.shape[0], out_dtype, lib=lib, rounded=rounded)


_scratch = threading.local()


def _scratch_buffer(numel: int) -> torch.Tensor:
    """A bf16 buffer of at least `numel` elements, reused by this thread's expansions: a fresh
    allocation per call costs its page faults every time, which for a large prefill costs more
    than the expansion itself."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=torch.bfloat16)
    return buf[:numel]


def dequantize_bf16(w: QuantWeight, scratch: bool = False, *, lib) -> torch.Tensor:
    """The weight as bf16 ``[rows, cols]`` for one large matmul: by the C kernel when
    available (a transposed view of a ``[cols, rows]`` tensor), else `QuantWeight.dequantize`.
    With `scratch` the result lives in a per-thread buffer that the next call overwrites: use
    it at once. `lib`: as for `qmatmul`."""
    if lib is None:
        return w.dequantize().to(torch.bfloat16)
    rows, cols = w.shape
    out_t = (_scratch_buffer(rows * cols) if scratch else torch.empty(rows * cols, dtype=torch.bfloat16))
    out_t = out_t.view(cols, rows)
    lib.qdequant_bf16_t(ctypes.byref(w.c_struct()), ctypes.c_void_p(out_t.data_ptr()))
    return out_t.t()
