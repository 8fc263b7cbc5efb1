"""De-quantization of GGML block formats to float32, in PyTorch.

Each function takes the raw blocks of one tensor as ``uint8`` ``[num_blocks, type_size]`` and
returns float32 ``[num_blocks, block_size]``. The block layouts are those of ggml's
``ggml-common.h`` (``block_q4_0`` ... ``block_iq4_xs``); the tests hold every function equal to
``gguf.quants.dequantize`` on random blocks.

This is the float32 correctness reference for quantized weights; faster paths that keep the
weights quantized must match it.
"""

from __future__ import annotations

import logging

import torch

from nextoken.kernels.structs import LUT_VALUES, lut_table

log = logging.getLogger("nextoken.loader")
_told: set[str] = set()  # the formats `gguf_dequantize` has warned about

QK = 32  # elements per block of the "legacy" formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
QK_K = 256  # elements per super-block of the k-quants (Q4_K, Q5_K, Q6_K)


def f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of each block, as float32 ``[num_blocks, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` bytes -> ``[n, 2, m]``: low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1)


def _nibble_values(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes -> float32 ``[n, 32]``: low nibbles are elements 0-15, high nibbles 16-31
    (`_nibbles`' order), written straight into the float32 result (the float32 loads
    de-quantize whole models: 2.5x faster than stacking bytes, then converting)."""
    out = torch.empty(qs.shape[0], 2, qs.shape[1], dtype=torch.float32)
    out[:, 0] = qs & 0x0F
    out[:, 1] = qs >> 4
    return out.view(qs.shape[0], -1)


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0: ``d: f16, qs: u8[16]``; x = d * (q - 8). Low nibbles are elements 0-15."""
    return _nibble_values(blocks[:, 2:]).sub_(8.0).mul_(f16_field(blocks, 0))


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1: ``d: f16, m: f16, qs: u8[16]``; x = d * q + m."""
    return _nibble_values(blocks[:, 4:]).mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def codes_q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 -> (q int32 ``[n, 32]`` in 0..31, d float32 ``[n, 1]``)."""
    d = f16_field(blocks, 0)
    qh = blocks[:, 2:6].contiguous().view(torch.int32)  # [n, 1], bit j is the 5th bit of element j
    bits = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [n, 32]
    low = _nibbles(blocks[:, 6:]).reshape(-1, QK).to(torch.int32)
    return low | (bits << 4), d


def codes_q5_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_1 -> (q int32 ``[n, 32]`` in 0..31, d, m float32 ``[n, 1]``): Q5_0's codes after a second
    float16, the minimum."""
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    q, _ = codes_q5_0(torch.cat((blocks[:, :2], blocks[:, 4:]), dim=1))
    return q, d, m


def dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1: ``d: f16, m: f16, qh: u32 (5th bits), qs: u8[16]``; x = d * q + m."""
    q, d, m = codes_q5_1(blocks)
    return d * q.float() + m


def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0: ``d: f16, qh: u32 (5th bits), qs: u8[16]``; x = d * (q - 16)."""
    q, d = codes_q5_0(blocks)
    return d * (q.float() - 16.0)


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0: ``d: f16, qs: i8[32]``; x = d * q."""
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(f16_field(blocks, 0))


def _q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 bytes of 6-bit scales and mins of a Q4_K/Q5_K super-block -> two ``[n, 8]``."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K: ``d: f16, dmin: f16, scales: u8[12], qs: u8[128]``; 8 sub-blocks of 32.

    x = d * sc[j] * q - dmin * m[j]; each 32 bytes of qs hold sub-block 2i (low nibbles) and
    2i+1 (high nibbles).
    """
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = _q4_k_scales(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32).reshape(n * 4, 32))  # [4n, 2, 32]
    q = q.reshape(n, 8, 32).float()
    x = (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)
    return x.reshape(n, QK_K)


def codes_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K's codes, uint8 ``[n, 256]`` in 0..31: Q4_K's nibbles (``qs`` at byte 48) and a fifth
    bit from ``qh: u8[32]`` (byte 16): bit j of ``qh[l]`` is that of element l of sub-block j."""
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n * 4, 32)).reshape(n, 8, 32)
    fifth = (blocks[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    return (low | (fifth << 4)).reshape(n, QK_K)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K: ``d: f16, dmin: f16, scales: u8[12], qh: u8[32], qs: u8[128]``; 8 sub-blocks of 32,
    x = d * sc[j] * q - dmin * m[j] as Q4_K, with 5-bit q (`codes_q5_k`)."""
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = _q4_k_scales(blocks[:, 4:16])
    q = codes_q5_k(blocks).reshape(n, 8, 32).float()
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(n, QK_K)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: ``ql: u8[128], qh: u8[64], scales: i8[16], d: f16``; 16 sub-blocks of 16.

    x = d * scale[j] * (q - 32) with q = low 4 bits from ql | 2 high bits from qh.
    """
    n = blocks.shape[0]
    q, scale = codes_q6_k(blocks)
    x = scale.reshape(n, 16, 1) * (q.reshape(n, 16, 16).float() - 32)
    return x.reshape(n, QK_K)


def codes_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K -> (q int16 ``[n, 256]`` in 0..63, scale = d * scales[j] float32 ``[n, 16]``)."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = f16_field(blocks, 208)
    low = _nibbles(ql.reshape(n * 2, 64)).reshape(n, 2, 2, 64)  # [n, half, nibble, 64]
    low = low.reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (qh.reshape(n, 2, 1, 32) >> shifts) & 0x03  # [n, half, 4, 32]
    high = high.reshape(n, 8, 32)
    q = low.to(torch.int16) | (high.to(torch.int16) << 4)
    return q.reshape(n, QK_K), d * scales


_SHIFTS2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K's and Q3_K's 2-bit planes: ``[n, 64]`` bytes -> ``[n, 256]`` in 0..3; each 32 bytes hold
    128 elements, bits 2j..2j+1 of byte l element 32 j + l."""
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> _SHIFTS2) & 3).reshape(n, QK_K)


def codes_q3_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q3_K -> (q uint8 ``[n, 256]`` in 0..7, the 16 sub-blocks' scales ``sc - 32`` float32 ``[n,
    16]``, d float32 ``[n, 1]``). ``hmask: u8[32]`` (bit j of byte l: the high bit of element 32 j
    + l), ``qs: u8[64]`` (`_crumbs`), ``scales: u8[12]`` (6 bits each: low nibbles in bytes 0-7,
    sub-blocks 0-7 then 8-15; high 2 bits in bytes 8-11), ``d: f16``."""
    n = blocks.shape[0]
    sc = blocks[:, 96:108]
    low = (sc[:, :8].reshape(n, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 2, 1)).reshape(n, 16) & 0x0F
    high = (sc[:, 8:].reshape(n, 1, 4) >> _SHIFTS2.view(1, 4, 1)).reshape(n, 16) & 3
    high_bit = (blocks[:, :32].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    q = _crumbs(blocks[:, 32:96]) | (high_bit.reshape(n, QK_K) << 2)
    return q, (low | (high << 4)).float() - 32.0, f16_field(blocks, 108)


def dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K: 16 sub-blocks of 16, x = d * (sc_j - 32) * (q - 4) with 3-bit q (`codes_q3_k`; ggml
    stores q - 4 as 2 low bits and a high bit that, set, means "no -4")."""
    n = blocks.shape[0]
    q, sc, d = codes_q3_k(blocks)
    return ((d * sc).unsqueeze(-1) * (q.reshape(n, 16, 16).float() - 4.0)).reshape(n, QK_K)


def codes_q2_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q2_K -> (q uint8 ``[n, 256]`` in 0..3, scales and mins float32 ``[n, 16]`` in 0..15, d and
    dmin float32 ``[n, 1]``): ``scales: u8[16]`` (low nibble the scale, high the min),
    ``qs: u8[64]`` (`_crumbs`), ``d: f16, dmin: f16``."""
    sc = blocks[:, :16]
    return _crumbs(blocks[:, 16:80]), (sc & 0x0F).float(), (sc >> 4).float(), f16_field(blocks, 80), \
        f16_field(blocks, 82)


def dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K: 16 sub-blocks of 16, x = d * sc_j * q - dmin * m_j with 2-bit q (`codes_q2_k`)."""
    n = blocks.shape[0]
    q, sc, mn, d, dmin = codes_q2_k(blocks)
    return ((d * sc).unsqueeze(-1) * q.reshape(n, 16, 16).float() - (dmin * mn).unsqueeze(-1)).reshape(n, QK_K)


# the 16 values IQ4_NL's and IQ4_XS's 4-bit indices select (ggml-common.h: kvalues_iq4nl)
IQ4_VALUES = torch.tensor(LUT_VALUES[1], dtype=torch.int32)


def codes_iq4_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL -> (indices uint8 ``[n, 32]`` into `IQ4_VALUES`, d float32 ``[n, 1]``). The indices
    lie as Q4_0's codes (low nibbles are elements 0-15)."""
    return _nibbles(blocks[:, 2:]).reshape(-1, QK), f16_field(blocks, 0)


def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_NL: ``d: f16, qs: u8[16]``; x = d * kvalues[q], a non-uniform 4-bit grid."""
    q, d = codes_iq4_nl(blocks)
    return d * IQ4_VALUES[q.long()].float()


def codes_iq4_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ4_XS -> (indices uint8 ``[n, 256]`` into `IQ4_VALUES`, the 8
    sub-blocks' scales ``ls - 32`` float32 ``[n, 8]`` in -32..31, d float32 ``[n, 1]``). Sub-block
    j's 6-bit ``ls``: low 4 bits from ``scales_l[j // 2]`` (nibble j % 2), high 2 from bits 2j of
    ``scales_h``; its 32 indices lie as Q4_0's."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    high = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # [n, 1] scales_h
    j = torch.arange(8)
    low = (blocks[:, 4:8].to(torch.int32)[:, j // 2] >> (4 * (j % 2))) & 0x0F
    ls = low | (((high >> (2 * j)) & 3) << 4)
    return _nibbles(blocks[:, 8:].reshape(n * 8, 16)).reshape(n, QK_K), (ls - 32).float(), d


def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS: ``d: f16, scales_h: u16, scales_l: u8[4], qs: u8[128]``; 8 sub-blocks of 32,
    x = d * (ls_j - 32) * kvalues[q] (`codes_iq4_xs`)."""
    n = blocks.shape[0]
    q, ls, d = codes_iq4_xs(blocks)
    return ((d * ls).unsqueeze(-1) * IQ4_VALUES[q.long()].reshape(n, 8, 32).float()).reshape(n, QK_K)


def codes_iq3_s(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ3_S -> (q int8 ``[n, 256]``: odd integers in -15..15, the 8 sub-blocks' scales ``1 + 2
    s_j`` float32 ``[n, 8]``, d float32 ``[n, 1]``), with x = d (1 + 2 s_j) q. ``d: f16, qs: u8[64],
    qh: u8[8], signs: u8[32], scales: u8[4]`` (s_j: nibble j % 2 of byte j // 2): element 4k + i is
    value i of entry ``qs[k] | bit k of qh << 8`` of ggml's 512-entry grid (the `gguf` package's
    table), negated where bit k of the signs is set. Tables do the bit work: one gather brings an
    entry's four values, one a sign byte's eight signs (a 1.5B model's codes in seconds)."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    sc = blocks[:, 106:110]
    mult = (1 + 2 * torch.stack((sc & 0x0F, sc >> 4), dim=-1).reshape(n, 8)).float()
    grid, high, signs = _iq3_s_tables()
    idx = blocks[:, 2:66].to(torch.int64) | high[blocks[:, 66:74].to(torch.int64)].reshape(n, 64)
    q = grid[idx].view(torch.int8).reshape(n, QK_K)
    return q * signs[blocks[:, 74:106].to(torch.int64)].view(torch.int8).reshape(n, QK_K), mult, d


def _iq3_s_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's IQ3_S grid, its four int8 values per entry packed in an int32 ``[512]`` (from the `gguf`
    package, decoded once); for each byte, its 8 bits as 9th index bits (int64 ``[256, 8]``, 0 or
    256) and as signs (8 int8 ``+-1`` packed in an int64 ``[256]``)."""
    global _IQ3_S
    if _IQ3_S is None:
        import gguf

        gguf.quants.IQ3_S.init_grid()
        grid = torch.from_numpy(gguf.quants.IQ3_S.grid.reshape(512, 4).copy()).to(torch.int8).view(torch.int32)
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1  # [256, 8]
        _IQ3_S = grid.reshape(512), bits << 8, (1 - 2 * bits).to(torch.int8).view(torch.int64).reshape(256)
    return _IQ3_S


_IQ3_S: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def dequant_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    """IQ3_S: x = d (1 + 2 s_j) q (`codes_iq3_s`)."""
    n = blocks.shape[0]
    q, mult, d = codes_iq3_s(blocks)
    return ((d * mult).unsqueeze(-1) * q.reshape(n, 8, 32).float()).reshape(n, QK_K)


# ---- the lattice formats: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS ----------------------------
# Each entry of ggml's grid holds 4 or 8 small values; the block picks entries, signs and per-group
# scales ls: x = d f (1 + 2 ls) v, v the entry's value with its sign (IQ1: 8 (g + delta)), f a
# power of two per format. The `codes_*` functions give (v int8 ``[n, 256]``, the groups'
# multipliers ``1 + 2 ls`` float32 ``[n, groups]``, d f float32 ``[n, 1]``): every product of the
# three is exact in float32, as gguf's own de-quantization (the tests compare). With ``index``
# (the formats the kernel looks up) v comes as its place in the format's lut table instead.

_GRIDS: dict[str, torch.Tensor] = {}
_SIGNS: dict[bool, torch.Tensor] = {}
_SHIFTS7 = torch.tensor([0, 7, 14, 21])


def _grid(type_name: str) -> torch.Tensor:
    """ggml's grid of `type_name` (the `gguf` package's table, decoded once): int8 ``[entries, width]``."""
    if type_name not in _GRIDS:
        import gguf

        cls = getattr(gguf.quants, type_name)
        cls.init_grid()
        _GRIDS[type_name] = torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy()).to(torch.int8)
    return _GRIDS[type_name]


def _signs(parity: bool) -> torch.Tensor:
    """Each byte's 8 bits as signs, int8 ``+-1`` ``[256, 8]`` (bit i set: element i negative); with
    `parity`, ggml's ksigns_iq2xs ``[128, 8]``: index i's 7 bits and an 8th that makes the number of
    negative signs even."""
    if parity not in _SIGNS:
        b = torch.arange(128 if parity else 256)
        bits = (b[:, None] >> torch.arange(8)) & 1
        if parity:
            bits[:, 7] = bits[:, :7].sum(-1) & 1
        _SIGNS[parity] = (1 - 2 * bits).to(torch.int8)
    return _SIGNS[parity]



def _signed(type_name: str, entries: torch.Tensor, sign_index: torch.Tensor, parity: bool, index: bool) -> torch.Tensor:
    """Entries `entries` (int64) of `type_name`'s grid with the signs of `sign_index` (int64, into
    `_signs`' table): their signed values v, int8; or with `index`, each v's place in the
    format's lut table (`nextoken.kernels.structs.lut_table`: symmetric and centred, so -v lies at
    v's place xor 15), looked up once for the grid and once for the signs, as the values are."""
    signs = _signs(parity)[sign_index]  # one sign per value; shaped as the entries' values below
    if not index:
        g = _grid(type_name)[entries]
        return g * signs.reshape(g.shape)
    if type_name not in _PLACES:
        table = lut_table(LUT_OF[type_name])
        place = torch.zeros(128, dtype=torch.int8)  # grid values are 1..127
        for i, v in enumerate(table):
            if v > 0:
                place[v] = i
        _PLACES[type_name] = place[_grid(type_name).long()]
    places = _PLACES[type_name][entries]
    return places ^ ((signs.reshape(places.shape) >> 1) & 15)


_PLACES: dict[str, torch.Tensor] = {}
# the formats the kernel looks up -> their table's lut id (`nextoken.kernels.structs.LUT_VALUES`)
LUT_OF = {"IQ4_NL": 1, "IQ4_XS": 1, "IQ2_XXS": 2, "IQ2_XS": 2, "IQ2_S": 2, "IQ3_XXS": 3, "IQ1_S": 4, "IQ1_M": 4}


def _u32(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 fields of ``raw`` bytes ``[n, 4 m]`` as int64 ``[n, m]``."""
    return raw.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _u16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 fields of ``raw`` bytes ``[n, 2 m]`` as int64 ``[n, m]``."""
    return raw.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def codes_iq2_xxs(blocks: torch.Tensor, index: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ2_XXS (``d: f16, qs: u16[32]``): sub-block j's 8 bytes are 4 indices into iq2xxs_grid (8
    values in 8, 25, 43 each) and a uint32 of four 7-bit sign indices (ksigns_iq2xs) under ls (its
    top 4 bits); x = d / 8 (1 + 2 ls) v. 8 groups of 32."""
    n = blocks.shape[0]
    q = blocks[:, 2:].reshape(n, 8, 8)
    aux = _u32(q[:, :, 4:].reshape(n, 32))  # [n, 8]
    v = _signed("IQ2_XXS", q[:, :, :4].long(), (aux[..., None] >> _SHIFTS7) & 0x7F, True, index)
    return v.reshape(n, QK_K), (1 + 2 * (aux >> 28)).float(), f16_field(blocks, 0) * 0.125


def _nibble_mults(sc: torch.Tensor) -> torch.Tensor:
    """Bytes ``[n, m]`` of two 4-bit ls each (low first) -> ``1 + 2 ls`` float32 ``[n, 2 m]``."""
    return (1 + 2 * torch.stack((sc & 0x0F, sc >> 4), dim=-1).reshape(sc.shape[0], -1)).float()


def codes_iq2_xs(blocks: torch.Tensor, index: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ2_XS (``d: f16, qs: u16[32], scales: u8[8]``): each uint16 is a 9-bit index into
    iq2xs_grid (8 values in 8, 25, 43) under a 7-bit sign index (ksigns_iq2xs); two 4-bit ls per
    byte, one per 16 values; x = d / 8 (1 + 2 ls) v. 16 groups of 16."""
    n = blocks.shape[0]
    qs = _u16(blocks[:, 2:66])  # [n, 32]
    v = _signed("IQ2_XS", qs & 511, qs >> 9, True, index)
    return v.reshape(n, QK_K), _nibble_mults(blocks[:, 66:74]), f16_field(blocks, 0) * 0.125


def codes_iq2_s(blocks: torch.Tensor, index: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ2_S (``d: f16, qs: u8[32], signs: u8[32], qh: u8[8], scales: u8[8]``): 10-bit indices into
    iq2s_grid (low 8 bits in qs, 2 high ones per index in qh), a sign byte per 8 values, two 4-bit ls
    per byte; x = d / 8 (1 + 2 ls) v. 16 groups of 16."""
    n = blocks.shape[0]
    qh = blocks[:, 66:74].long()
    idx = blocks[:, 2:34].long().reshape(n, 8, 4) | (((qh[..., None] >> torch.tensor([0, 2, 4, 6])) & 3) << 8)
    v = _signed("IQ2_S", idx.reshape(n, 32), blocks[:, 34:66].long(), False, index)
    return v.reshape(n, QK_K), _nibble_mults(blocks[:, 74:82]), f16_field(blocks, 0) * 0.125


def codes_iq3_xxs(blocks: torch.Tensor, index: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ3_XXS (``d: f16, qs: u8[64], scales_and_signs: u32[8]``): 64 indices into iq3xxs_grid (4
    values in 4..62 each); sub-block j's uint32 holds four 7-bit sign indices under ls (its top 4
    bits); x = d / 4 (1 + 2 ls) v. 8 groups of 32."""
    n = blocks.shape[0]
    aux = _u32(blocks[:, 66:98])  # [n, 8]
    v = _signed("IQ3_XXS", blocks[:, 2:66].long().reshape(n, 8, 4, 2), (aux[..., None] >> _SHIFTS7) & 0x7F, True,
                index)  # [n, 8, 4, 2 entries, 4 values] against [n, 8, 4, 8 signs]
    return v.reshape(n, QK_K), (1 + 2 * (aux >> 28)).float(), f16_field(blocks, 0) * 0.25


def codes_iq1_s(blocks: torch.Tensor, index: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ1_S (``d: f16, qs: u8[32], qh: u16[8]``): 11-bit indices into iq1s_grid (8 values in -1..1;
    low 8 bits in qs, 3 high ones per index in qh), per 32 values a 3-bit ls and the sign of delta
    (1/8) in qh's top bits; x = d (1 + 2 ls) (g + delta) = d / 8 (1 + 2 ls) v, v = 8 g +- 1. 8 groups of 32."""
    n = blocks.shape[0]
    qh = _u16(blocks[:, 34:50])  # [n, 8]
    idx = blocks[:, 2:34].long().reshape(n, 8, 4) | (((qh[..., None] >> torch.tensor([0, 3, 6, 9])) & 7) << 8)
    g = _grid("IQ1_S")[idx]
    if index:  # the place of 8 g + delta in lut_table(4): 5 + 2 (g + 1) + (delta > 0)
        v = 5 + 2 * (g + 1) + (1 - (qh >> 15)).to(torch.int8)[..., None, None]
    else:
        v = 8 * g + (1 - 2 * (qh >> 15)).to(torch.int8)[..., None, None]
    return v.reshape(n, QK_K), (1 + 2 * ((qh >> 12) & 7)).float(), f16_field(blocks, 0) * 0.125


def codes_iq1_m(blocks: torch.Tensor, index: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ1_M (``qs: u8[32], qh: u8[16], scales: u16[4]``): 11-bit indices into iq1s_grid (3 high bits
    and the sign of delta in each nibble of qh: delta per 8 values), 3-bit ls per 16 values in
    scales, d's 16 bits in the top nibbles of the four scales; x = d / 8 (1 + 2 ls) (8 g +- 1). 16 groups of 16."""
    n = blocks.shape[0]
    sc = _u16(blocks[:, 48:56])  # [n, 4]
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.float16).float()[:, None]
    mult = (1 + 2 * ((sc[..., None] >> torch.tensor([0, 3, 6, 9])) & 7)).reshape(n, 16).float()
    qh = blocks[:, 32:48].long()
    nib = torch.stack((qh & 0x0F, qh >> 4), dim=-1).reshape(n, 32)
    g = _grid("IQ1_M")[blocks[:, :32].long() | ((nib & 7) << 8)]  # [n, 32, 8]
    if index:  # IQ1_S's values, so its table: 5 + 2 (g + 1) + (delta > 0)
        v = 5 + 2 * (g + 1) + (1 - (nib >> 3)).to(torch.int8)[..., None]
    else:
        v = 8 * g + (1 - 2 * (nib >> 3)).to(torch.int8)[..., None]
    return v.reshape(n, QK_K), mult, d * 0.125


def _lattice(codes):
    """The de-quantization of a lattice format from its `codes_*` function: x = d f mult v."""

    def dequant(blocks: torch.Tensor) -> torch.Tensor:
        v, mult, d = codes(blocks)
        n, ng = mult.shape
        return ((d * mult).unsqueeze(-1) * v.reshape(n, ng, -1).float()).reshape(n, QK_K)

    dequant.__doc__ = f"{codes.__name__.removeprefix('codes_').upper()}: x = d f (1 + 2 ls) v (`{codes.__name__}`)."
    return dequant


# type name -> (elements per block, bytes per block, function)
BLOCK_FORMATS = {
    "Q4_0": (QK, 18, dequant_q4_0),
    "Q4_1": (QK, 20, dequant_q4_1),
    "Q5_0": (QK, 22, dequant_q5_0),
    "Q5_1": (QK, 24, dequant_q5_1),
    "Q8_0": (QK, 34, dequant_q8_0),
    "Q4_K": (QK_K, 144, dequant_q4_k),
    "Q5_K": (QK_K, 176, dequant_q5_k),
    "Q6_K": (QK_K, 210, dequant_q6_k),
    "Q2_K": (QK_K, 84, dequant_q2_k),
    "Q3_K": (QK_K, 110, dequant_q3_k),
    "IQ3_S": (QK_K, 110, dequant_iq3_s),
    "IQ4_NL": (QK, 18, dequant_iq4_nl),
    "IQ4_XS": (QK_K, 136, dequant_iq4_xs),
    "IQ1_S": (QK_K, 50, _lattice(codes_iq1_s)),
    "IQ1_M": (QK_K, 56, _lattice(codes_iq1_m)),
    "IQ2_XXS": (QK_K, 66, _lattice(codes_iq2_xxs)),
    "IQ2_XS": (QK_K, 74, _lattice(codes_iq2_xs)),
    "IQ2_S": (QK_K, 82, _lattice(codes_iq2_s)),
    "IQ3_XXS": (QK_K, 98, _lattice(codes_iq3_xxs)),
}


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """De-quantize one tensor's raw data to float32 of `shape` (PyTorch order, rows first).

    `raw` is the tensor's bytes as ``uint8`` (any shape), or for F32/F16/BF16 also data already
    of that type. The formats of `BLOCK_FORMATS` are ours; any other the `gguf` package reads
    (TQ1_0, TQ2_0, MXFP4 ...) goes through its NumPy de-quantization
    (`gguf_dequantize`). Raises `NotImplementedError` naming the type for a format neither reads.
    """
    if type_name in ("F32", "F16", "BF16"):
        typed = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        if raw.dtype == torch.uint8:  # the stored bytes
            raw = raw.contiguous().view(typed)
        return raw.reshape(shape).float()
    if type_name not in BLOCK_FORMATS:
        return gguf_dequantize(raw, type_name, shape)
    block_size, type_size, fn = BLOCK_FORMATS[type_name]
    blocks = raw.reshape(-1, type_size)
    return fn(blocks).reshape(shape)


def gguf_dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A format without a de-quantization of ours, through `gguf.quants.dequantize` (the gguf
    package's NumPy port of ggml's): ``raw`` uint8 bytes -> float32 of `shape`. Raises
    `NotImplementedError` naming the type when gguf does not read it either."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, type_name, None)
    try:
        if qtype is None or qtype not in gguf.GGML_QUANT_SIZES:
            raise NotImplementedError(type_name)
        rows = 1
        for n in shape[:-1]:
            rows *= n
        values = gguf.quants.dequantize(raw.contiguous().view(torch.uint8).reshape(rows, -1).numpy(), qtype)
    except NotImplementedError:
        raise NotImplementedError(f"GGML tensor type {type_name} is not supported: neither nextoken nor the gguf "
                                  f"package de-quantizes it") from None
    if type_name not in _told:
        _told.add(type_name)
        log.warning("%s tensors have no nextoken kernel: de-quantized at load by the gguf package (dense weights: "
                    "more memory than the file, dense speed)", type_name)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
