"""glibc's allocator around a model's load: where the loader's temporaries and the forward pass's
buffers come from.

glibc serves a request over its mmap threshold with a mapping of its own, returned to the OS on
free, and the heap's other requests from one region whose free top it trims back to the OS above
its trim threshold. A freshly mapped page is faulted in and zeroed on its first touch (about 3 us
a 4 KiB page on the VMs measured here), so a buffer that is freed and allocated again costs its
pages every time unless the heap keeps them. Three modes:

- loading (`loading_allocations(True)`): everything over 128 KiB is its own mapping, so the
  model's tensors, kept for its life, never sit in a heap fragmented by temporaries;
- a conversion in pieces (`scratch_allocations`, inside a load): each piece's temporaries (up to
  a few MiB) come from the heap and stay there for the next piece; the result was allocated before;
- running (`loading_allocations(False)`): the forward pass's buffers up to 32 MiB come from the
  heap and stay there when freed.

`release_free_memory` hands the heap's free pages back after a load. Where the C library is not
glibc, every function here does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging

log = logging.getLogger("nextoken.runner")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc mallopt parameters
LOADING_MMAP_THRESHOLD = LOADING_TRIM_THRESHOLD = 128 << 10  # glibc's defaults, fixed
RUN_MMAP_THRESHOLD = 32 << 20  # glibc's largest
RUN_TRIM_THRESHOLD = 1 << 30
RUN_TOP_PAD = 64 << 20
SCRATCH_TRIM_THRESHOLD = 256 << 20
SCRATCH_ELEMENTS = 1 << 18  # values a conversion's piece yields (1 MiB of float32): temporaries of a few MiB

_state = {"mode": "default"}  # glibc's own adaptive settings until a load sets them


@functools.cache
def libc():
    """glibc (mallopt, malloc_trim, madvise), or None elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def _set(settings: list[tuple[int, int]]) -> None:
    c = libc()
    for param, value in settings:
        if c.mallopt(param, value) != 1:
            log.debug("mallopt(%d, %d) was refused", param, value)


def loading_allocations(loading: bool) -> None:
    """Enter the loading mode (`loading`) or the running mode (the module's comment).

    The trim threshold and top pad matter as much as the mmap threshold: once mallopt sets a
    threshold, glibc stops adjusting them and trims the heap's free top above its 128 KiB default
    on every free, so each step's activations and logits went back to the OS and were faulted
    in, zeroed, again the next step (docs/benchmarks.md has the page faults and their cost;
    tests/engine/test_plan.py holds a freed 32 MiB buffer reused)."""
    if libc() is None:
        return
    _state["mode"] = "loading" if loading else "running"
    _set([(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, LOADING_TRIM_THRESHOLD)] if loading else
         [(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD), (M_TOP_PAD, RUN_TOP_PAD)])


@contextlib.contextmanager
def scratch_allocations():
    """Within a load, let a conversion in pieces reuse its temporaries' pages (the module's
    comment): without it each piece's temporaries were new mappings, faulted in and zeroed again,
    4.5 million faults and 10 s of system time for Qwen2.5-0.5B's Q5_0 file loaded as float32
    (docs/benchmarks.md). Allocate what outlives the conversion before entering. Outside a load
    (glibc's own settings, or the running mode) it changes nothing."""
    if _state["mode"] != "loading":
        yield
        return
    _set([(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, SCRATCH_TRIM_THRESHOLD)])
    try:
        yield
    finally:
        _set([(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, LOADING_TRIM_THRESHOLD)])


def release_free_memory() -> None:
    """Hand the heap's freed pages (loading temporaries) back to the OS (glibc ``malloc_trim``)."""
    c = libc()
    if c is not None:
        c.malloc_trim(0)
