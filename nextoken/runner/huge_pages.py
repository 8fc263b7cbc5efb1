"""The weights in 2 MiB pages: one arena per model, advised for Linux transparent huge pages.

A decode step reads every weight once, from memory, as a stream. On 4 KiB pages each 4 KiB of
that stream needs its own TLB entry; in a virtual machine a miss walks two page tables (the
guest's and the host's), and the stream waits on the walks. In 2 MiB pages one entry covers 512
times as much. Measured on a 2-core Sapphire Rapids VM (kernel 6.18, transparent huge pages
``madvise``, the default of most distributions): a bare two-thread read 22-24 -> 29-31 GB/s, our
kernels' one-row stream 15-18 -> 18-22 GB/s by format, Qwen2.5-Coder-0.5B greedy decode 45.8-46.8
-> 56.4-59.2 tok/s (`docs/benchmarks.md`, 2026-11-29).

`place_weights` copies each linear layer's weight (its GGUF codes, scales and mins, or its dense
weight) into one anonymous mapping advised ``MADV_HUGEPAGE`` and aligned to 2 MiB, and points the
layer at the copy; the tensors loaded before are then released, so the resident memory stays
that of the weights: the loader's own buffers are freed, and the pages of a mapped file (the
prepared-weights cache) that the copies read are dropped from this process as each 8 MiB piece is
copied (``MADV_DONTNEED``; unwritten pages of a private file mapping: read again from the file if
ever touched), so the load's peak is the arena plus one piece. An
untied embedding table stays in that mapping: a lookup reads a few of its rows, never the table.
Where the system's transparent huge pages are ``never`` (or the OS has none), or
``NEXTOKEN_HUGE_PAGES=0`` is in the environment (every process it reaches: a test suite's servers
too), the weights stay where they were loaded; where the kernel gives fewer than asked,
`WeightsArena.describe` says how many it gave. The copies hold the same bytes: every output is
unchanged (tests/engine/test_huge_pages.py).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import torch

from nextoken.loader.host_memory import libc

HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14: fault a range in with one call
ALIGN = 64  # each tensor starts on a cache line (the kernels' vector loads)
COPY_CHUNK = 8 << 20  # bytes copied (and, from a mapped file, faulted in and dropped) at a time
QWEIGHT_FIELDS = ("codes", "scales", "mins", "scale_sup", "min_sup")


@dataclass
class WeightsArena:
    """The mapping that holds a model's linear weights: `nbytes` of them from `address`."""

    buffer: mmap.mmap
    address: int
    nbytes: int

    def huge_bytes(self) -> int:
        """Bytes of the arena the kernel backs with huge pages now (``AnonHugePages`` of its
        mapping in /proc/self/smaps), or 0 when that cannot be read."""
        try:
            with open("/proc/self/smaps") as f:
                inside = False
                for line in f:
                    head = line.split(" ", 1)[0]
                    if "-" in head and ":" not in head:
                        lo, hi = (int(v, 16) for v in head.split("-"))
                        inside = lo <= self.address < hi
                    elif inside and line.startswith("AnonHugePages:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            return 0
        return 0

    def describe(self) -> str:
        """For the execution plan's line: how much of the weights sit in 2 MiB pages."""
        huge = min(self.huge_bytes(), self.nbytes)  # (the mapping's alignment slack is huge too)
        if huge == 0:
            return f"weights {self.nbytes / 2**20:.0f} MiB in 4 KiB pages (no transparent huge pages here)"
        return f"weights {self.nbytes / 2**20:.0f} MiB, {huge / 2**20:.0f} MiB of them in 2 MiB pages"


def thp_mode() -> str:
    """The system's transparent huge page setting (``always``, ``madvise`` or ``never``), or ""
    where it cannot be read: with ``never`` the arena would only cost its copy."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


def arena_switched_off() -> bool:
    """``NEXTOKEN_HUGE_PAGES=0`` in the environment: no arena in this process, whatever
    ``huge_pages`` says (as ``NEXTOKEN_NATIVE_KERNELS=0`` for the kernels)."""
    return os.environ.get("NEXTOKEN_HUGE_PAGES") == "0"


def _weights(model) -> list[tuple[object, str, torch.Tensor]]:
    """(holder, attribute, tensor) of every linear weight the decode step streams: each
    `QuantWeight`'s fields, or a dense weight; each tensor once (a tied head shares its table)."""
    from nextoken.layers.linear import Linear

    out, seen = [], set()
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        if m.qweight is not None:
            holders = [(m.qweight, f) for f in QWEIGHT_FIELDS]
        elif m.weight is not None:
            holders = [(m.weight, "data")]
        else:  # int4 parts (PyTorch's kernel): left as they are
            continue
        for holder, name in holders:
            t = getattr(holder, name)
            if t is not None and id(t) not in seen and t.device.type == "cpu":
                seen.add(id(t))
                out.append((holder, name, t))
    return out


def place_weights(model) -> WeightsArena | None:
    """Move `model`'s linear weights into one 2 MiB-aligned arena advised for huge pages (the
    module's comment). Returns the arena (kept by the caller for the model's life), or None when
    there is nothing to place, this platform has no ``MADV_HUGEPAGE`` or the system's transparent
    huge pages are ``never``. Raises `OSError` when the mapping cannot be made."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() == "never":
        return None
    weights = _weights(model)
    if not weights:
        return None
    sizes = [t.numel() * t.element_size() for _, _, t in weights]
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes)
    buf = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copies fault in huge pages
    arena = torch.frombuffer(buf, dtype=torch.uint8)
    start = (-arena.data_ptr()) % HUGE_PAGE
    _madvise(arena.data_ptr() + start, total, MADV_POPULATE_WRITE)
    off = start
    files = _file_mappings()
    for (holder, name, t), n in zip(weights, sizes):
        mapped = any(a <= t.data_ptr() and t.data_ptr() + n <= b for a, b in files)  # of the cache file
        _copy_bytes(t, arena[off : off + n], mapped)
        setattr(holder, name, arena[off : off + n].view(t.dtype).view(t.shape))  # (a Parameter's .data: it stays)
        off += -(-n // ALIGN) * ALIGN
    _forget_pointers(model)
    return WeightsArena(buf, arena.data_ptr() + start, total)


def _copy_bytes(t: torch.Tensor, dst: torch.Tensor, mapped: bool) -> None:
    """Copy contiguous `t`'s bytes into `dst` (uint8, as many bytes) in `COPY_CHUNK` pieces that
    end on the chunk's multiples of address. `mapped` (`t` lies in a private mapping of a file):
    each piece's pages are faulted in with one call before its copy and dropped from this process
    after it (``MADV_DONTNEED``: unwritten, so the file still has them), so that a large tensor
    (a tied 262k-row table: 137 MiB) is never resident twice at once: the load's peak stays the
    arena's plus one piece."""
    src = t.reshape(-1).view(torch.uint8)
    base, n = t.data_ptr(), dst.numel()
    lo = 0
    while lo < n:
        hi = min(n, (base + lo) // COPY_CHUNK * COPY_CHUNK + COPY_CHUNK - base)
        if mapped:
            _madvise(base + lo, hi - lo, MADV_POPULATE_READ)
        dst[lo:hi].copy_(src[lo:hi])
        if mapped:  # the piece's whole pages (the inner ends are on chunk multiples: whole pages)
            page = mmap.PAGESIZE
            a, b = -(-(base + lo) // page) * page, (base + hi) // page * page
            if b > a:
                _madvise(a, b - a, mmap.MADV_DONTNEED)
        lo = hi


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's private mappings of files (/proc/self/maps: an
    inode, a ``p`` mode), or [] when that cannot be read: the weights a copy may drop the pages of."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[3] != "00:00" and parts[4] != "0" and parts[1].endswith("p"):
                    lo, hi = (int(v, 16) for v in parts[0].split("-"))
                    out.append((lo, hi))
    except (OSError, ValueError):
        return []
    return out


def _madvise(address: int, nbytes: int, advice: int) -> None:
    """madvise(2) on the whole pages of the range; an advice the kernel does not know is ignored."""
    page = mmap.PAGESIZE
    lo = address // page * page
    c = libc()
    if c is not None:
        c.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(address + nbytes - lo), advice)


def _forget_pointers(model) -> None:
    """Drop the kernel views built on the old memory (built again on first use)."""
    from nextoken.layers.linear import Linear

    for m in model.modules():
        if isinstance(m, Linear):
            m._qweight_c = None
            if m.qweight is not None:
                m.qweight._c = None
