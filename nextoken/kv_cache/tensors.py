"""The paged KV cache's tensors: keys and values of every layer, in blocks.

``k[layer]`` and ``v[layer]`` are ``[num_kv_heads, num_blocks, block_size, head_dim]``
(head-major, so gathering a batch's blocks gives ``[heads, batch, tokens, head_dim]``, the
layout the attention matmuls want, with no further copy); a token whose slot is ``s`` lives at
``[:, s // block_size, s % block_size]``. Which request owns which block is decided by
`nextoken.kv_cache`.

Sliding-window layers (Gemma 3's local layers) attend only to their last `window` keys, so they
keep no more than that: each sequence owns a ring of `ring_blocks` blocks in `SlidingKVCache`,
and position ``p`` lives in ring block ``(p // block_size) % ring_blocks`` (but for a pass's
blocks outside its ring: `kv_cache.manager.Ring`, whose blocks are paged for the prefix cache).
The ring is just large enough that the keys a pass still needs are never overwritten by the
keys it writes.

With ``kv_cache_dtype="int8"`` (``--kv-cache-dtype int8``) the paged cache holds each token's
key and value row of each KV head as int8 codes with one float32 scale per row (per token and
head, symmetric, absmax: `quantize_rows`), so a token takes ``D + 4`` bytes per head and tensor
instead of ``2 D`` in bf16 (0.53x at D = 64, 0.52x at D = 128). Rows are quantized when
written and dequantized when read (`Int8Rows`); the attention kernels read the codes in place.
The sliding-window rings stay in the model's dtype (they hold only a window).

The keys are stored rotated: ``k H`` (`hadamard_matrix`, orthogonal and symmetric), and the
queries are rotated the same way before they meet them (`PagedKVCache.queries`), so every score
``(q H) . (k H) = q . k`` is unchanged but for the rounding. Why: a few key channels of some
models are far larger than the rest (Qwen 2.5's reach 145-213 where most are a few units), and
one absmax scale per row, set by them, leaves the other channels a handful of codes; the scores
multiply those errors by the queries' own large channels (scaled scores of about 1,000 in Qwen2.5-
Coder-0.5B's layers 0 and 8) and the softmax turns them into log-probabilities 0.77 nats off. The
rotation spreads each channel over all of them (an outlier ``a`` becomes ``a / sqrt(D)`` in each)
and the worst step falls to 0.19 nats on the float32 path (`docs/design.md`). The idea is
QuaRot's online rotation of the keys (Ashkboos et al. 2024, "QuaRot: Outlier-Free 4-Bit Inference
in Rotated LLMs"), as llama.cpp applies it to quantized K caches. Values are not rotated: their error is not multiplied
by anything large (int8 values alone moved the same steps by 0.026 nats at worst).

On a GPU the tensors live in its memory (`device`), and with `spare` one more block than the
block pool hands out follows the others: the slot where a CUDA graph's padding rows write
(`PagedKVCache.spare_slot`), which no sequence reads.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from nextoken.config import KV_CACHE_DTYPES, ModelConfig


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the OS provides on first touch: an anonymous memory map, where
    ``torch.zeros`` writes every byte at allocation, all of it before the first token. Blocks
    never used never take memory; a block's first write takes its page faults. The map asks for
    small pages (``MADV_NOHUGEPAGE``): with huge pages (NumPy's ``zeros``) the first write to
    each 2 MiB of a sparse cache (the first decode step touches one block per layer and head)
    faults in the whole 2 MiB, which made the server's warm-up slow. The start is page-aligned."""
    import math
    import mmap

    import numpy as np

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8)).view(dtype).view(shape)


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero cache tensor on `device`: `lazy_zeros` on the CPU, device memory on a GPU."""
    if device.type == "cpu":
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, cache_dtype: str = "auto") -> int:
    """Bytes one block takes over all layers, keys and values (and their scales, for int8)."""
    if cache_dtype == "int8":
        rows = 2 * len(config.full_layers) * config.num_kv_heads  # key and value rows per token
        return rows * (config.head_dim + 4) * block_size
    return config.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 per row: x ``[..., D]`` -> codes int8 ``[..., D]`` and scales
    float32 ``[...]`` with ``x ~ codes * scale``: ``scale = max|x| / 127``,
    ``codes = round(x * (127 / max|x|))`` (round half to even; a zero row is all zeros, scale 0).
    The C kernel (``kernels/decode.c``, `quantize_row_i8`) computes the same float32 operations
    in the same order, so both write identical codes."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    # (a true division: ``127.0 / amax`` is computed by PyTorch as ``reciprocal(amax) * 127``)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    codes = torch.round(xf * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, amax / 127.0


def hadamard_matrix(d: int) -> torch.Tensor:
    """The rotation of an int8 cache's keys, for rows of `d` values: float32 ``[d, d]``, block
    diagonal with blocks of ``b`` = the largest power of two dividing `d` (all of `d` for the
    usual 64, 128, 256), each Sylvester's Walsh-Hadamard matrix ``H_b / sqrt(b)`` (``H_1 = [1]``,
    ``H_2m = [[H_m, H_m], [H_m, -H_m]]``). Symmetric and orthogonal, so its own inverse."""
    b = d & -d
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / math.sqrt(b)] * (d // b)).float()


def hadamard_rows(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x ``[..., D]`` rotated: ``x h`` in float32 ``[..., D]`` (h: `hadamard_matrix` on x's
    device). A float32 matmul; on a GPU the batch-invariant one (`kernels.gpu.batch_invariant.
    linear`, IEEE float32: each row's sums in one order whatever the number of rows, where
    cuBLAS's would follow the batch; ``x h^T = x h``, h being symmetric)."""
    if x.is_cuda:
        from nextoken.kernels.gpu.batch_invariant import linear

        return linear(x.float(), h)
    return x.float() @ h


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes int8 ``[..., D]``, scales ``[...]`` -> ``codes * scale`` in `dtype` (computed in float32)."""
    return (codes.float() * scales[..., None]).to(dtype)


class Int8Rows(NamedTuple):
    """One layer's int8 keys (or values) as the attention code reads them: codes int8
    ``[Hkv, num_blocks, block_size, D]``, scales float32 ``[Hkv, num_blocks, block_size]``, and
    `dtype`, the dtype rows dequantize to (the model's)."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def block_bytes(parts: list[torch.Tensor]) -> int:
    """Bytes of one block of `parts` (tensors ``[layers, Hkv, num_blocks, ...]``)."""
    return sum(t[:, :, 0].numel() * t.element_size() for t in parts)


def read_block(parts: list[torch.Tensor], block_id: int) -> memoryview:
    """A copy of block `block_id` of every tensor of `parts` in turn, C order (on the host)."""
    return memoryview(torch.cat([t[:, :, block_id].contiguous().view(-1).view(torch.uint8) for t in parts]).cpu().numpy())


def write_block(parts: list[torch.Tensor], block_id: int, payload) -> None:
    """Fill block `block_id` of `parts` from `payload`, bytes as `read_block` gives them.
    Raises `ValueError` for a payload of another size."""
    if len(payload) != block_bytes(parts):
        raise ValueError(f"a block payload of {len(payload)} bytes; this cache's blocks take {block_bytes(parts)}")
    buf, at = torch.frombuffer(payload, dtype=torch.uint8), 0
    for t in parts:
        dst = t[:, :, block_id]
        n = dst.numel() * t.element_size()
        dst.copy_(buf[at : at + n].view(t.dtype).view(dst.shape))
        at += n


def copy_waves(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(source, destination) block pairs, in order, cut into runs that may each copy at once (all
    their sources read, then all their destinations written): a run ends before a pair that
    reads a block the run writes, or writes one it already writes, so the result is the pairs'
    one by one. (A step's copies are one run but where a block freed and taken again in the same
    schedule comes back as a source or destination.)"""
    waves, run, written = [], [], set()
    for src, dst in pairs:
        if src in written or dst in written:
            waves.append(run)
            run, written = [], set()
        run.append((src, dst))
        written.add(dst)
    return waves + [run] if run else waves


class SlidingKVCache:
    """Rings of the sliding-window layers: k, v ``[num_sliding_layers, Hkv, num_blocks,
    block_size, head_dim]``; each sequence owns `ring_blocks` of the `num_blocks`."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, ring_blocks: int, dtype: torch.dtype,
                 device: torch.device = torch.device("cpu"), spare: bool = False):
        self.window, self.ring_blocks, self.num_blocks, self.block_size = \
            config.sliding_window, ring_blocks, num_blocks, block_size
        shape = (len(config.sliding_layers), config.num_kv_heads, num_blocks + spare, block_size, config.head_dim)
        self.k = cache_zeros(shape, dtype, device)
        self.v = cache_zeros(shape, dtype, device)
        self.layer_index = {layer: i for i, layer in enumerate(config.sliding_layers)}

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every sliding-window layer (the disk tier's, as `PagedKVCache`'s)."""
        return block_bytes([self.k, self.v])

    def read_block(self, block_id: int) -> memoryview:
        return read_block([self.k, self.v], block_id)

    def write_block(self, block_id: int, payload) -> None:
        write_block([self.k, self.v], block_id, payload)


TICKETS = 4096  # a decode's key splits are joined over a ticket per (decode, KV head): for up to this many


class PagedKVCache:
    """Keys and values for `num_blocks` blocks of `block_size` tokens in every full-attention
    layer (``k[layer_index[layer]]``), and `sliding` for the sliding-window layers, if any.
    `cache_dtype` ``"int8"`` stores int8 codes in `k`, `v` and their row scales in `k_scale`,
    `v_scale` ``[layers, Hkv, num_blocks, block_size]`` float32, the keys rotated by `rotation`
    (see the module docstring). On `device`; with `spare`, block `num_blocks` exists too
    (`spare_slot`)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 sliding: SlidingKVCache | None = None, cache_dtype: str = "auto",
                 device: torch.device = torch.device("cpu"), spare: bool = False):
        if cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype {cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        self.config, self.num_blocks, self.block_size, self.dtype = config, num_blocks, block_size, dtype
        self.cache_dtype, self.device, self.spare = cache_dtype, device, int(spare)
        shape = (len(config.full_layers), config.num_kv_heads, num_blocks + self.spare, block_size, config.head_dim)
        store = torch.int8 if cache_dtype == "int8" else dtype
        self.k = cache_zeros(shape, store, device)
        self.v = cache_zeros(shape, store, device)
        self.k_scale = self.v_scale = self.rotation = None
        if cache_dtype == "int8":
            self.k_scale = cache_zeros(shape[:-1], torch.float32, device)
            self.v_scale = cache_zeros(shape[:-1], torch.float32, device)
            self.rotation = hadamard_matrix(config.head_dim).to(device)  # float32 [D, D]
        self.layer_index = {layer: i for i, layer in enumerate(config.full_layers)}
        self.sliding = sliding
        # the Triton attention's tickets for its split decodes (`kernels.gpu.attention`: zeros, as
        # each launch leaves them); made here, once, so a CUDA graph's launches find them in place
        self.tickets = torch.zeros(TICKETS, dtype=torch.int32, device=device)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D]`` as the full-attention layers' keys are stored: rotated by `rotation`
        (in float32, then q's dtype) for an int8 cache, else q itself."""
        return q if self.rotation is None else hadamard_rows(q, self.rotation).to(q.dtype)

    def layer(self, i: int):
        """Layer `i`'s (keys, values): tensors ``[Hkv, num_blocks, block_size, D]``, or `Int8Rows`."""
        if self.quantized:
            return Int8Rows(self.k[i], self.k_scale[i], self.dtype), Int8Rows(self.v[i], self.v_scale[i], self.dtype)
        return self.k[i], self.v[i]

    def _paged_bytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    @property
    def nbytes(self) -> int:
        extra = self.sliding.k.nbytes + self.sliding.v.nbytes if self.sliding is not None else 0
        return self._paged_bytes() + extra

    @property
    def bytes_per_token(self) -> int:
        """Bytes of the paged (full-attention) cache per token."""
        return self._paged_bytes() // ((self.num_blocks + self.spare) * self.block_size)

    @property
    def spare_slot(self) -> int:
        """The first slot of the spare block (a CUDA graph's padding rows write there). Raises
        `ValueError` for a cache made without it."""
        if not self.spare:
            raise ValueError("this KV cache has no spare block")
        return self.num_blocks * self.block_size

    # -- whole blocks, for the disk tier (`kv_cache.disk`) ----------------------------------
    def _block_parts(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer: keys, values (and their int8 scales)."""
        return block_bytes(self._block_parts())

    def read_block(self, block_id: int) -> memoryview:
        """A copy of block `block_id`'s keys and values (and scales), `block_bytes` bytes: each
        tensor's ``[layers, Hkv, block_size, ...]`` slice in turn, C order."""
        return read_block(self._block_parts(), block_id)

    def write_block(self, block_id: int, payload) -> None:
        """Fill block `block_id` from `payload`, bytes as `read_block` gives them (writable:
        a ``bytearray`` or a view of one). Raises `ValueError` for a payload of another size."""
        write_block(self._block_parts(), block_id, payload)

    def copy_blocks(self, copies: list[tuple[int, int]], sliding: list[tuple[int, int]] = ()) -> None:
        """Copy blocks of the full-attention layers (keys, values, int8 scales), and `sliding`
        ones of the sliding-window layers' pool: for each (source, destination) block id pair in
        order, every layer's and head's rows of the source into the destination (a later pair
        may read what an earlier one wrote)."""
        for parts, pairs in ((self._block_parts(), copies),
                             ([self.sliding.k, self.sliding.v] if self.sliding is not None else [], sliding)):
            for wave in copy_waves(pairs):  # one gather and one scatter a tensor for each
                src = torch.tensor([s for s, _ in wave], dtype=torch.long, device=self.device)
                dst = torch.tensor([d for _, d in wave], dtype=torch.long, device=self.device)
                for t in parts:
                    t.index_copy_(2, dst, t.index_select(2, src))

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ``[num_tokens, num_kv_heads, head_dim]`` at their slots ``[num_tokens]``
        (for an int8 cache: the keys rotated, then both quantized)."""
        heads, d = k.shape[1], k.shape[2]
        if self.rotation is not None:
            k = hadamard_rows(k, self.rotation)
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            rows = x.transpose(0, 1)  # [Hkv, T, D]
            if scales is not None:
                rows, s = quantize_rows(rows)
                scales[layer].view(heads, -1).index_copy_(1, slot_mapping, s)
            cache[layer].view(heads, -1, d).index_copy_(1, slot_mapping, rows)
